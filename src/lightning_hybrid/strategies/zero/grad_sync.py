"""Gradient synchronisation inside each stage's data-parallel group: one object per ZeRO stage.

The strategy picks one in ``setup`` (``stages.gradient_sync``) and calls it at fixed points of every
optimizer step:

1. ``reduce(optimizer)``: after the accumulation window's last backward, before the precision plugin's
   hooks and clipping see the gradients;
2. ``grad_norm(grads)``: the L2 norm of the whole model's gradient (all stages, all shards), the same on
   every rank, for clipping;
3. ``after_step(optimizer)``: after the optimizer stepped. The gradients it used are freed there (as
   DeepSpeed's engine does): Lightning would zero them only after the next forward, so without this the
   previous step's gradients and the next forward's activations are alive at the same time, at the peak.

ZeRO-0 all-reduces the gradients bucket by bucket; ZeRO-1/2 reduce into each rank's flat shard and gather
the updated parameters back (:class:`FlatShardedOptimizer`); ZeRO-3 has nothing to do (FSDP2 reduce-
scattered every backward and gathers parameters when they are used).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_hybrid._agree import agree
from lightning_hybrid.optim._shardable import check_shardable
from lightning_hybrid.strategies.pipeline.tied import TiedGradients
from lightning_hybrid.strategies.zero.buckets import BucketQueue, ReplicatedBuckets
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer
from lightning_hybrid.strategies.zero.fully_sharded import UnitGradients

__all__ = ["FullyShardedGradients", "GradientSync", "ReplicatedGradients", "named_parameters"]


class GradientSync:
    """ZeRO-3 (and the shared part): gradients need no reduction after backward."""

    zero_stage = 3
    averaged_every_backward = True  # FSDP reduce-scatters after each backward, accumulation included
    queue: BucketQueue | None = None  # ZeRO-0/1/2: the buckets reduced during backward

    def __init__(
        self,
        *,
        device: torch.device,
        data_parallel_group: dist.ProcessGroup,
        pipeline_group: dist.ProcessGroup,
        ties: TiedGradients | None = None,
    ) -> None:
        self.device = device
        self.data_parallel_group, self.pipeline_group = data_parallel_group, pipeline_group
        self.data_parallel_size = dist.get_world_size(data_parallel_group)
        self.ties = ties
        self._optimizer_index: dict[int, int] = {}

    # whether Lightning's zero_grad (which sees the optimizer's parameters) can wipe the model's gradients
    # between a pipeline's training_step and backward: then the pipeline runner sets them aside
    optimizer_holds_model_parameters = True

    def attach(self, optimizers: list[Optimizer], names: dict[Tensor, str]) -> None:
        """Take charge of the optimizers (before their first step): refuse one that sharding would change."""
        for optimizer in optimizers:
            check_shardable(optimizer, self.zero_stage)
        self._optimizer_index = {id(opt): i for i, opt in enumerate(optimizers)}
        if self.ties is not None:  # on every rank: it agrees on the tied parameters' settings
            self.ties.attach(optimizers)

    def after_backward(self) -> None:
        """A backward (one micro-batch) finished."""

    def reductions_started(self) -> dict[str, int]:
        """Bucket reductions started while backward computed, and when it ended (ZeRO-0/1/2)."""
        if self.queue is None:
            return {"during_backward": 0, "at_end": 0}
        return {"during_backward": self.queue.started_during_backward, "at_end": self.queue.started_at_end}

    def window_closes(self, closing: bool) -> None:
        """Whether the backward passes that follow close the accumulation window (their gradients are the
        step's): ZeRO-0/1 then start their reductions during backward. Set around the optimizer step's closure;
        a backward outside it (manual optimization, an accumulating micro-batch) reduces when the step needs it."""

    def watch_pipeline(
        self, stage_modules: list[nn.Module], *, weight_gradients_deferred: bool, inferring: Callable[[], bool]
    ) -> None:
        """The stages run by a pipeline schedule (their backward passes are the schedule's, not the strategy's);
        ``weight_gradients_deferred``: the schedule computes weight gradients outside autograd's accumulation;
        ``inferring()``: the stages run for their shape inference, no micro-batch."""

    def begin_step(self, optimizer: Optimizer) -> None:
        """The window's gradients are reduced; unscaling, clipping and the optimizer step follow."""

    def end_step(self, optimizer: Optimizer) -> None:
        """The optimizer step is over (or failed)."""

    def adopt_param_groups(self, optimizer: Optimizer, *, reduce_follows: bool = False) -> None:
        """Take charge of param groups added to ``optimizer`` since set-up (before their state is loaded);
        ``reduce_follows``: ``reduce(optimizer)`` comes next on every rank, and may agree on a failure here."""

    def hold_gradients(self, hold: bool) -> None:
        """A pipeline's backward ran inside training_step: until Lightning's backward call, a zero_grad must not
        discard its gradients (ZeRO-0/3 set them aside instead; see ``PipelineRunner.train_step``)."""

    def current_gradients(self, module: nn.Module) -> list[Tensor]:
        """This rank's part of the gradient accumulated so far in the window (for the noise scale)."""
        return [p.grad for p in module.parameters() if p.grad is not None]

    def reduce(self, optimizer: Optimizer, *, scale: float | None = None) -> None:
        """The window's last backward ran: tied gradients summed over their stages, then this ZeRO stage's
        reduction over the data-parallel group; then the gradients the optimizer steps are multiplied by
        ``scale`` (a counted loss's window correction), when given."""
        index = self._optimizer_index.get(id(optimizer))
        if self.ties and index is not None:
            self.ties.sum_gradients(index)
        self._reduce(optimizer)
        if scale is not None:
            self._scale(optimizer, scale)

    @torch.no_grad()
    def _scale(self, optimizer: Optimizer, scale: float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for g in grads:
            _local(g).mul_(scale)

    def _reduce(self, optimizer: Optimizer) -> None:
        """ZeRO-3: FSDP2 reduce-scattered during backward."""

    def after_step(self, optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    @property
    def _norm_group(self) -> dist.ProcessGroup | None:
        return None  # disjoint shards (and stages): the squares add up over the whole world

    def grad_norm(self, grads: Iterable[Tensor]) -> Tensor:
        """L2 norm of the whole model's gradient; identical on every rank (one all-reduce)."""
        grads = list(grads)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            total += _local(g).detach().float().pow(2).sum()
        # a parameter tied across stages has the same (summed) gradient on each: count it on its first stage
        given = {id(g) for g in grads}
        for param in self.ties.copies() if self.ties else []:
            for part in self._gradient_parts(param, given):
                square = _local(part).detach().float().pow(2).sum()
                total -= torch.where(square.isfinite(), square, 0.0)  # inf stays inf (the first stage has it too)
        dist.all_reduce(total, group=self._norm_group)
        return total.clamp_min(0).sqrt()

    def _gradient_parts(self, param: nn.Parameter, given: set[int]) -> list[Tensor]:
        """The gradient of ``param`` as this rank's optimizer sees it, if it is among the ``given`` ones."""
        return [param.grad] if param.grad is not None and id(param.grad) in given else []

    def gradient_holders(self) -> int:
        """How many ranks hold each gradient element the optimizer steps with."""
        return 1

    # sharded checkpoints: ZeRO-1/2 save parameters and optimizer state as this rank's chunks of flat buffers
    def sharded_optimizer(self, optimizer: Optimizer) -> FlatShardedOptimizer | None:
        return None

    def parameter_shards(self) -> dict[str, Any]:
        return {}


class ReplicatedGradients(GradientSync):
    """ZeRO-0: every replica holds the whole stage; gradients are averaged by an all-reduce per bucket.

    During the window's last backward each bucket's all-reduce starts as soon as backward completed it and is
    waited for when backward ends (:class:`ReplicatedBuckets`, as DDP). A backward that did not close the
    window through the optimizer step's closure (manual optimization, tied weights across stages) reduces when
    the step needs it: each bucket (``ZeroConfig.bucket_size_mb``) of consecutive gradients copied into one
    buffer, reduced, and the gradients become views of it (their own storage freed at once)."""

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

    def attach(self, optimizers: list[Optimizer], names: dict[Tensor, str]) -> None:
        super().attach(optimizers, names)
        if self.data_parallel_size == 1 or self.ties or self._buckets is not None:
            return
        params = list({id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}.values())
        params = [p for p in params if p.requires_grad]
        self._index = {p: i for i, p in enumerate(params)}
        self._buckets = ReplicatedBuckets(
            params, [names.get(p, "?") for p in params], bucket_bytes=self.bucket_bytes,
            group=self.data_parallel_group, queue=self.queue,
        )  # fmt: skip

    def watch_pipeline(
        self, stage_modules: list[nn.Module], *, weight_gradients_deferred: bool, inferring: Callable[[], bool]
    ) -> None:
        # the schedule's backward passes run inside training_step, and the runner sets this micro-batch's
        # gradients aside until Lightning's backward: the step reduces, as before
        self._pipelined = True

    def window_closes(self, closing: bool) -> None:
        self.queue.armed = closing and self._buckets is not None and not self._pipelined

    def after_backward(self) -> None:
        self.queue.end_backward()

    def after_step(self, optimizer: Optimizer) -> None:
        super().after_step(optimizer)
        if self._buckets is not None:
            self._buckets.after_window()

    @torch.no_grad()
    def _reduce(self, optimizer: Optimizer) -> None:
        dp = self.data_parallel_size
        if dp == 1:
            return
        every = [p for group in optimizer.param_groups for p in group["params"]]
        early, used = self._buckets.take() if self._buckets is not None else (set(), [])
        # reduced during backward, frozen since included (its zeros must not step it under weight decay)
        done = [p for p in every if self._index.get(p, -1) in early]
        params = [p for p in every if p.requires_grad and self._index.get(p, -1) not in early]
        if done:  # reduced during backward: those no replica had a gradient for are not stepped
            # its own collective, at the step: a gradient can still arrive late after backward's end (a backward in
            # on_after_backward), on some ranks only, and every rank must refuse before any steps
            mine = [used[self._index[p]] for p in done] + [self.queue.late is not None]
            flags = torch.tensor(mine, dtype=torch.uint8, device=self._comm_device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            *anywhere_used, late = flags.tolist()
            if late:  # on every rank alike, before any rank steps
                self.queue.raise_late(self.data_parallel_group, self._comm_device)
            for p, anywhere in zip(done, anywhere_used):
                if not anywhere:
                    p.grad = None
            if not params:
                return
        # a parameter no replica produced a gradient for is not stepped, as in one process (a zero gradient
        # would still move it under weight decay or momentum); which ones is agreed, the check costs one flag
        has = [p.grad is not None for p in params]
        (unused,) = agree([float(not all(has))], device=self._comm_device, group=self.data_parallel_group)
        if unused:
            flags = torch.tensor(has, dtype=torch.uint8, device=self._comm_device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.data_parallel_group)
            params = [p for p, used in zip(params, flags.tolist()) if used]
        bucket: list[Tensor] = []
        for i, p in enumerate(params):
            bucket.append(p)
            same = i + 1 < len(params) and (params[i + 1].dtype, params[i + 1].device) == (p.dtype, p.device)
            if not same or sum(q.numel() * q.element_size() for q in bucket) >= self.bucket_bytes:
                self._reduce_bucket(bucket, dp)
                bucket = []

    @property
    def _comm_device(self) -> torch.device:
        return torch.device("cpu") if str(dist.get_backend(self.data_parallel_group)) == "gloo" else self.device

    def _reduce_bucket(self, params: list[Tensor], dp: int) -> None:
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype,
                          device=p.device) for p in params])  # fmt: skip
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat.div_(dp)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def _norm_group(self) -> dist.ProcessGroup | None:
        return self.pipeline_group  # replicas hold the same gradients: add the stages only

    def gradient_holders(self) -> int:
        return self.data_parallel_size


class FullyShardedGradients(GradientSync):
    """ZeRO-3 (FSDP2): parameters, gradients and optimizer state are DTensors sharded over the group. A
    parameter no replica used in the window gets no gradient (``UnitGradients`` gave it zeros for FSDP2's
    reduction), so it is not stepped, as in one process."""

    def __init__(self, *, units: UnitGradients | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units
        self._by_name: dict[str, Tensor] = {}
        self._names: dict[Tensor, str] = {}

    def attach(self, optimizers: list[Optimizer], names: dict[Tensor, str]) -> None:
        super().attach(optimizers, names)
        self._names = dict(names)
        self._by_name = {n: p for p, n in names.items()}

    def _reduce(self, optimizer: Optimizer) -> None:
        if self.units is None:
            return
        device = torch.device("cpu") if str(dist.get_backend(self.data_parallel_group)) == "gloo" else self.device
        mine = {n for group in optimizer.param_groups for p in group["params"] for n in [self._names.get(p)] if n}
        for name in self.units.unused_everywhere(mine, device):
            self._by_name[name].grad = None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def named_parameters(module: nn.Module) -> dict[Tensor, str]:
    return {p: n for n, p in module.named_parameters()}
