"""ZeRO-0: every replica holds the whole stage; the optimizer steps the replicas' mean gradient, as under DDP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid.strategies._user_code import UserGradientCode
from lightning_hybrid.strategies.zero.buckets import BucketQueue, ReplicatedBuckets
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.elsewhere import is_gradient
from lightning_hybrid.strategies.zero.grad_sync import GradientSync

__all__ = ["ReplicatedGradients"]


class ReplicatedGradients(GradientSync):
    """ZeRO-0: gradients are averaged by an all-reduce per bucket.

    During the window's last backward each bucket's all-reduce starts as soon as backward completed it and is
    waited for when backward ends (:class:`ReplicatedBuckets`, as DDP). A backward that did not close the
    window through the optimizer step's closure (manual optimization, a pipeline's schedule, tied weights
    across stages) is reduced when the step needs it, or at once when user code reads the gradients after
    it: each bucket (``ZeroConfig.bucket_size_mb``) of consecutive gradients copied into one buffer, reduced,
    and the gradients become views of it (their own storage freed at once).

    What is averaged is what each replica's ``.grad`` holds: a gradient user code assigned (or dropped) after
    the reduction is averaged again (a dropped one counts as zero where others have one), a parameter frozen
    after part of the window still has its part averaged, and a parameter no replica has a gradient for is
    not stepped, as in one process. Which of these apply is agreed in one small all-reduce per step."""

    zero_stage = 0
    averaged_every_backward = False  # synchronised once per window, when it closes

    def __init__(self, *, config: ZeroConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bucket_bytes = int(config.bucket_size_mb * 2**20)
        self.queue = BucketQueue(
            launch_in_backward=config.overlap_reductions, max_in_flight=config.max_buckets_in_flight
        )
        self.queue.armed = False
        self._buckets: ReplicatedBuckets | None = None
        self._index: dict[Tensor, int] = {}
        self._pipelined = False
        self._left: dict[int, Tensor | None] = {}  # what each parameter's .grad was when the pack last averaged it
        self._optimizers: list[Optimizer] = []
        # the step's agreement, started when the window's last backward ended (see after_backward)
        self._agreement: tuple[list[int], Tensor, dist.Work | None] | None = None

    def attach(
        self, optimizers: list[Optimizer], names: dict[Tensor, str], user: UserGradientCode | None = None
    ) -> None:
        super().attach(optimizers, names, user)
        self._optimizers = list(optimizers)
        if self.data_parallel_size == 1 or self.ties or self._buckets is not None:
            return
        params = list({id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}.values())
        params = [p for p in params if p.requires_grad]
        self._index = {p: i for i, p in enumerate(params)}
        self._buckets = ReplicatedBuckets(
            params, [names.get(p, "?") for p in params], bucket_bytes=self.bucket_bytes,
            group=self.data_parallel_group, queue=self.queue,
        )  # fmt: skip
        # a pipeline's runner sets each micro-batch's gradients aside itself: .grad must stay autograd's there
        self._buckets.link = not self._pipelined

    def watch_pipeline(
        self, stage_modules: list[nn.Module], *, weight_gradients_deferred: bool, inferring: Callable[[], bool]
    ) -> None:
        # the schedule's backward passes run inside training_step, and the runner sets this micro-batch's
        # gradients aside until Lightning's backward: the step reduces, as before
        self._pipelined = True
        if self._buckets is not None:
            self._buckets.link = False

    def window_closes(self, closing: bool) -> None:
        self.queue.armed = closing and self._buckets is not None and not self._pipelined
        if self._buckets is not None:
            self._buckets.closed = False
            self._buckets.link = not self._pipelined

    def after_backward(self) -> None:
        closing = self.queue.armed
        self.queue.end_backward()
        self._finish_agreement()  # one left by a step that never came (every rank alike)
        if closing and len(self._optimizers) == 1 and not self.user.reads_after_backward:
            # no user code runs between here and the step's reduction (the same on every rank): what the step
            # must agree on is known now, and its all-reduce runs while Lightning reaches the step, instead of
            # being one more point where the replicas wait for each other
            assert self._buckets is not None
            optimizer = self._optimizers[0]
            every = [p for group in optimizer.param_groups for p in group["params"]]
            flags = self._flags(every, self._buckets.reduced, self._buckets.used)
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.data_parallel_group, async_op=True)
            self._agreement = ([id(p) for p in every], flags, work)

    def _finish_agreement(self) -> tuple[list[int], Tensor] | None:
        if self._agreement is None:
            return None
        ids, flags, work = self._agreement
        self._agreement = None
        if work is not None:
            work.wait()
        return ids, flags

    def after_step(self, optimizer: Optimizer) -> None:
        super().after_step(optimizer)
        # the step's gradients are dropped: holding them here would keep a re-planned bucket's old buffer alive
        # through the next backward, the whole gradient twice
        self._left = {}
        if self._buckets is not None:
            self._buckets.after_window()

    @torch.no_grad()
    def _reduce(self, optimizer: Optimizer) -> None:
        if self.data_parallel_size == 1:
            return
        every = [p for group in optimizer.param_groups for p in group["params"]]
        early, used = self._buckets.take() if self._buckets is not None else (set(), [])
        agreed = self._finish_agreement()
        if agreed is not None:  # started when backward ended, with no user code since (after_backward)
            ids, flags = agreed
            if ids != [id(p) for p in every]:  # cannot change without user code; every rank alike
                raise RuntimeError("the optimizer's parameters changed between backward and its step")
            self._apply(every, flags.tolist())
            return
        # its own collective, at the step: a gradient can still arrive late after backward's end (a backward in
        # on_after_backward), on some ranks only, and every rank must refuse before any steps
        self._average_flags(every, self._flags(every, early, used))

    def _flags(self, every: list[Tensor], early: set[int], used: list[bool]) -> Tensor:
        """Which of ``every`` this replica has a gradient for, which it needs averaged, and whether a gradient
        arrived late, as the flags the replicas agree on (by their maximum)."""
        views = self._buckets.views if self._buckets is not None else {}
        # reduced during backward and untouched since: its bucket's view of the mean (whether this replica had
        # a part of it or sent zeros, ``used``); anything else this replica holds is averaged here
        reduced = [self._index.get(p, -1) in early and p.grad is views.get(self._index[p]) for p in every]
        has = [used[self._index[p]] if done else is_gradient(p.grad) for p, done in zip(every, reduced)]
        needs = [h and not done for h, done in zip(has, reduced)]
        late = self.queue.late is not None
        return torch.tensor([*has, *needs, late], dtype=torch.uint8, device=self._comm_device)

    def settle(self, optimizer: Optimizer) -> None:
        if self.data_parallel_size == 1:
            return
        every = [p for group in optimizer.param_groups for p in group["params"]]
        has = [is_gradient(p.grad) for p in every]
        changed = [p.grad is not self._left.get(id(p)) for p in every]
        # a backward between the reduction and the step (in on_after_backward) added to this rank's mean only
        late = self.queue.late is not None
        flags = torch.tensor([*has, *changed, late], dtype=torch.uint8, device=self._comm_device)
        self._average_flags(every, flags)

    def _average_flags(self, every: list[Tensor], flags: Tensor) -> None:
        """Agree (one all-reduce) on which parameters any replica has a gradient for and which any replica
        needs averaged (``_flags``), then :meth:`_apply` it."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
        self._apply(every, flags.tolist())

    def _apply(self, every: list[Tensor], values: list[int]) -> None:
        """Drop the gradients no replica has, average the others that any replica needs averaged (a replica
        without one sends zeros); refuse a late gradient on every rank."""
        if values[-1]:  # on every rank alike, before any rank steps
            self.queue.raise_late(self.data_parallel_group, self._comm_device)
        n = len(every)
        anywhere, average = values[:n], values[n : 2 * n]
        params = []
        for p, present, need in zip(every, anywhere, average):
            if not present:
                p.grad = None  # as in one process: no gradient, not stepped (a zero would move it under decay)
            elif need:
                params.append(p)
        bucket: list[Tensor] = []
        for i, p in enumerate(params):
            bucket.append(p)
            same = i + 1 < len(params) and (params[i + 1].dtype, params[i + 1].device) == (p.dtype, p.device)
            if not same or sum(q.numel() * q.element_size() for q in bucket) >= self.bucket_bytes:
                self._reduce_bucket(bucket)
                bucket = []
        self._left = {id(p): p.grad for p in every}

    def _reduce_bucket(self, params: list[Tensor]) -> None:
        flat = torch.cat([p.grad.reshape(-1) if is_gradient(p.grad) else torch.zeros(p.numel(), dtype=p.dtype,
                          device=p.device) for p in params])  # fmt: skip
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat.div_(self.data_parallel_size)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def _norm_group(self) -> dist.ProcessGroup | None:
        # replicas hold the same gradients: add the stages (and tensor-parallel slices) of one replica only
        return self.model_parallel_group or self.pipeline_group

    def gradient_holders(self) -> int:
        return self.data_parallel_size
