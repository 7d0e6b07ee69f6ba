"""ZeRO-1/2's collectives on 3 gloo ranks against sums computed by hand (``tests/workers/collectives.py``)."""

from __future__ import annotations

import pytest


@pytest.mark.multiproc
def test_reduce_to_owners_and_gather_shards_match_hand_computed_sums(tmp_path):
    """Uneven parts, a rank that owns nothing in a bucket, several collectives in flight between the same ranks
    and waited for out of order: each owner gets exactly the ranks' sum of its parts, and every shard lands in
    place on every rank; by point-to-point messages (gloo; whole, and received in chunks) and by the native
    collectives (NCCL's form). And ZeRO-2 over them, its buffers allocated unzeroed and every fresh allocation
    NaN: each rank's shard gradient is exactly its slice of the ranks' mean, computed by hand."""
    from helpers import launch

    job = launch("collectives.py", {"out": str(tmp_path / "job")}, nproc=3, timeout=120)
    assert len(job.reports) == 3
    for rep in job.reports:
        assert rep["world"] == 3
        assert rep["problems"] == [], rep["problems"]
