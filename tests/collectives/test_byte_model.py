"""The handshake's byte model: bytes a rank receives per call stay bounded as the world grows."""

from __future__ import annotations

import pytest

from comm_collectives._compact import COMPACT_ABOVE, handshake_bytes

KIB = 1024


@pytest.mark.parametrize("world", [2, 3, 8, 64, 65, 128, 512, 1024, 2048, 4096])
def test_a_scalar_all_reduce_costs_at_most_64_kib_of_handshake_a_rank(world: int) -> None:
    got = handshake_bytes(world)
    if world <= COMPACT_ABOVE:  # an all-gather of 256-byte headers plus 4 KiB inline room
        assert got == (world - 1) * (256 + 4096)
    else:  # an all-reduce of the header and its negation (432 bytes), log2(W) steps
        assert got == (world - 1).bit_length() * 432
    assert got <= 272 * KIB  # the largest: 63 peers x 4.25 KiB at the threshold
    if world >= 128:
        assert got <= 64 * KIB


def test_the_byte_model_at_1024_ranks() -> None:
    assert handshake_bytes(1024) == 10 * 432  # 4,320 bytes, against 1.25 MiB gathered
    # calls that need every rank's header (all_gather, gather, objects) gather them after
    # the vote: 256-byte headers plus the room of the group (1 KiB at 1,024 ranks)
    assert handshake_bytes(1024, varying=True) == 10 * 432 + 1023 * (256 + 1024)
