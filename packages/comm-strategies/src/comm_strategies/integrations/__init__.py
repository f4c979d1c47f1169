"""Adapters that plug comm's strategies into other trainers (each imported on demand)."""
