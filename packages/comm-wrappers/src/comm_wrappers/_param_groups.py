"""``get_lr`` / ``get_momentum`` from an optimizer's parameter groups, for every optim wrapper."""

from __future__ import annotations

from typing import Any

__all__ = ["LrMomentumMixin"]


class LrMomentumMixin:
    """MMEngine's ``get_lr`` and ``get_momentum``, read from ``self.param_groups``."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (the class using the mixin provides them)."""
        raise NotImplementedError

    def get_lr(self) -> dict[str, list[float]]:
        """Return ``{"lr": [lr of each parameter group]}``."""
        return {"lr": [group["lr"] for group in self.param_groups]}

    def get_momentum(self) -> dict[str, list[float]]:
        """Return ``{"momentum": [...]}``: each group's momentum, or its first beta, or 0."""
        values = []
        for group in self.param_groups:
            if "momentum" in group:
                values.append(group["momentum"])
            elif "betas" in group:
                values.append(group["betas"][0])
            else:
                values.append(0)
        return {"momentum": values}
