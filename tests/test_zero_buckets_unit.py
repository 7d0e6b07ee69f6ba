"""ZeRO-2's bucket queue: whatever order gradients arrive in, and whichever never arrive, every rank reduces
every bucket exactly once per backward, in one order (the reductions of different ranks pair up)."""

from __future__ import annotations

import random

import pytest

from lightning_hybrid.strategies.zero.flat_gradients import BucketQueue, _Bucket

pytestmark = pytest.mark.unit


class _Owner:
    """Stands for a BucketGradients: records the buckets it was asked to reduce."""

    def __init__(self, log: list[int], ids: dict[int, int]) -> None:
        self.log, self.ids = log, ids
        self.hooked = {0, 1, 2, 3, 4, 5}

    def complete(self, bucket: _Bucket) -> bool:
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked)

    def holds(self, bucket: _Bucket) -> bool:
        return bool(bucket.arrived)

    def reduce_bucket(self, bucket: _Bucket) -> None:
        self.log.append(self.ids[id(bucket)])
        bucket.arrived = set()


def _rank(arrivals: list[list[int]], *, launch_in_backward: bool = True) -> list[int]:
    """One rank: three buckets of two parameters each; ``arrivals``: per backward, the parameters that arrive."""
    log: list[int] = []
    buckets = [_Bucket(0, 2, [0, 1], []), _Bucket(2, 4, [2, 3], []), _Bucket(4, 6, [4, 5], [])]
    queue = BucketQueue(launch_in_backward=launch_in_backward)
    owner = _Owner(log, {id(b): i for i, b in enumerate(buckets)})
    queue.add(owner, buckets)  # type: ignore[arg-type]
    for backward in arrivals:
        for p in backward:
            buckets[p // 2].arrived.add(p)
            queue.arrived()
        queue.end_backward()
    assert not queue.pending()
    return log


def test_every_rank_reduces_the_same_buckets_in_the_same_order_whatever_arrives():
    rng = random.Random(0)
    expected = [2, 1, 0] * 3  # last-registered first, every bucket once per backward
    for _ in range(200):
        arrivals = []
        for _ in range(3):
            used = [p for p in range(6) if rng.random() < 0.7]  # a routed expert: some parameters never arrive
            rng.shuffle(used)  # and backward's order differs between ranks
            arrivals.append(used)
        assert _rank(arrivals) == expected
        assert _rank(arrivals, launch_in_backward=False) == expected


def test_a_bucket_waits_for_the_ones_before_it_in_the_order():
    log: list[int] = []
    buckets = [_Bucket(0, 2, [0, 1], []), _Bucket(2, 4, [2, 3], [])]
    queue = BucketQueue()
    queue.add(_Owner(log, {id(b): i for i, b in enumerate(buckets)}), buckets)  # type: ignore[arg-type]
    buckets[0].arrived |= {0, 1}
    queue.arrived()
    assert log == []  # bucket 0 is complete, but bucket 1 goes first
    buckets[1].arrived |= {2, 3}
    queue.arrived()
    assert log == [1, 0]
    assert queue.signature != 0
