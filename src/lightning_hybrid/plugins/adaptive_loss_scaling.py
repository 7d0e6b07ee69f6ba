"""AdaptiveLossScalingPrecision: fp16 loss scaling whose decisions are the same on every rank."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree, distributed_ready
from lightning_hybrid._lightning_compat import hooks_before_optimizer_step
from lightning_hybrid._protocols import StepsInsideTrainingStep
from lightning_hybrid._skip import skip_schedulers_when
from lightning_hybrid._torch_compat import grad_scaler_growth_tracker, mul_
from lightning_hybrid._validate import check_choice, check_int
from lightning_hybrid.plugins._clipping import MeshAwareClippingMixin
from lightning_hybrid.plugins._loss_scale import LossScaleConfig, LossScaler, Policy

__all__ = ["AdaptiveLossScalingPrecision"]

log = logging.getLogger(__name__)


class AdaptiveLossScalingPrecision(MeshAwareClippingMixin, Precision):
    """Mixed precision whose loss scale, skip decision and LR schedule stay in lockstep on every rank.

    fp16 autocast with fp32 master weights (``"16-mixed"``) or bf16 autocast (``"bf16-mixed"``, scale 1).
    After each accumulation window the gradients are unscaled, and one all-reduce of three numbers (any
    non-finite gradient, any non-finite loss, the largest gradient magnitude) over the whole job (data
    parallel, ZeRO shards and pipeline stages) feeds the same state machine on every rank: every rank
    skips the same steps and holds the same scale. A skipped step leaves parameters, optimizer state and
    step-interval LR schedulers untouched (Lightning's ``global_step`` still counts it; the effective
    count is ``optimizer_steps_taken``). Clipping sees the unscaled gradients and the global norm.

    Args:
        precision: ``"16-mixed"`` (fp16, scaled) or ``"bf16-mixed"`` (no scaling; the agreed finite check,
            skip and bookkeeping remain).
        policy: ``"adaptive"`` (keeps gradient headroom in a target band), ``"dynamic"`` (``GradScaler``'s
            rule) or ``"hysteresis"`` (Megatron-LM / DeepSpeed's rule).
        config: initial / min / max scale, factors, intervals and the adaptive headroom band.
        max_consecutive_skips: after this many skipped steps in a row, ``on_floor`` applies.
        on_floor: ``"raise"`` or ``"warn"``, naming the first parameters whose gradients were non-finite.
        log_every_n_steps: how often ``loss_scale``, ``skipped_rate`` and ``headroom`` go to the loggers
            (default: the Trainer's ``log_every_n_steps``).
        device: the autocast device type (default: the current accelerator, else CPU).

    Example::

        trainer = Trainer(plugins=[AdaptiveLossScalingPrecision(policy="adaptive")], strategy="ddp")
    """

    def __init__(
        self,
        *,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        policy: Policy = "adaptive",
        config: Union[LossScaleConfig, Mapping[str, Any], None] = None,
        max_consecutive_skips: int = 20,
        on_floor: Literal["raise", "warn"] = "raise",
        log_every_n_steps: Union[int, None] = None,
        device: Union[str, None] = None,
    ) -> None:
        check_choice("precision", precision, ("16-mixed", "bf16-mixed"))
        check_choice("policy", policy, ("adaptive", "dynamic", "hysteresis"))
        check_choice("on_floor", on_floor, ("raise", "warn"))
        check_int("max_consecutive_skips", max_consecutive_skips, minimum=1)
        check_int("log_every_n_steps", log_every_n_steps, minimum=1, optional=True, fix="None follows the Trainer")
        if device is not None and not isinstance(device, str):
            raise ValueError(f"device must be a device type such as 'cuda' or 'cpu', or None, got {device!r}.")
        config = _as_config(config)
        self.precision = precision
        self.scaler_state = LossScaler(policy, config)
        if precision == "bf16-mixed":
            self.scaler_state.state.scale = 1.0
        self.max_consecutive_skips = max_consecutive_skips
        self.on_floor = on_floor
        self.log_every_n_steps = log_every_n_steps
        if device is None:
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            device = accelerator.type if accelerator is not None else "cpu"
        self.device = device
        self.last_step_skipped = False
        self._loss_finite: Union[Tensor, None] = None
        self._wrapped_schedulers = False

    # ------------------------------------------------------------------------------------- readable

    def check_strategy(self, strategy: Any) -> None:
        """Refuse an engine that scales the loss itself (``ChecksItsStrategy``)."""
        if isinstance(strategy, StepsInsideTrainingStep):
            raise ValueError(
                f"AdaptiveLossScalingPrecision cannot drive {strategy.engine_name()}'s engine, which scales the loss"
                " itself: pass precision='16-mixed' (the engine's loss scaler, tuned under `fp16` in its config) or"
                " use HybridParallelStrategy for the adaptive, rank-agreed scaler."
            )

    @property
    def loss_scale(self) -> float:
        return self.scaler_state.scale

    @property
    def skipped_steps(self) -> int:
        return self.scaler_state.state.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        return self.scaler_state.state.consecutive_skips

    @property
    def optimizer_steps_taken(self) -> int:
        """Optimizer steps that changed the parameters (Lightning's ``global_step`` also counts skipped ones)."""
        return self.scaler_state.state.steps - self.scaler_state.state.skipped_steps

    @property
    def _scaling(self) -> bool:
        return self.precision == "16-mixed"

    # ------------------------------------------------------------------------------------- forward

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        dtype = torch.half if self._scaling else torch.bfloat16
        with torch.autocast(self.device, dtype=dtype, cache_enabled=False):
            yield

    def _note_loss(self, loss: Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()  # stays a tensor: no host sync per micro-batch
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        self._note_loss(tensor)
        if self._scaling:
            tensor = tensor * self.loss_scale
        return super().pre_backward(tensor, module)

    def scale_pipeline_loss(self, loss: Tensor) -> Tensor:
        """Called by HybridParallelStrategy on each micro-batch loss inside the pipeline schedule."""
        # not noted here: the schedule also calls it on placeholder tensors while it infers shapes; the
        # step's mean loss reaches pre_backward through the strategy instead
        return loss * self.loss_scale if self._scaling else loss

    def unscale_pipeline_loss(self, loss: Tensor) -> Tensor:
        return loss / self.loss_scale if self._scaling else loss

    # ----------------------------------------------------------------------------------------- step

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        self._wrap_schedulers(model)
        closure_result = closure()
        nothing = closure_result is None and model.automatic_optimization  # training_step returned None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        if self._scaling and grads:
            mul_(grads, 1.0 / self.loss_scale)  # a power of two: exact
        found_inf, absmax = _inf_and_absmax(grads)
        loss_bad = 0.0 if self._loss_finite is None else float(not bool(self._loss_finite))
        self._loss_finite = None
        device = None  # where the backend communicates (a rank may hold no gradient: its shard is all unused)
        # the one collective of the decision, also where training_step returned None (so that no rank waits
        # for another): every rank then runs the same state machine on the same input
        found_inf, loss_bad, absmax, nothing_any = agree([found_inf, loss_bad, absmax, float(nothing)], device=device)
        if nothing_any:
            for p in params:
                p.grad = None
            return closure_result  # some rank had nothing to step: no rank steps, the scale stays
        decision = self.scaler_state.update(
            found_inf=bool(found_inf), loss_nonfinite=bool(loss_bad), grad_absmax=absmax
        )
        self.last_step_skipped = decision.skip
        self._log(model)
        if decision.skip:
            if self.consecutive_skips >= self.max_consecutive_skips:
                self._at_floor(model, params, decision.reason)
            for p in params:
                p.grad = None  # the optimizer leaves parameters without gradients (and their state) alone
            return closure_result
        hooks_before_optimizer_step(self, model, optimizer)  # the hooks and clipping see unscaled gradients
        return optimizer.step(**kwargs)

    def _at_floor(self, model: pl.LightningModule, params: list[Tensor], reason: str) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        bad = [names.get(id(p), "?") for p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if distributed_ready():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, bad[:3])
            bad = [f"{n} (rank {r})" for r, names_r in enumerate(gathered) for n in names_r][:5]
        message = (
            f"AdaptiveLossScalingPrecision: {self.consecutive_skips} optimizer steps in a row were skipped"
            f" ({reason}), loss scale {self.loss_scale:g} (min_scale {self.scaler_state.config.min_scale:g})."
            f" First parameters with non-finite gradients: {bad or 'none (the loss itself was non-finite)'}."
            " Lower the learning rate, check the data and the model's numerics, or use bf16-mixed."
        )
        if self.on_floor == "raise":
            raise FloatingPointError(message)
        rank_zero_warn(message)

    def _wrap_schedulers(self, model: pl.LightningModule) -> None:
        if self._wrapped_schedulers:
            return
        self._wrapped_schedulers = True
        skip_schedulers_when(model.trainer, self._skipped_last_step)

    def _skipped_last_step(self) -> bool:
        return self.last_step_skipped

    def _log(self, model: pl.LightningModule) -> None:
        trainer = model.trainer
        if not trainer.is_global_zero or not trainer.loggers:
            return
        every = self.log_every_n_steps or trainer.log_every_n_steps
        state = self.scaler_state.state
        if (trainer.global_step + 1) % max(every, 1):
            return
        metrics = {
            "loss_scale": self.loss_scale,
            "skipped_rate": state.skipped_steps / max(state.steps, 1),
            "headroom_log2": math.log2(state.last_headroom) if 0 < state.last_headroom < math.inf else 0.0,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step + 1)  # the step being completed

    # ---------------------------------------------------------------------------------- checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler_state.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        tracker = grad_scaler_growth_tracker(state_dict)
        if tracker is not None:  # torch GradScaler's state (Lightning's MixedPrecision)
            self.scaler_state.state.scale = float(state_dict["scale"])
            self.scaler_state.state.growth_tracker = tracker
            return
        self.scaler_state.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written with Lightning's MixedPrecision stores the GradScaler under its class name
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self.load_state_dict(checkpoint["MixedPrecision"])


def _as_config(config: Any) -> Union[LossScaleConfig, None]:
    """``config`` as a LossScaleConfig: LightningCLI hands a YAML mapping over as a plain dict."""
    if config is None or isinstance(config, LossScaleConfig):
        return config
    if isinstance(config, Mapping):
        known = {f.name for f in dataclasses.fields(LossScaleConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"config has unknown key(s) {unknown}; LossScaleConfig takes {sorted(known)}.")
        return LossScaleConfig(**config)
    raise ValueError(f"config must be a LossScaleConfig or a mapping of its fields, got {config!r}.")


def _inf_and_absmax(grads: list[Tensor]) -> tuple[float, float]:
    if not grads:
        return 0.0, 0.0
    maxes = torch.stack([g.detach().abs().max().float() for g in grads])
    absmax = maxes.max()
    found_inf = not bool(torch.isfinite(absmax))  # one host sync for both numbers
    return float(found_inf), (0.0 if found_inf else float(absmax))
