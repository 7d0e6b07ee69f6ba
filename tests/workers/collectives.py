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
    bufs = [_buffer(me, n, 1), _buffer(me, 9, 2), _buffer(me, n, 3)]
    # three reductions in flight at once between the same pairs of ranks before any is waited for
    pending = [
        reduce_to_owners(bufs[0], uneven, group),
        reduce_to_owners(bufs[1], partial, group),
        reduce_to_owners(bufs[2], [(r, 10 * r, 10 * r + 10) for r in range(world)], group),
    ]
    for p in reversed(pending):  # waited in the other order
        p.wait()
    for buf, pieces, m, salt in [(bufs[0], uneven, n, 1), (bufs[1], partial, 9, 2), (bufs[2], None, n, 3)]:
        pieces = pieces or [(r, 10 * r, 10 * r + 10) for r in range(world)]
        want = sum(_buffer(r, m, salt) for r in range(world))
        for owner, lo, hi in pieces:
            if owner == me and not torch.equal(buf[lo:hi], want[lo:hi]):
                problems.append(f"{label}: reduce salt {salt} piece {lo}:{hi}: {buf[lo:hi].tolist()}")
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


def main(cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo")
    problems: list[str] = []
    _run(problems, "point-to-point")
    collectives.RECEIVE_NUMEL = 12  # chunks of 3 elements (3 ranks: two peers, two chunks each at a time)
    _run(problems, "point-to-point, chunks of 3")
    collectives.point_to_point = lambda group: False  # the native collectives, as on NCCL
    _run(problems, "native")
    dist.barrier()
    write_report(cfg["out"], {"rank": rank(), "world": dist.get_world_size(), "problems": problems})


if __name__ == "__main__":
    run_worker(main)
