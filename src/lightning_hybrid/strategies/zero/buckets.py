"""Gradient buckets whose reductions overlap backward: one order on every rank, asynchronous, bounded.

DDP's reducer starts each bucket's all-reduce as soon as backward has filled it and waits only once, when
backward ends; the reductions run while the rest of backward computes. ZeRO-0, 1 and 2 do the same here:

- :class:`BucketQueue` holds one stage's buckets in a fixed order, the same on every rank (last-registered
  first: backward runs roughly in reverse). A bucket's reduction starts, ``async_op=True``, when it is
  complete *and* every bucket before it in that order has started; :meth:`BucketQueue.end_backward` (a
  point every data-parallel rank reaches the same number of times) starts the rest, with zeros where a
  rank has nothing, and waits for all of them. So every rank issues the same collectives in the same
  order, whatever its data made backward compute (a routed expert, a branch taken on some batches only);
  where gradients arrive late or never, only the overlap is lost.
- The first bucket in that order holds at most ``FIRST_BUCKET_BYTES`` (as DDP's): the first reduction
  starts after the last layers' backward, not after a whole ``bucket_size_mb``.
- At most ``max_in_flight`` reductions are outstanding: starting one more first waits for the oldest, so
  the buckets held for reductions in flight are bounded (ZeRO-2 frees each bucket when its reduction is
  done).
- ``armed``: whether the current backward reduces at all. ZeRO-2 (``every_microbatch``) reduces every
  backward; ZeRO-0/1 only the backward that closes the accumulation window (the others accumulate
  locally, as DDP's ``no_sync``).

On a GPU the collectives run on the process group's own stream (NCCL's): starting one makes that stream
wait for the gradients computed so far, and waiting for it makes the compute stream wait for the result,
so the compute stream never waits on the network before the gradients are needed. On the host (gloo) the
backend's worker threads run them while backward computes. The code is the same.

:class:`ReplicatedBuckets` is ZeRO-0's owner of buckets (ZeRO-1's and ZeRO-2's are in ``flat_gradients``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid.strategies._user_code import RUN_BACKWARD_INSIDE

__all__ = ["Bucket", "BucketOwner", "BucketQueue", "ReplicatedBuckets", "bucket_ranges"]

MAX_IN_FLIGHT = 2
"""Reductions outstanding at once (the default of ``ZeroConfig.max_buckets_in_flight``)."""

FIRST_BUCKET_BYTES = 2**20
"""The first bucket backward completes is at most this large (DDP's choice): its reduction starts early."""

Finish = Callable[[], None]
"""Waits for a started reduction and puts its result where the step reads it."""


@dataclass
class Bucket:
    lo: int  # range of the owner's flat buffer (ZeRO-1/2) or of its bucket list (ZeRO-0)
    hi: int
    members: list[int]  # parameter indices
    owners: list[tuple[int, int, int]]  # ZeRO-2: (group rank, lo, hi), the parts of shards it covers
    arrived: set[int] = field(default_factory=set)  # members whose gradient is complete in this backward
    started: bool = False  # ZeRO-0/1: its reduction for this window started
    # ZeRO-2: their gradients, from the first hand-off until the reduction starts; ZeRO-0: its persistent buffer
    buffer: Tensor | None = None
    written: set[int] = field(default_factory=set)  # ZeRO-2: members whose gradient is in ``buffer``


class BucketOwner(Protocol):
    def complete(self, bucket: Bucket) -> bool: ...

    def holds(self, bucket: Bucket) -> bool: ...

    def start_reduction(self, bucket: Bucket) -> Finish: ...


class BucketQueue:
    """The one order in which a stage's buckets are reduced, the same on every rank (see the module)."""

    def __init__(self, *, launch_in_backward: bool = True, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.launch_in_backward = launch_in_backward
        self.max_in_flight = max_in_flight
        self.armed = True
        self._order: list[tuple[BucketOwner, Bucket]] = []
        self._next = 0  # the position in `_order` of the next bucket to reduce in this backward
        self._in_flight: deque[Finish] = deque()
        # ZeRO-0/1: a gradient that grew after its bucket's reduction started (see ``late_message``)
        self.late: str | None = None
        self.started_during_backward = self.started_at_end = 0  # reductions so far, for reports
        self.signature = 0  # the sequence of reductions so far, as a number (checked across ranks)

    def add(self, owner: BucketOwner, buckets: list[Bucket]) -> None:
        assert self._next == 0, "buckets are added between backward passes"
        # later groups first, each group's buckets last first
        self._order[:0] = [(owner, b) for b in reversed(buckets)]

    def replace(self, owner: BucketOwner, buckets: list[Bucket]) -> None:
        """``owner``'s buckets are now ``buckets``, in this order (a plan re-derived from backward's order)."""
        assert self._next == 0 and not self._in_flight
        self._order = [(o, b) for o, b in self._order if o is not owner] + [(owner, b) for b in buckets]

    def arrived(self) -> None:
        """A gradient became complete: start every bucket that is next in the order and complete."""
        if not (self.launch_in_backward and self.armed):
            return
        while self._next < len(self._order) and self._order[self._next][0].complete(self._order[self._next][1]):
            self._launch()
            self.started_during_backward += 1

    def end_backward(self) -> None:
        """A backward ended, at a point every rank agrees on: start every bucket not started in it, then wait."""
        if not self.armed:
            return
        while self._next < len(self._order):
            self._launch()
            self.started_at_end += 1
        self._next = 0
        self.wait()

    def wait(self) -> None:
        """Wait for every reduction in flight (oldest first)."""
        while self._in_flight:
            self._in_flight.popleft()()

    def late_message(self) -> str:
        late = self.late or "a parameter (on another data-parallel rank)"
        return (
            f"The gradient of {late} grew after its bucket's reduction had started: the parameter received its"
            " gradient in more than one part in the backward that closes the accumulation window (reentrant"
            " activation checkpointing, torch.utils.checkpoint(use_reentrant=True), over segments that share it;"
            " a second backward inside training_step), or from a backward run outside the strategy's backward (in"
            " on_after_backward or another hook) after the window was reduced. Use use_reentrant=False, or"
            " ZeroConfig(overlap_reductions=False) to reduce when backward ends. " + RUN_BACKWARD_INSIDE
        )

    def raise_late(self, group: dist.ProcessGroup, device: torch.device) -> NoReturn:
        """Some rank of ``group`` found a late gradient (agreed: every rank calls this): every rank raises the
        same message, naming the parameters and the ranks that found them."""
        problem = agreed_problem(self.late_message() if self.late else None, device=device, group=group)
        raise RuntimeError(problem or self.late_message())

    def pending(self) -> bool:
        """Whether this rank holds gradients no reduction has taken yet."""
        return self._next > 0 or any(owner.holds(bucket) for owner, bucket in self._order)

    def _launch(self) -> None:
        if len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft()()
        owner, bucket = self._order[self._next]
        self._in_flight.append(owner.start_reduction(bucket))
        self._next += 1
        self.signature = (self.signature * 1_000_003 + self._next) % 2**31


class ReplicatedBuckets:
    """ZeRO-0: the replicas' mean gradient by one all-reduce per bucket, started during the window's last
    backward, in place in one buffer per bucket that lives as long as the buckets do (as DDP's reducer, with
    ``gradient_as_bucket_view``): when backward has accumulated a parameter's first gradient of the window,
    it is copied into its part of the bucket's buffer and ``.grad`` becomes that view (autograd's own tensor is
    freed at once), so the window's later micro-batches accumulate in place and the reduction copies nothing.
    A step allocates no gradient-sized buffer and touches no fresh memory beyond autograd's own gradients:
    a buffer allocated afresh each step would cost what touching new pages costs (on the host, a page fault
    per 4 KiB), a cost that grows with the model. A parameter without a gradient in the window keeps
    ``.grad`` None until its bucket's reduction (zeros are sent for it). A backward with ``create_graph=True``
    leaves ``.grad`` as autograd made it, with its graph (second-order training); its reduction copies it.

    The first window's backward order is recorded on the group's first rank and, after that step, every rank
    rebuilds its buckets in it (as DDP does). ``link=False`` (a pipeline, whose runner moves gradients
    itself): ``.grad`` stays autograd's until the reduction copies it in."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        *,
        bucket_bytes: int,
        group: dist.ProcessGroup,
        queue: BucketQueue,
    ) -> None:
        self.params, self.names, self.bucket_bytes, self.group, self.queue = params, names, bucket_bytes, group, queue
        self.world = dist.get_world_size(group)
        self.link = True
        self.buckets = self._plan(list(reversed(range(len(params)))))
        self.reduced: set[int] = set()  # parameter indices reduced in this window
        self.used = [False] * len(params)  # this rank had a gradient for it when its bucket was reduced
        self.views: dict[int, Tensor] = {}  # each parameter's view of its bucket's buffer (its .grad, if untouched)
        self._order: list[int] | None = []  # backward's order in the first window (None once applied)
        self._early = False  # a window was reduced during backward
        self.closed = False  # the window was reduced: any gradient until the next micro-batch arrives late
        self._bucket_of: dict[int, Bucket] = {i: b for b in self.buckets for i in b.members}
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))
        queue.add(self, self.buckets[::-1])  # the plan is in backward's order already; add() takes the reverse

    def _plan(self, order: list[int]) -> list[Bucket]:
        """Consecutive parameters of ``order`` (one dtype and device) up to the bucket size, in that order."""
        buckets: list[Bucket] = []
        members: list[int] = []
        size = 0
        for n, i in enumerate(order):
            members.append(i)
            size += self.params[i].numel() * self.params[i].element_size()
            nxt = order[n + 1] if n + 1 < len(order) else None
            kind = (self.params[i].dtype, self.params[i].device)
            cap = min(self.bucket_bytes, FIRST_BUCKET_BYTES) if not buckets else self.bucket_bytes
            if nxt is None or size >= cap or (self.params[nxt].dtype, self.params[nxt].device) != kind:
                buckets.append(Bucket(len(buckets), len(buckets) + 1, members, []))
                members, size = [], 0
        return buckets

    def _view(self, index: int) -> Tensor:
        """``index``'s view of its bucket's buffer (the buffer, and every member's view, made at first use)."""
        if index not in self.views:
            bucket = self._bucket_of[index]
            first = self.params[bucket.members[0]]
            bucket.buffer = torch.empty(
                sum(self.params[i].numel() for i in bucket.members), dtype=first.dtype, device=first.device
            )
            offset = 0
            for i in bucket.members:
                p = self.params[i]
                self.views[i] = bucket.buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        return self.views[index]

    @torch.no_grad()
    def _take(self, index: int) -> bool:
        """``index``'s gradient into its view (copied unless it is the view already); whether it had one."""
        p = self.params[index]
        view = self._view(index)
        if p.grad is None:
            return False
        if p.grad is not view:
            view.copy_(p.grad)
            p.grad = view
        return True

    def _accumulated(self, index: int, param: Tensor) -> None:
        if self.queue.armed:
            if index in self.reduced or self.closed:  # its bucket is reduced or being reduced: this part is lost
                self.queue.late = self.queue.late or self.names[index]
                return
            if self._order is not None and index not in self._order:
                self._order.append(index)
        if self.link and not torch.is_grad_enabled():  # create_graph=True: .grad keeps autograd's graph
            self._take(index)
        if self.queue.armed:
            self._bucket_of[index].arrived.add(index)
            self.queue.arrived()

    def complete(self, bucket: Bucket) -> bool:
        return all(i in bucket.arrived for i in bucket.members if self.params[i].requires_grad)

    def holds(self, bucket: Bucket) -> bool:
        return False  # gradients wait in .grad until the window's last backward: nothing is pending

    @torch.no_grad()
    def start_reduction(self, bucket: Bucket) -> Finish:
        members = list(bucket.members)
        for i in members:
            self.used[i] = self._take(i)
            if not self.used[i]:
                self.views[i].zero_()  # this replica sends zeros for it
            self.params[i].grad = None  # until the reduction is done: the buffer is in flight
        flat = bucket.buffer
        assert flat is not None
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        bucket.arrived = set()
        self.reduced.update(members)

        def finish() -> None:
            assert work is not None
            work.wait()
            flat.div_(self.world)
            for i in members:
                self.params[i].grad = self.views[i]

        return finish

    def take(self) -> tuple[set[int], list[bool]]:
        """The parameters reduced since the last call, and whether this rank had a gradient for each."""
        reduced, used = self.reduced, self.used
        self.reduced, self.used = set(), [False] * len(self.params)
        self._early, self.closed = self._early or bool(reduced), True
        return reduced, used

    def after_window(self) -> None:
        """The step used the window's gradients. After the first window reduced during backward (the same
        window on every rank), the buckets follow backward's order on the group's first rank, in new buffers
        (a gradient still in an old one is copied over by the next backward or reduction)."""
        if self._early and self._order is not None:
            order = [self._order + [i for i in reversed(range(len(self.params))) if i not in self._order]]
            dist.broadcast_object_list(order, src=dist.get_global_rank(self.group, 0), group=self.group)
            self.buckets = self._plan(order[0])
            self._bucket_of = {i: b for b in self.buckets for i in b.members}
            self.views = {}
            self.queue.replace(self, self.buckets)
            self._order = None


def bucket_ranges(
    params: list[nn.Parameter], offsets: list[int], padded: int, bucket_numel: int, *, shard_numel: int
) -> list[Bucket]:
    """Consecutive parameters of a flat buffer in buckets of at least ``bucket_numel`` elements, built from the
    end (the last bucket, backward's first, holds at most ``FIRST_BUCKET_BYTES`` of fp32, and the padding),
    with the parts of the ranks' shards each covers; in the buffer's order."""
    buckets: list[Bucket] = []
    hi, members = padded, []
    for i in reversed(range(len(params))):
        members.insert(0, i)
        lo = offsets[i]
        cap = min(bucket_numel, FIRST_BUCKET_BYTES // 4) if not buckets else bucket_numel
        if hi - lo >= cap or i == 0:
            buckets.insert(0, Bucket(lo, hi, members, _owners(lo, hi, shard_numel)))
            hi, members = lo, []
    return buckets


def _owners(lo: int, hi: int, shard_numel: int) -> list[tuple[int, int, int]]:
    s = shard_numel
    return [(r, max(lo, r * s), min(hi, (r + 1) * s)) for r in range(lo // s, (hi - 1) // s + 1)]
