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

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid._protocols import TakesTensorPartition
from lightning_hybrid._torch_compat import replace_optimizer_step
from lightning_hybrid.optim._shardable import check_shardable
from lightning_hybrid.optim.layerwise import TensorPartition
from lightning_hybrid.strategies._user_code import UserGradientCode
from lightning_hybrid.strategies.pipeline.tied import TiedGradients
from lightning_hybrid.strategies.tensor.local import split_tensors
from lightning_hybrid.strategies.zero.buckets import BucketQueue
from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer
from lightning_hybrid.strategies.zero.fully_sharded import UnitGradients
from lightning_hybrid.strategies.zero.outside import OutsideOptimizers

__all__ = ["FullyShardedGradients", "GradientSync", "comm_device", "local", "named_parameters"]


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
        self._windows_reduced: set[int] = set()  # optimizers whose window was reduced and not stepped yet
        self.user = UserGradientCode()
        self.outside: OutsideOptimizers | None = None  # trainable parameters no optimizer holds (ZeRO-0/1/2)
        # tensor parallelism: parameters every tensor-parallel rank holds whole (counted on its first rank
        # only), and the group of ranks that hold one model replica between them (pipeline x tensor)
        self._whole_on_tp: list[nn.Parameter] = []
        self._counts_whole = True
        self.model_parallel_group: dist.ProcessGroup | None = None

    @property
    def _tensor_parallel(self) -> bool:
        return self.model_parallel_group is not None  # set by count_tensor_parallel, under tensor parallelism only

    def count_tensor_parallel(
        self, whole: list[nn.Parameter], *, first: bool, model_parallel_group: dist.ProcessGroup
    ) -> None:
        """Tensor parallelism: ``whole`` are the parameters each tensor-parallel rank holds all of; their
        gradients count in the global norm on the ``first`` tensor-parallel rank only."""
        self._whole_on_tp, self._counts_whole = whole, first
        self.model_parallel_group = model_parallel_group

    # whether Lightning's zero_grad (which sees the optimizer's parameters) can wipe the model's gradients
    # between a pipeline's training_step and backward: then the pipeline runner sets them aside
    optimizer_holds_model_parameters = True

    def attach(
        self, optimizers: list[Optimizer], names: dict[Tensor, str], user: UserGradientCode | None = None
    ) -> None:
        """Take charge of the optimizers (before their first step): refuse one that sharding would change.
        ``user``: where user code reads or edits gradients between backward and the step."""
        for optimizer in optimizers:  # tensor parallelism steps slices at every stage
            check_shardable(optimizer, self.zero_stage, tensor_parallel=self._tensor_parallel)
        self._optimizer_index = {id(opt): i for i, opt in enumerate(optimizers)}
        self.user = user or UserGradientCode()
        if self._tensor_parallel and self.zero_stage < 3:
            refuse_gradient_code_on_slices(self.user, self.zero_stage)
        if self.ties is not None:  # on every rank: it agrees on the tied parameters' settings
            self.ties.attach(optimizers)
        if self.zero_stage < 3 and self.data_parallel_size > 1:  # FSDP2 reduces every parameter of its units
            self.outside = OutsideOptimizers(list(names), optimizers, self.data_parallel_group, self._comm_device)
        if self.zero_stage == 0 and self._tensor_parallel:  # whole-tensor norms (LAMB, LARS) over the slices
            for optimizer in optimizers:
                if isinstance(optimizer, TakesTensorPartition):
                    params = [p for group in optimizer.param_groups for p in group["params"]]
                    segments = {p: [(i, 0, p.numel())] for i, p in enumerate(params)}
                    optimizer.set_tensor_partition(TensorPartition(segments, len(params), None, split_tensors(params)))
        if self.user.reads_at_step and self.zero_stage in (0, 3) and self.data_parallel_size > 1:
            for optimizer in optimizers:  # ZeRO-1/2's optimizer has a step of its own (FlatShardedOptimizer)
                replace_optimizer_step(optimizer, _checked_step(self, optimizer.step))

    def before_update(self, optimizer: Optimizer) -> None:
        """User code ran between the step's start and the optimizer's update (``on_before_optimizer_step``,
        manual optimization): what it assigned is settled as after ``on_after_backward`` (:meth:`settle`). Only
        for a window this sync reduced: torch's DCP steps an optimizer at LR 0 to create its state when a
        checkpoint loads, with zero gradients of its own."""
        if id(optimizer) in self._windows_reduced:
            self.settle(optimizer)

    @property
    def _comm_device(self) -> torch.device:
        return comm_device(self.data_parallel_group, self.device)

    def before_backward(self) -> None:
        """A backward (or a pipeline schedule's backwards) is about to run."""

    def after_backward(self) -> None:
        """A backward (one micro-batch) finished."""

    def average_outside(self) -> None:
        """Every backward: the gradients of trainable parameters no optimizer holds become the replicas' mean,
        as DDP makes them (user code updates such a parameter by hand from its ``.grad``)."""
        if self.outside is not None:
            self.outside.average()

    def settle(self, optimizer: Optimizer) -> None:
        """The window's gradients were reduced before user code ran (``on_after_backward``, manual optimization):
        what it changed since is made the optimizer's, the same on every replica, before the step uses it."""

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
        """This rank's part of the gradient accumulated so far in the window (for the noise scale); a
        parameter every tensor-parallel rank holds whole is given by the first of them only."""
        skip = self._not_counted_here()
        return [p.grad for p in module.parameters() if p.grad is not None and id(p) not in skip]

    def step_gradients(self, optimizer: Optimizer) -> list[Tensor]:
        """The gradients ``optimizer`` steps with, each element given by ``gradient_holders()`` ranks."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return self._counted(grads)

    def _not_counted_here(self) -> set[int]:
        """The parameters whose gradient another tensor-parallel rank counts (every one holds them whole)."""
        return set() if self._counts_whole else {id(p) for p in self._whole_on_tp}

    def _counted(self, grads: list[Tensor]) -> list[Tensor]:
        """``grads`` (as the optimizer sees them) less the parts another tensor-parallel rank counts."""
        if self._counts_whole:
            return grads
        given = {id(g) for g in grads}
        skip = {id(g) for p in self._whole_on_tp for g in self._gradient_parts(p, given)}
        return [g for g in grads if id(g) not in skip]

    def reduce(self, optimizer: Optimizer, *, scale: float | None = None) -> None:
        """The window's last backward ran: tied gradients summed over their stages, then this ZeRO stage's
        reduction over the data-parallel group; then the gradients the optimizer steps are multiplied by
        ``scale`` (a counted loss's window correction), when given."""
        index = self._optimizer_index.get(id(optimizer))
        if self.ties and index is not None:
            self.ties.sum_gradients(index)
        self._reduce(optimizer)
        self._windows_reduced.add(id(optimizer))
        if scale is not None:
            self._scale(optimizer, scale)

    @torch.no_grad()
    def _scale(self, optimizer: Optimizer, scale: float) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for g in grads:
            local(g).mul_(scale)

    def _reduce(self, optimizer: Optimizer) -> None:
        """ZeRO-3: FSDP2 reduce-scattered during backward."""

    def after_step(self, optimizer: Optimizer) -> None:
        self._windows_reduced.discard(id(optimizer))
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    @property
    def _norm_group(self) -> dist.ProcessGroup | None:
        return None  # disjoint shards (and stages): the squares add up over the whole world

    def grad_norm(self, grads: Iterable[Tensor]) -> Tensor:
        """L2 norm of the whole model's gradient; identical on every rank (one all-reduce)."""
        grads = list(grads)
        given = {id(g) for g in grads}
        # tensor parallelism: a gradient every tensor-parallel rank holds whole counts on the first one only
        counted = self._counted(grads)
        skip = given - {id(g) for g in counted}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in counted:
            total += local(g).detach().float().pow(2).sum()
        # a parameter tied across stages has the same (summed) gradient on each: count it on its first stage
        for param in self.ties.copies() if self.ties else []:
            for part in (g for g in self._gradient_parts(param, given) if id(g) not in skip):
                square = local(part).detach().float().pow(2).sum()
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


class FullyShardedGradients(GradientSync):
    """ZeRO-3 (FSDP2): parameters, gradients and optimizer state are DTensors sharded over the group. A
    parameter no replica used in the window gets no gradient (``UnitGradients`` gave it zeros for FSDP2's
    reduction), so it is not stepped, as in one process."""

    def __init__(self, *, units: UnitGradients | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units
        self._by_name: dict[str, Tensor] = {}
        self._names: dict[Tensor, str] = {}
        self._trainable: list[bool] | None = None  # requires_grad at the window's first backward
        self._left: dict[int, Tensor | None] = {}  # each parameter's .grad when the window was reduced

    def before_backward(self) -> None:
        # FSDP2 computes the gradient of the unsharded parameter, whose requires_grad it set when it was built: a
        # parameter frozen between two backward passes of a window would still be trained by the later ones
        now = [p.requires_grad for p in self._names]
        if self._trainable is None:
            self._trainable = now
        elif now != self._trainable:
            changed = [n for n, a, b in zip(self._names.values(), now, self._trainable) if a != b]
            raise RuntimeError(
                f"{', '.join(changed[:3])} changed requires_grad between two backward passes of one optimizer step"
                " under zero_stage=3: FSDP2 keeps computing the gradients of the unsharded parameters, so the"
                " later backward passes would still train them. Freeze or unfreeze between optimizer steps (in"
                " on_train_batch_start of a window's first batch, or on_train_epoch_start), or use zero_stage 0,"
                " 1 or 2."
            )

    def after_step(self, optimizer: Optimizer) -> None:
        super().after_step(optimizer)
        self._trainable = None

    def attach(
        self, optimizers: list[Optimizer], names: dict[Tensor, str], user: UserGradientCode | None = None
    ) -> None:
        super().attach(optimizers, names, user)
        self._names = dict(names)
        self._by_name = {n: p for p, n in names.items()}

    def _reduce(self, optimizer: Optimizer) -> None:
        if self.units is not None:
            mine = {n for group in optimizer.param_groups for p in group["params"] for n in [self._names.get(p)] if n}
            for name in self.units.unused_everywhere(mine, self._comm_device):
                self._by_name[name].grad = None
        self._left = {id(p): p.grad for group in optimizer.param_groups for p in group["params"]}

    def settle(self, optimizer: Optimizer) -> None:
        # each replica holds its rows of a DTensor gradient: a tensor assigned in their place cannot be averaged
        # (a value computed from a replica's own data would differ row block by row block), so it is refused;
        # edits in place, and None, are what one process would see
        assigned = [
            self._names.get(p, "?")
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and p.grad is not self._left.get(id(p))
        ]
        problem = None
        if assigned:
            problem = (
                f"A gradient was assigned to {', '.join(assigned[:3])}.grad under zero_stage=3, where each data-"
                "parallel replica holds its rows of the replicas' mean (a DTensor): an assigned tensor cannot be"
                " averaged over the replicas. Edit the gradient in place (p.grad.mul_(...), .zero_(),"
                " .masked_fill_(...)), set it to None, or use zero_stage=0, 1 or 2 (or"
                " ZeroConfig(reduce_gradients='once_per_step')), under which an assigned gradient is averaged."
            )
        agreed = agreed_problem(problem, device=self._comm_device)
        if agreed:
            raise RuntimeError(agreed)


def _checked_step(sync: GradientSync, step: Callable[..., Any]) -> Callable[..., Any]:
    """``optimizer.step`` whose closure (backward, the reduction, the precision plugin's hooks) is followed by
    ``sync`` settling what user code did to the gradients, before the update reads them (each evaluation, for an
    optimizer that evaluates it more than once); without a closure (manual optimization) the settling comes
    first. A method of the optimizer itself: an LR scheduler made later (SWALR) rebinds what it wraps to it."""

    def checked(optimizer: Optimizer, closure: Any = None) -> Any:
        if closure is None:
            sync.before_update(optimizer)
            return step()

        def settled() -> Any:
            loss = closure()
            sync.before_update(optimizer)
            return loss

        return step(settled)

    return checked


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def comm_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """Where ``group``'s backend communicates: the host for gloo, else ``device``."""
    return torch.device("cpu") if str(dist.get_backend(group)) == "gloo" else device


def named_parameters(module: nn.Module) -> dict[Tensor, str]:
    return {p: n for n, p in module.named_parameters()}


def refuse_gradient_code_on_slices(user: UserGradientCode, zero_stage: int) -> None:
    """Under tensor parallelism with ZeRO-0/1/2 each rank's ``.grad`` of a split parameter is its slice, a plain
    tensor: user code between backward and the step that computes anything over more than one element (a norm,
    a projection, a dot product) would silently see its slice only. Refused on every rank (the hooks are the
    same everywhere)."""
    hooks = [
        name
        for name, present in (
            ("on_after_backward", user.after_backward),
            ("on_before_optimizer_step / configure_gradient_clipping", user.before_step),
            ("manual optimization", user.manual),
        )
        if present
    ]
    if hooks:
        raise ValueError(
            f"{hooks[0]} can read or change the gradients before the step, and under tensor parallelism with"
            f" zero_stage={zero_stage} each rank's .grad is its slice of a split parameter's gradient (a plain"
            " tensor): a norm, a projection or any value over more than one element computed there would be this"
            " rank's part only. Use zero_stage=3 (gradients are DTensors, whose reductions span the ranks), clip"
            " with Trainer(gradient_clip_val=...) (the strategy's global norm), or tensor_parallel_size=1."
        )
