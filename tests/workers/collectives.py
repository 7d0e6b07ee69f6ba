"""Worker: ZeRO-1/2's collectives (``reduce_to_owners``, ``gather_shards``) against sums computed by hand.

Every rank knows every rank's buffer (each is made from the rank's number), so the expected sums are computed
locally, element by element, without any collective. Integer-valued float64 data: any summation order gives
the same bits. Both forms run on gloo: the point-to-point messages (whole, and received in chunks of 3
elements) and the native collectives (``dist.reduce``, ``all_gather_single``) that NCCL uses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from common import rank, run_worker, write_report

from lightning_hybrid.strategies.zero import collectives
from lightning_hybrid.strategies.zero.collectives import gather_shards, reduce_to_owners


def _buffer(r: int, n: int, salt: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (r + 1) + 1000 * salt + r


def _run(problems: list[str], label: str) -> None:
    me, world = dist.get_rank(), dist.get_world_size()
    assert world == 3, world  # the pieces below are cut for shards of 10 elements on 3 ranks
    group = dist.group.WORLD
    n = 30
    # a bucket cut at shard boundaries (shards of 10): three owners, uneven parts
    uneven = [(0, 0, 7), (1, 7, 17), (2, 17, 30)]
    # a bucket that covers two shards only: rank 0 only sends
    partial = [(1, 0, 4), (2, 4, 9)]
    # twice, the second time with the receive buffers the first put back in the pool (poisoned: a part
    # added before it was received would show)
    pool: list[torch.Tensor] = []
    for round_ in range(2):
        bufs = [_buffer(me, n, 1), _buffer(me, 9, 2), _buffer(me, n, 3)]
        pooled = len(pool)
        if round_ == 1 and collectives.point_to_point(group):
            if not pool:
                problems.append(f"{label}: the pool holds no receive buffer after the first round")
            for part in pool:
                part.fill_(float("nan"))
        # three reductions in flight at once between the same pairs of ranks before any is waited for
        pending = [
            reduce_to_owners(bufs[0], uneven, group, pool=pool),
            reduce_to_owners(bufs[1], partial, group, pool=pool),
            reduce_to_owners(bufs[2], [(r, 10 * r, 10 * r + 10) for r in range(world)], group),
        ]
        if round_ == 1 and collectives.point_to_point(group) and len(pool) >= pooled:
            problems.append(f"{label}: the second round's receives took nothing from the pool ({pooled})")
        for p in reversed(pending):  # waited in the other order
            p.wait()
        for buf, pieces, m, salt in [(bufs[0], uneven, n, 1), (bufs[1], partial, 9, 2), (bufs[2], None, n, 3)]:
            pieces = pieces or [(r, 10 * r, 10 * r + 10) for r in range(world)]
            want = sum(_buffer(r, m, salt) for r in range(world))
            for owner, lo, hi in pieces:
                if owner == me and not torch.equal(buf[lo:hi], want[lo:hi]):
                    got = buf[lo:hi].tolist()
                    problems.append(f"{label}: round {round_} reduce salt {salt} piece {lo}:{hi}: {got}")
    # gather: each rank's shard written in place into everyone's buffer; two in flight at once
    flats = [torch.full((3 * world,), -1.0, dtype=torch.float64) for _ in range(2)]
    for k, flat in enumerate(flats):
        flat[3 * me : 3 * me + 3] = torch.tensor([100.0 * me + k, 1.0 + k, 2.0])
    works = [gather_shards(flat, 3, group) for flat in flats]
    for w in works:
        w.wait()
    for k, flat in enumerate(flats):
        want = torch.cat([torch.tensor([100.0 * r + k, 1.0 + k, 2.0], dtype=torch.float64) for r in range(world)])
        if not torch.equal(flat, want):
            problems.append(f"{label}: gather {k}: {flat.tolist()}")


def _zero2_poisoned(problems: list[str], label: str) -> None:
    """ZeRO-2's buckets and shard gradients are allocated unzeroed: with every fresh ``torch.empty`` NaN, a
    window of two micro-batches (a branch only rank 0 takes in the first, a layer no rank uses, the padding,
    buckets cut across the owners' shards) gives each rank exactly its slice of the ranks' mean gradient,
    computed here for every rank's data without any collective."""
    from torch import nn

    from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer

    me, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(4, 3), "skip": nn.Linear(4, 3), "never": nn.Linear(4, 2)}).double()
    reference = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, use_skip: bool) -> torch.Tensor:
        out = torch.nn.functional.linear(x, params["body.weight"], params["body.bias"]).tanh()
        if use_skip:
            out = out + torch.nn.functional.linear(x, params["skip.weight"], params["skip.bias"])
        return out.square().sum()

    def batch(r: int, k: int) -> tuple[torch.Tensor, bool]:
        return torch.randn(
            5, 4, generator=torch.Generator().manual_seed(10 * r + k), dtype=torch.float64
        ), r == 0 or k == 1

    sharded = FlatShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), names={p: n for n, p in model.named_parameters()},
        group=dist.group.WORLD, zero_stage=2, reduce_gradients="every_microbatch", bucket_numel=20,
    )  # fmt: skip
    # buckets [body] (shards of ranks 0, 1) and [skip, never, padding] (ranks 1, 2): parts of the second without
    # a gradient on a rank that has others there
    assert [b.members for b in sharded.groups[0].grads.buckets] == [[0, 1], [2, 3, 4, 5]]
    real_empty = torch.empty
    torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # type: ignore[assignment]
    try:
        params = dict(model.named_parameters())
        for k in range(2):
            x, use_skip = batch(me, k)
            loss(params, x, use_skip).backward()
            sharded.queue.end_backward()
            sharded.after_backward()
        sharded.reduce_gradients()
    finally:
        torch.empty = real_empty  # type: ignore[assignment]
    for r in range(world):
        for k in range(2):
            loss(reference, *batch(r, k)).backward()
    group = sharded.groups[0]
    want = torch.cat(
        [(g.grad if g.grad is not None else torch.zeros_like(g)).reshape(-1) / world for g in reference.values()]
    )
    want = torch.cat([want, want.new_zeros(world * group.shard.numel() - want.numel())])
    s = group.shard.numel()
    got = group.shard.grad
    if got is None or not torch.allclose(got, want[me * s : (me + 1) * s], rtol=0, atol=1e-12):
        problems.append(f"{label}: ZeRO-2 shard gradient {None if got is None else got.tolist()}")


def main(cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo")
    problems: list[str] = []
    _run(problems, "point-to-point")
    _zero2_poisoned(problems, "point-to-point")
    collectives.RECEIVE_NUMEL = 12  # chunks of 3 elements (3 ranks: two peers, two chunks each at a time)
    _run(problems, "point-to-point, chunks of 3")
    _zero2_poisoned(problems, "point-to-point, chunks of 3")
    collectives.point_to_point = lambda group: False  # the native collectives, as on NCCL
    _run(problems, "native")
    _zero2_poisoned(problems, "native")
    dist.barrier()
    write_report(cfg["out"], {"rank": rank(), "world": dist.get_world_size(), "problems": problems})


if __name__ == "__main__":
    run_worker(main)
