"""The two collectives ZeRO-1/2 move data with inside a data-parallel group, in the form each backend does best.

- :func:`reduce_to_owners`: the ranks' sum of each part of a buffer lands on the rank whose shard the part
  belongs to (a reduce-scatter whose parts may be of any size, as a bucket cut at shard boundaries is).
- :func:`gather_shards`: every rank's shard of a flat buffer lands in place in every rank's copy of it.

Both move what a reduce-scatter and an all-gather move: ``(N - 1) / N`` of the buffer per rank, so ZeRO-1/2
together send what one all-reduce sends (DDP's, ZeRO-0's). Both start asynchronously and return a
:class:`Pending` to wait for.

NCCL (and any backend but gloo): one ``dist.reduce`` per owner and one ``all_gather_single``, in place,
native. gloo: point-to-point sends and receives between each pair of ranks, since gloo's own reduce and
reduce-scatter are slower than its all-reduce. Measured on 2 CPU processes, 12.8 MB, interleaved repeats,
medians: an all-reduce 9.8 ms; a reduce-scatter as messages 5.8 ms, as a reduce per owner 12.1 ms, as
``reduce_scatter_tensor`` 13.2 ms; an all-gather as messages 4.9 ms (in place, nothing staged), as
``all_gather_into_tensor`` 7.9 ms. A rank adds the parts it receives to its own in rank order: the result
does not depend on timing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Pending", "gather_shards", "reduce_to_owners"]

Piece = tuple[int, int, int]
"""``(owner, lo, hi)``: elements ``lo:hi`` of a buffer belong to the shard of group rank ``owner``."""

RECEIVE_NUMEL = 2**20
"""gloo: what a rank holds of the other ranks' parts of its own pieces while receiving them, per reduction in
flight (4 MiB of fp32): they arrive in chunks of ``RECEIVE_NUMEL / (2 (N - 1))`` elements, two per peer at a
time, so receiving never holds a copy of a bucket. The first chunks are posted when the reduction starts, the
rest as it is waited for (gloo moves a message once its receive is posted): on gloo, most of a large bucket
travels when the reduction is waited for, not while backward computes (on 2 CPU processes nothing overlaps
anyway; NCCL does not take this path)."""

# point-to-point tags, the same on every rank (every rank issues the same collectives in the same order): each
# message of the collectives in flight has its own, so none is matched with another collective's
_TAGS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
_TAG_RANGE = 2**24


class Pending:
    """Collectives started asynchronously; :meth:`wait` finishes the result and waits for them."""

    def __init__(self, works: list[dist.Work], finish: Callable[[], None] | None = None) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> None:
        if self._finish is not None:  # first: it receives what the other ranks' sends are waiting to deliver
            finish, self._finish = self._finish, None
            finish()
        for work in self._works:
            work.wait()
        self._works = []


def point_to_point(group: dist.ProcessGroup) -> bool:
    """Whether this group's collectives are made of point-to-point messages here (gloo)."""
    return str(dist.get_backend(group)) == "gloo"


def _tags(group: dist.ProcessGroup, count: int) -> int:
    """The first of ``count`` consecutive tags for one collective's messages."""
    first = _TAGS.get(group, 0)
    _TAGS[group] = (first + count) % _TAG_RANGE
    return first


def _chunks(lo: int, hi: int, world: int) -> list[tuple[int, int]]:
    step = max(RECEIVE_NUMEL // (2 * (world - 1)), 1)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


@torch.no_grad()
def reduce_to_owners(
    buffer: Tensor, pieces: list[Piece], group: dist.ProcessGroup, pool: list[Tensor] | None = None
) -> Pending:
    """Start summing ``buffer`` over the group's ranks, each piece on its owner only: once waited for, this
    rank's pieces of ``buffer`` hold the sum; what the other pieces hold then is unspecified (sent, or a
    native reduce's scratch).

    ``pool`` (gloo): receive buffers of earlier reductions, taken from it and put back when this one is done,
    so that the reductions of a backward do not each touch fresh memory (the caller keeps it from step to
    step: ZeRO-1/2 do)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return Pending([])
    if not point_to_point(group):
        works = [
            dist.reduce(buffer[lo:hi], dst=dist.get_global_rank(group, owner), group=group, async_op=True)
            for owner, lo, hi in pieces
        ]
        return Pending([w for w in works if w is not None])
    # every part of every piece travels as chunks, each with its own tag (the same numbering on every rank)
    chunked = [(owner, _chunks(lo, hi, world)) for owner, lo, hi in pieces]
    tag = _tags(group, sum(len(c) for _, c in chunked))
    sends: list[dist.Work | None] = []
    mine: list[tuple[int, int, int]] = []  # (tag, lo, hi) of the chunks this rank owns
    for owner, chunks in chunked:
        for lo, hi in chunks:
            if owner == rank:
                mine.append((tag, lo, hi))
            else:
                sends.append(dist.isend(buffer[lo:hi], group=group, group_dst=owner, tag=tag))
            tag += 1
    if not mine:
        return Pending([w for w in sends if w is not None])
    peers = [r for r in range(world) if r != rank]
    size = max(hi - lo for _, lo, hi in mine)
    slots = [[_take(pool, buffer, size) for _ in peers] for _ in range(2)]

    def receive(k: int) -> list[dist.Work | None]:
        t, lo, hi = mine[k]
        return [dist.irecv(part[: hi - lo], group=group, group_src=r, tag=t) for part, r in zip(slots[k % 2], peers)]

    first = receive(0)

    def finish() -> None:
        arriving = first
        for k, (_, lo, hi) in enumerate(mine):
            following = receive(k + 1) if k + 1 < len(mine) else []
            for work in arriving:
                if work is not None:
                    work.wait()
            for part in slots[k % 2]:  # in rank order
                buffer[lo:hi].add_(part[: hi - lo])
            arriving = following
        if pool is not None:
            pool.extend(part for pair in slots for part in pair)

    return Pending([w for w in sends if w is not None], finish)


def _take(pool: list[Tensor] | None, like: Tensor, numel: int) -> Tensor:
    """A receive buffer of at least ``numel`` elements of ``like``'s dtype and device: from ``pool`` if one
    fits, else a new one."""
    for i, part in enumerate(pool or ()):
        if part.numel() >= numel and part.dtype == like.dtype and part.device == like.device:
            return pool.pop(i)  # type: ignore[union-attr]
    return like.new_empty(numel)


@torch.no_grad()
def gather_shards(flat: Tensor, shard_numel: int, group: dist.ProcessGroup) -> Pending:
    """Start gathering every rank's shard (elements ``r * shard_numel`` onwards of ``flat`` for group rank
    ``r``) into ``flat`` on every rank, in place."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = flat[rank * shard_numel : (rank + 1) * shard_numel]
    if world == 1:
        return Pending([])
    if not point_to_point(group):
        return Pending([dist.all_gather_single(flat, mine, group, async_op=True)])
    tag = _tags(group, 1)
    works = []
    for r in range(world):
        if r != rank:
            works.append(dist.isend(mine, group=group, group_dst=r, tag=tag))
            works.append(dist.irecv(flat[r * shard_numel : (r + 1) * shard_numel], group=group, group_src=r, tag=tag))
    return Pending([w for w in works if w is not None])
