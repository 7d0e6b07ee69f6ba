"""Shapes of how a model is trained rather than of the model: precision, clipping, activation checkpointing, a
partial accumulation window, and user code that edits gradients between backward and the optimizer step (in
``on_after_backward``, ``on_before_optimizer_step``, tensor hooks, manual optimization), freezes a parameter
mid-window or updates one outside the optimizer. Each is a small model in the pipeline contract; what one
process does with it is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from shapes import GLOBAL_BATCH, Shape, WithPooler
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_hybrid.plugins import AdaptiveLossScalingPrecision
from lightning_hybrid.plugins._loss_scale import LossScaleConfig


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class _Plain(Shape):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _mlp()


class Bf16Mixed(_Plain):
    """``precision="bf16-mixed"``: the forward under bf16 autocast, fp32 weights and gradients. Judged at bf16's
    resolution (each layout's matrix products see other batch shapes)."""

    loss_tolerance, weight_tolerance = 2e-2, 2e-2

    def trainer_kwargs(self, reference: bool = False) -> dict[str, Any]:
        return {"precision": "bf16-mixed"}


class _Overflow(torch.autograd.Function):
    """Identity forward; backward makes the gradient infinite (as an fp16 reduction past 65504 would)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor) -> Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * float("inf")


class _OverflowingHead(nn.Linear):
    overflow = False

    def forward(self, x: Tensor) -> Tensor:
        bias = _Overflow.apply(self.bias) if self.overflow else self.bias
        return torch.nn.functional.linear(x, self.weight, bias)


class Fp16Scaled(Shape):
    """fp16 autocast with loss scaling: ``AdaptiveLossScalingPrecision`` (its ``dynamic`` policy) against Lightning's
    ``MixedPrecision`` with torch's ``GradScaler`` in one process. At steps 2 and 5 the last layer's bias gradient
    overflows (the model makes it infinite, as an fp16 reduction past 65504 would): under ZeRO-1/2 only the rank
    whose shard holds it sees the overflow, and every rank must skip those steps and back off alike. The scale
    leaves room to spare otherwise, so no split of the batch overflows where one process would not."""

    loss_tolerance, weight_tolerance = 2e-3, 2e-3
    INIT, INTERVAL, OVERFLOW_AT = 2.0**12, 1000, (2, 5)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), _OverflowingHead(16, 4))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for m in self.modules():
            if isinstance(m, _OverflowingHead):
                m.overflow = self.trainer.global_step in self.OVERFLOW_AT

    def trainer_kwargs(self, reference: bool = False) -> dict[str, Any]:
        if reference:
            scaler = torch.amp.GradScaler("cpu", init_scale=self.INIT, growth_interval=self.INTERVAL)
            return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
        config = LossScaleConfig(init_scale=self.INIT, growth_interval=self.INTERVAL)
        return {"plugins": [AdaptiveLossScalingPrecision(precision="16-mixed", policy="dynamic", config=config)]}


class ClipNorm(_Plain):
    """``gradient_clip_val`` by the norm, small enough to clip every step (the norm of the whole model's
    gradient, over every stage and shard; a LayerNorm that tensor parallelism keeps whole on every rank counts
    once)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )

    def trainer_kwargs(self, reference: bool = False) -> dict[str, Any]:
        return {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}


class ClipValue(_Plain):
    """``gradient_clip_val`` by value, small enough to clip part of every step's gradient."""

    def trainer_kwargs(self, reference: bool = False) -> dict[str, Any]:
        return {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


class CheckpointedActivations(Shape):
    """Activation checkpointing in the model's own blocks (``torch.utils.checkpoint``, ``use_reentrant=False``):
    backward recomputes the forward of each checkpointed block."""

    reentrant = False

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16),
            _Checkpointed(nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh()), self.reentrant),
            _Checkpointed(nn.Linear(16, 4), self.reentrant),
        )


class ReentrantCheckpointing(CheckpointedActivations):
    """Activation checkpointing with ``use_reentrant=True``: each checkpointed block's weight gradients come from
    a nested backward inside the outer one."""

    reentrant = True


class PartialWindow(_Plain):
    """An epoch of 7 batches with ``accumulate_grad_batches=3``: windows of 3, 3 and 1 batches, the last one
    weighed as Lightning weighs it in one process (each batch's loss divided by 3)."""

    accumulate = 3
    samples = GLOBAL_BATCH * 7
    lightning_accumulation = True


class GradScaled(_Plain):
    """``on_after_backward`` at every micro-batch of a window of two: one gradient scaled in place, one rescaled
    by assignment (``p.grad = p.grad * 2``), as gradient scaling and masking do."""

    accumulate = 2
    lightning_accumulation = True

    def on_after_backward(self) -> None:
        named = dict(self.named_parameters())
        if "layers.0.weight" in named:
            named["layers.0.weight"].grad.mul_(0.5)
        if "layers.4.bias" in named:
            bias = named["layers.4.bias"]
            bias.grad = bias.grad * 2.0


class GradSurgery(_Plain):
    """``on_after_backward`` rewrites each weight's gradient as a function of the whole gradient (divided by its
    norm plus one, as gradient surgery and normalisation do): it needs the replicas' mean there, as one process
    and DDP give it."""

    def on_after_backward(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("weight"):
                p.grad = p.grad / (p.grad.norm() + 1.0)


class HandSet(Shape):
    """``on_after_backward`` sets gradients by hand: on a parameter backward did not reach (a pooler trained by a
    hand-written estimate), and in place of backward's on another."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), WithPooler())

    def on_after_backward(self) -> None:
        named = dict(self.named_parameters())
        if "layers.2.pooler.weight" in named:
            pooler = named["layers.2.pooler.weight"]
            pooler.grad = torch.full_like(pooler, 0.01)
        if "layers.2.head.bias" in named:
            bias = named["layers.2.head.bias"]
            bias.grad = torch.full_like(bias, -0.02)


class Estimated(Shape):
    """``on_after_backward`` sets gradients by hand from this step's data (a hand-written estimator: the mean of
    the targets this rank's loss saw): on a parameter backward did not reach, and in place of backward's on
    another. In one process the estimate is the global batch's; across replicas, each one's own, averaged."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), WithPooler())
        self._seen: list[float] = []

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            self._seen.append(float(target.float().mean()))
        return super().pipeline_loss(output, target)

    def on_after_backward(self) -> None:
        signal = sum(self._seen) / len(self._seen) if self._seen else 0.0
        self._seen = []
        named = dict(self.named_parameters())
        if "layers.2.pooler.weight" in named:
            pooler = named["layers.2.pooler.weight"]
            pooler.grad = torch.full_like(pooler, 0.05 * (1.0 + signal))
        if "layers.2.head.bias" in named:
            bias = named["layers.2.head.bias"]
            bias.grad = torch.full_like(bias, signal)


class StepHookGroups(_Plain):
    """``on_before_optimizer_step`` halves every gradient the optimizer steps, through its param groups."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)


class StepHookParams(_Plain):
    """``on_before_optimizer_step`` edits the module's own parameters' ``.grad``: halves them, and clips one
    layer's by its norm with ``torch.nn.utils.clip_grad_norm_``."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p in self.parameters():
            p.grad.mul_(0.5)
        first = [p for name, p in self.named_parameters() if name.startswith("layers.0.")]
        if first:
            torch.nn.utils.clip_grad_norm_(first, 0.02)


class TensorHook(_Plain):
    """Tensor hooks on parameters, registered when the model is built (a gradient scale, a fixed mask): their
    output is what accumulates."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[0].weight.register_hook(lambda g: g * 0.5)
        mask = (torch.arange(16 * 16).view(16, 16) % 3 != 0).float()
        self.layers[2].weight.register_hook(lambda g: g * mask)


class FrozenMidWindow(_Plain):
    """A window of two micro-batches in which the first layer is frozen after the first (and unfrozen after the
    step): the first micro-batch's gradient still steps it, as in one process. Every window is whole (4 batches
    an epoch), so a resumed run freezes mid-window too."""

    accumulate = 2
    samples = GLOBAL_BATCH * 4
    lightning_accumulation = True

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for name, p in self.named_parameters():
            if name.startswith("layers.0."):
                p.requires_grad_(batch_idx % 2 == 1)


class ManualFrozen(_Plain):
    """Manual optimization: a backward, then the first layer is frozen and a second loss's backward adds to the
    others only; the step, then the layer is unfrozen."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.manual_backward(loss)
        self.layers[0].requires_grad_(False)
        self.manual_backward(self(x).pow(2).mean() * 0.1)
        optimizer.step()
        optimizer.zero_grad()
        self.layers[0].requires_grad_(True)
        return loss


class ManualEdits(_Plain):
    """Manual optimization that edits gradients between backward and the step: one scaled in place, one rescaled
    by assignment."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.manual_backward(loss)
        self.layers[0].weight.grad.mul_(0.5)
        bias = self.layers[4].bias
        bias.grad = bias.grad * 2.0
        optimizer.step()
        optimizer.zero_grad()
        return loss


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x)) * self.gain


class OutsideOptimizer(Shape):
    """A trainable parameter in no optimizer, updated by hand from its gradient in ``on_before_optimizer_step``
    (and its gradient cleared there: the optimizer's ``zero_grad`` does not reach it)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), _Gain(), nn.Linear(16, 4))

    def configure_optimizers(self) -> Any:
        return self.make_optimizer([p for name, p in self.named_parameters() if not name.endswith(".gain")])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for name, p in self.named_parameters():
            if name.endswith(".gain") and p.grad is not None:
                with torch.no_grad():
                    p.sub_(0.5 * p.grad)
                p.grad = None


class _SaveAtStart(Callback):
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.save_checkpoint(Path(trainer.log_dir) / "before-first-step")


class SavedBeforeStepping(_Plain):
    """A checkpoint written before the first optimizer step (``trainer.save_checkpoint`` in ``on_train_start``),
    with SGD's momentum: writing it must not change the optimizer (torch's DCP creates an optimizer's state by a
    step at LR 0 when it has none: SGD's momentum then starts from weight_decay * p)."""

    def callbacks(self) -> list[Callback]:
        return [_SaveAtStart()]


class _ReadState(Callback):
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizer = trainer.optimizers[0]
        for name, p in pl_module.named_parameters():
            if p.requires_grad and not optimizer.state[p]:
                raise AssertionError(f"optimizer.state[{name}] is empty after a step")
        optimizer.state_dict()


class ReadsOptimizerState(_Plain):
    """A callback reads ``optimizer.state[p]`` for each of the model's parameters and ``optimizer.state_dict()``
    after every step (an optimizer-statistics logger): what one process holds, or a refusal naming where the state
    is; never an empty state in silence."""

    def callbacks(self) -> list[Callback]:
        return [_ReadState()]


TRAINING_SHAPES = {
    "bf16-mixed": Bf16Mixed,
    "fp16-scaled": Fp16Scaled,
    "clip-norm": ClipNorm,
    "clip-value": ClipValue,
    "checkpointed": CheckpointedActivations,
    "checkpointed-reentrant": ReentrantCheckpointing,
    "partial-window": PartialWindow,
    "grad-scaled": GradScaled,
    "grad-surgery": GradSurgery,
    "grad-hand-set": HandSet,
    "grad-estimated": Estimated,
    "step-hook-groups": StepHookGroups,
    "step-hook-params": StepHookParams,
    "tensor-hook": TensorHook,
    "frozen-mid-window": FrozenMidWindow,
    "manual-frozen": ManualFrozen,
    "manual-edits": ManualEdits,
    "outside-optimizer": OutsideOptimizer,
    "saved-before-stepping": SavedBeforeStepping,
    "reads-optimizer-state": ReadsOptimizerState,
}
