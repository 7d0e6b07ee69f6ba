"""What one component of the pack needs of another, as small protocols.

Components find each other through these instead of ``getattr`` with a default: a strategy or plugin
that claims a capability must implement all of it, and a missing method fails at set-up with the class
named, never as a silently skipped step.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = [
    "ChecksItsStrategy",
    "ExactWindowMeans",
    "LeavesModelGradientsAlone",
    "PipelineLossScaling",
    "ReportsGradientLayout",
    "ShardedCheckpointing",
    "SkipsNonFiniteSteps",
    "StepsInsideTrainingStep",
    "TakesTensorPartition",
]


@runtime_checkable
class SkipsNonFiniteSteps(Protocol):
    """A precision plugin that already skips optimizer steps with non-finite gradients, agreed on every rank."""

    @property
    def last_step_skipped(self) -> bool: ...


@runtime_checkable
class PipelineLossScaling(Protocol):
    """A precision plugin that scales each pipeline micro-batch loss (the schedule runs backward itself)."""

    def scale_pipeline_loss(self, loss: Tensor) -> Tensor: ...

    def unscale_pipeline_loss(self, loss: Tensor) -> Tensor: ...


@runtime_checkable
class ShardedCheckpointing(Protocol):
    """A strategy whose checkpoints are sharded (torch DCP) folders that any layout can read."""

    def checkpoint_layout(self) -> dict[str, Any]: ...

    def read_sharded_checkpoint(self, path: Any, module: Any, *, fitting: bool) -> dict[str, Any]:
        """Load a sharded folder of any layout and either engine into this rank's part; return ``meta.pt``."""
        ...


@runtime_checkable
class ReportsGradientLayout(Protocol):
    """A strategy that says how its gradients are laid out when the optimizer steps (for the noise scale)."""

    def gradient_layout(self) -> tuple[int, bool]:
        """(ranks holding each gradient element, whether every backward already averaged over replicas)."""
        ...

    def current_gradients(self, module: Any) -> list[Tensor]:
        """This rank's part of the gradient accumulated so far in the accumulation window."""
        ...

    def step_gradients(self, optimizer: Any) -> list[Tensor]:
        """This rank's part of the gradients ``optimizer`` steps with, each element on ``gradient_layout()[0]``
        ranks (a part every tensor-parallel rank holds is given by one of them)."""
        ...


@runtime_checkable
class TakesTensorPartition(Protocol):
    """An optimizer whose update needs whole-tensor norms: a strategy that steps it on pieces of tensors tells
    it which model tensor each element belongs to (``lightning_hybrid.optim.TensorPartition``)."""

    def set_tensor_partition(self, partition: Any) -> None: ...


@runtime_checkable
class ExactWindowMeans(Protocol):
    """A strategy whose optimizer step already sees the exact mean over the accumulation window's counted
    elements, whatever the window's length (the module defines ``pipeline_loss_count``): nothing may rescale
    a short window's gradient again."""

    def exact_window_means(self) -> bool: ...


@runtime_checkable
class StepsInsideTrainingStep(Protocol):
    """A strategy whose engine runs forward, backward, loss scaling, accumulation and the optimizer step of each
    batch inside ``training_step`` (DeepSpeed's pipeline engine), its accumulation fixed when the engine is built.
    A callback or plugin that must act between those steps refuses itself against this, at set-up."""

    def engine_name(self) -> str:
        """Whose engine it is, for messages ("DeepSpeed")."""
        ...

    def engine_micro_batches(self) -> int:
        """Micro-batches the engine accumulates per optimizer step (known from ``setup_environment`` on)."""
        ...


@runtime_checkable
class ChecksItsStrategy(Protocol):
    """A precision plugin that refuses a strategy it cannot work under. Plugins have no set-up hook: a strategy
    calls this on its precision plugin at set-up, before it builds anything."""

    def check_strategy(self, strategy: Any) -> None: ...


@runtime_checkable
class LeavesModelGradientsAlone(Protocol):
    """A callback whose ``on_after_backward`` and ``on_before_optimizer_step`` read gradients only through the
    strategy (``ReportsGradientLayout.current_gradients``) and the optimizer's param groups, editing them there
    element-wise, and never read or assign ``param.grad`` of the model's parameters: a strategy need not make the
    model's whole gradient visible to it (ZeRO-1/2 then keep their cheapest reduction)."""

    def leaves_model_gradients_alone(self) -> bool: ...
