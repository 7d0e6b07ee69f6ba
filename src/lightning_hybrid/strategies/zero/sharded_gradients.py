"""ZeRO-1/2 gradient synchronisation: gradients reduced into each rank's flat shard (during backward bucket by
bucket, or once per step), the flat sharded optimizer steps the shard, the updated parameters are gathered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid._agree import raise_agreed
from lightning_hybrid._protocols import TakesTensorPartition
from lightning_hybrid._torch_compat import queue_backward_callback
from lightning_hybrid.optim._shardable import check_shardable
from lightning_hybrid.strategies._user_code import UserGradientCode
from lightning_hybrid.strategies.zero.buckets import BucketQueue
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer
from lightning_hybrid.strategies.zero.grad_sync import GradientSync

__all__ = ["ShardedOptimizerGradients"]


class ShardedOptimizerGradients(GradientSync):
    """ZeRO-1/2: each rank's optimizer steps its flat shard; see :class:`FlatShardedOptimizer`."""

    # gradients live in flat buffers and buckets, which the optimizer's own zero_grad discards; the pipeline
    # keeps them through Lightning's zero_grad with hold_gradients instead of setting them aside
    optimizer_holds_model_parameters = False

    def __init__(self, *, zero_stage: int, config: ZeroConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.zero_stage, self.config = zero_stage, config
        self._sharded: dict[int, FlatShardedOptimizer] = {}
        # ZeRO-2 every_microbatch: every bucket of the stage in one reduction order. A backward ends at the
        # strategy's after_backward (no pipeline), or, in a pipeline, at the end of each micro-batch's
        # backward through the stages (watch_pipeline)
        self.queue = BucketQueue(
            launch_in_backward=config.overlap_reductions, max_in_flight=config.max_buckets_in_flight
        )
        # ZeRO-1 reduces during the backward that closes the window only (window_closes); ZeRO-2 every backward
        self.queue.armed = zero_stage == 2
        self._boundary = "after_backward"

    @property
    def averaged_every_backward(self) -> bool:  # type: ignore[override]
        return bool(self._sharded) and all(s.averaged_every_backward for s in self._sharded.values())

    def attach(
        self, optimizers: list[Optimizer], names: dict[Tensor, str], user: UserGradientCode | None = None
    ) -> None:
        super().attach(optimizers, names, user)
        bucket = int(self.config.bucket_size_mb * 2**20)
        if self.zero_stage == 2 and self.config.reduce_gradients == "every_microbatch":
            # ZeRO-2's buckets are held until their reduction is done: the one filling and those in flight
            # together stay within bucket_size_mb, the memory of one bucket reduced at a time
            bucket //= self.config.max_buckets_in_flight + 1
        sizes = [p.element_size() for opt in optimizers for g in opt.param_groups for p in g["params"]]
        self._sharded = {
            id(opt): FlatShardedOptimizer(
                opt,
                names=names,
                group=self.data_parallel_group,
                zero_stage=self.zero_stage,
                reduce_gradients=self.config.reduce_gradients,
                bucket_numel=max(1, bucket // max(sizes, default=4)),
                queue=self.queue,
                user=self.user,
            )
            for opt in optimizers
        }
        for opt in optimizers:
            self._set_partition(opt)

    def _set_partition(self, optimizer: Optimizer) -> None:
        if isinstance(optimizer, TakesTensorPartition):  # per-tensor norms over the flat slices it steps
            optimizer.set_tensor_partition(self._sharded[id(optimizer)].tensor_partition())

    def hold_gradients(self, hold: bool) -> None:
        for sharded in self._sharded.values():
            sharded.hold = hold

    def adopt_param_groups(self, optimizer: Optimizer, *, reduce_follows: bool = False) -> None:
        # a callback that moved a parameter between groups is refused where the parameter lives (one stage):
        # every rank raises alike instead of the others waiting in the step's collectives
        problem = None
        sharded = self._sharded[id(optimizer)]
        try:
            if sharded.sync_groups():  # a group added since: flattened and sharded now
                check_shardable(optimizer, self.zero_stage)
                self._set_partition(optimizer)
        except Exception as exc:  # whatever it is, every rank stops with it
            problem = f"{type(exc).__name__}: {exc}"
        if reduce_follows and not self.ties and dist.get_world_size(self.data_parallel_group) == dist.get_world_size():
            # agreed by the reduction's first collective (over every rank here): no collective of its own
            sharded.problem = problem
        else:
            raise_agreed(problem, RuntimeError, device=self.device)

    def begin_step(self, optimizer: Optimizer) -> None:
        self._sharded[id(optimizer)].swap_in()

    def end_step(self, optimizer: Optimizer) -> None:
        self._sharded[id(optimizer)].swap_out()

    def window_closes(self, closing: bool) -> None:
        # tied gradients are summed over their stages first, when the step needs them; where user code reads the
        # gradient after backward, the buffer is all-reduced when backward ends (GroupGradients.full)
        if self.zero_stage == 1:
            self.queue.armed = closing and not self.ties and not self.user.reads_after_backward

    def before_backward(self) -> None:
        for sharded in self._sharded.values():
            sharded.before_backward()

    def settle(self, optimizer: Optimizer) -> None:
        self._sharded[id(optimizer)].settle()

    def watch_pipeline(
        self, stage_modules: list[nn.Module], *, weight_gradients_deferred: bool, inferring: Callable[[], bool]
    ) -> None:
        self._inferring = inferring
        if weight_gradients_deferred or self.zero_stage == 1:
            # weight gradients appear outside autograd's accumulation, or (ZeRO-1) the window's gradient is
            # complete only once the schedule has run all its micro-batches: reduce when it has run
            self.queue.launch_in_backward = False
            self._boundary = "after_backward"
            return
        self._boundary = "stage_backward"
        # with several stages per rank (interleaved, looped) a boundary is every len(stages)-th stage backward:
        # each micro-batch then reduces every bucket once, as without them
        self._stages_per_boundary, self._stage_backwards = len(stage_modules), 0
        self._boundary_queued = False
        for stage in stage_modules:
            stage.register_forward_hook(self._watch_output)

    def _watch_output(self, module: nn.Module, args: Any, output: Any) -> None:
        # the stage's outputs receive their gradients first in the micro-batch's backward through this rank:
        # the end of that backward is a boundary every data-parallel rank reaches the same number of times.
        # Every output is hooked (one may get no gradient); the first hook to fire queues the boundary
        if self._inferring():
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(self._backward_started)

    def _backward_started(self, grad: Tensor) -> None:
        if not self._boundary_queued:
            self._boundary_queued = True
            queue_backward_callback(self._stage_backward_ended)

    def _stage_backward_ended(self) -> None:
        self._boundary_queued = False
        self._stage_backwards += 1
        if self._stage_backwards % self._stages_per_boundary == 0:
            self.queue.end_backward()

    def after_backward(self) -> None:
        if self._boundary == "after_backward":
            self.queue.end_backward()
        for sharded in self._sharded.values():
            sharded.after_backward()

    def current_gradients(self, module: nn.Module) -> list[Tensor]:
        skip = self._not_counted_here()
        return [t for sharded in self._sharded.values() for t in sharded.local_gradients(skip)]

    def _reduce(self, optimizer: Optimizer) -> None:
        self._sharded[id(optimizer)].reduce_gradients()

    @torch.no_grad()
    def _scale(self, optimizer: Optimizer, scale: float) -> None:
        self._sharded[id(optimizer)].scale_gradients(scale)

    def _gradient_parts(self, param: nn.Parameter, given: set[int]) -> list[Tensor]:
        return [
            part
            for sharded in self._sharded.values()
            if any(id(c.tensor.grad) in given for g in sharded.groups for c in g.chunks)
            for part in sharded.shard_gradient_parts(param)
        ]

    def after_step(self, optimizer: Optimizer) -> None:
        self._sharded[id(optimizer)].gather_parameters()

    def sharded_optimizer(self, optimizer: Optimizer) -> FlatShardedOptimizer | None:
        return self._sharded.get(id(optimizer))

    def parameter_shards(self) -> dict[str, Any]:
        shards: dict[str, Any] = {}
        for sharded in self._sharded.values():
            shards.update(sharded.parameter_state_dict())
        return shards

    def reload_parameters(self) -> None:
        for sharded in self._sharded.values():
            sharded.load_parameters_into_shards()
