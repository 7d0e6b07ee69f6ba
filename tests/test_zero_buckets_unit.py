"""ZeRO-2's bucket queue: whatever order gradients arrive in, and whichever never arrive, every rank reduces
every bucket exactly once per backward, in one order (the reductions of different ranks pair up)."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_hybrid.strategies.zero.buckets import Bucket, BucketQueue

pytestmark = pytest.mark.unit


class _Owner:
    """Stands for a BucketGradients: records the buckets it was asked to reduce."""

    def __init__(self, log: list[int], ids: dict[int, int]) -> None:
        self.log, self.ids = log, ids
        self.finished: list[int] = []
        self.hooked = {0, 1, 2, 3, 4, 5}

    def complete(self, bucket: Bucket) -> bool:
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked)

    def holds(self, bucket: Bucket) -> bool:
        return bool(bucket.arrived)

    def start_reduction(self, bucket: Bucket):
        self.log.append(self.ids[id(bucket)])
        bucket.arrived = set()
        return lambda: self.finished.append(self.ids[id(bucket)])


def _rank(arrivals: list[list[int]], *, launch_in_backward: bool = True) -> list[int]:
    """One rank: three buckets of two parameters each; ``arrivals``: per backward, the parameters that arrive."""
    log: list[int] = []
    buckets = [Bucket(0, 2, [0, 1], []), Bucket(2, 4, [2, 3], []), Bucket(4, 6, [4, 5], [])]
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
    buckets = [Bucket(0, 2, [0, 1], []), Bucket(2, 4, [2, 3], [])]
    queue = BucketQueue()
    queue.add(_Owner(log, {id(b): i for i, b in enumerate(buckets)}), buckets)  # type: ignore[arg-type]
    buckets[0].arrived |= {0, 1}
    queue.arrived()
    assert log == []  # bucket 0 is complete, but bucket 1 goes first
    buckets[1].arrived |= {2, 3}
    queue.arrived()
    assert log == [1, 0]
    assert queue.signature != 0


def test_reductions_in_flight_are_bounded_and_all_waited_for_when_backward_ends():
    log: list[int] = []
    buckets = [Bucket(2 * i, 2 * i + 2, [2 * i, 2 * i + 1], []) for i in range(4)]
    for cap in (1, 2, 3):
        log.clear()
        queue = BucketQueue(max_in_flight=cap)
        owner = _Owner(log, {id(b): i for i, b in enumerate(buckets)})
        owner.hooked = set(range(8))
        queue.add(owner, buckets)  # type: ignore[arg-type]
        for i in reversed(range(4)):  # backward's order: every bucket completes in turn
            buckets[i].arrived |= {2 * i, 2 * i + 1}
            queue.arrived()
            assert len(log) - len(owner.finished) <= cap  # started and not yet waited for
        assert log == [3, 2, 1, 0] and owner.finished == [3, 2, 1, 0][: 4 - cap]
        queue.end_backward()
        assert owner.finished == [3, 2, 1, 0]  # oldest first, nothing in flight after backward


def test_an_unarmed_queue_starts_nothing():
    log: list[int] = []
    buckets = [Bucket(0, 2, [0, 1], [])]
    queue = BucketQueue()
    queue.armed = False  # ZeRO-0/1: a backward that does not close the accumulation window
    queue.add(_Owner(log, {id(buckets[0]): 0}), buckets)  # type: ignore[arg-type]
    buckets[0].arrived |= {0, 1}
    queue.arrived()
    queue.end_backward()
    assert log == []


def test_bucket_ranges_partition_the_buffer_and_the_first_reduced_bucket_is_small():
    import torch

    from lightning_hybrid.strategies.zero.buckets import FIRST_BUCKET_BYTES, bucket_ranges

    sizes = [300_000, 5, 700_000, 1, 200_000, 90_000]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    world = 4
    padded = -(-sum(sizes) // world) * world
    buckets = bucket_ranges(params, offsets, padded, 500_000, shard_numel=padded // world)
    assert buckets[0].lo == 0 and buckets[-1].hi == padded  # the padding is in backward's first bucket
    assert all(a.hi == b.lo for a, b in itertools.pairwise(buckets))
    assert sorted(i for b in buckets for i in b.members) == list(range(len(sizes)))
    assert buckets[-1].hi - buckets[-1].lo <= FIRST_BUCKET_BYTES // 4 + 90_000  # closes once it passes 1 MiB
    for b in buckets:
        covered = sum(hi - lo for _, lo, hi in b.owners)
        assert covered == b.hi - b.lo and all(r * padded // world <= lo < hi <= (r + 1) * padded // world
                                              for r, lo, hi in b.owners)  # fmt: skip


def test_zero0_buckets_are_reduced_in_backwards_order_from_the_first_window():
    # the plan is in backward's order (last-registered first, the first bucket small): the queue keeps it, so the
    # first window's last layers start their reduction while backward still computes, as every later window's do
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_hybrid.strategies.zero.buckets import ReplicatedBuckets

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
        params = list(model.parameters())
        queue = BucketQueue()
        owner = ReplicatedBuckets(
            params, [str(i) for i in range(len(params))], bucket_bytes=20_000, group=dist.group.WORLD, queue=queue
        )
        order = [bucket for _, bucket in queue._order]
        assert order == owner.buckets and len(order) > 2
        assert order[0].members[0] == len(params) - 1  # the last layer's parameters first
        arrived_at_start = []  # how many gradients backward had produced when each reduction started
        start = owner.start_reduction
        owner.start_reduction = lambda bucket: arrived_at_start.append(len(owner._order)) or start(bucket)
        model(torch.randn(2, 64)).sum().backward()
        queue.end_backward()
        assert arrived_at_start == [4, 8, 12], arrived_at_start  # each bucket as soon as backward completed it
    finally:
        dist.destroy_process_group()


def test_zero0_reduces_in_place_in_buffers_that_live_across_steps():
    # a step allocates no gradient-sized buffer: backward's gradients are copied into each bucket's persistent
    # buffer once, later micro-batches accumulate in place, and the reduction leaves .grad as views of it. What
    # .grad holds is what one process would hold: the window's sum (here the mean of one replica), None where no
    # gradient came
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_hybrid.strategies.zero.buckets import ReplicatedBuckets

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
        unused = nn.Linear(4, 4)  # never reached by backward
        params = [*model.parameters(), *unused.parameters()]
        queue = BucketQueue()
        owner = ReplicatedBuckets(
            params, [str(i) for i in range(len(params))], bucket_bytes=6_000, group=dist.group.WORLD, queue=queue
        )
        reference = [nn.Parameter(p.detach().clone()) for p in params[:6]]
        ref_model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
        for p, r in zip(ref_model.parameters(), reference):
            p.data = r.data
        storages: list[set[int]] = []
        for _ in range(3):
            batches = [torch.randn(4, 32) for _ in range(2)]
            for k, x in enumerate(batches):  # a window of two micro-batches, the second closes it
                queue.armed = k == 1
                owner.closed = False
                model(x).square().sum().backward()
                ref_model(x).square().sum().backward()
                if k == 0:  # accumulated in place from the first micro-batch on
                    assert all(p.grad is owner.views[i] for i, p in enumerate(params[:6]))
                queue.end_backward()
            reduced, used = owner.take()
            assert reduced == set(range(len(params))) and used == [True] * 6 + [False] * 2
            for p, r in zip(params, ref_model.parameters()):
                assert torch.equal(p.grad, r.grad)
            assert all(params[i].grad is owner.views[i] for i in range(len(params)))
            assert torch.count_nonzero(params[6].grad) == 0  # zeros were sent for it (the strategy drops it)
            storages.append({p.grad.untyped_storage().data_ptr() for p in params})
            owner.after_window()
            for p in [*params, *ref_model.parameters()]:
                p.grad = None  # Lightning's zero_grad
        # the first window's order re-plans the buckets once (new buffers), then they stay
        assert storages[1] == storages[2] and len(storages[1]) == len(owner.buckets) > 1
        # a backward with create_graph=True keeps autograd's .grad and its graph (second-order training), and
        # the reduction still averages it
        queue.armed = False
        model(batches[0]).square().sum().backward(create_graph=True)
        assert all(p.grad.grad_fn is not None and p.grad is not owner.views[i] for i, p in enumerate(params[:6]))
        want = [p.grad.detach().clone() for p in params[:6]]
        queue.armed, owner.closed = True, False
        queue.end_backward()
        assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
    finally:
        dist.destroy_process_group()
