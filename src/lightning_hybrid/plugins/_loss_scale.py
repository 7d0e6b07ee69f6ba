"""The loss-scale state machine: plain numbers in, one decision out. No tensors, no process group.

Every rank feeds it the same job-wide inputs (reduced with one all-reduce before), so every rank takes
the same decision and holds the same scale. Three policies:

- ``"dynamic"``: ``torch.amp.GradScaler``'s rule: x ``backoff_factor`` and skip on overflow, x
  ``growth_factor`` after ``growth_interval`` clean steps.
- ``"hysteresis"``: Megatron-LM / DeepSpeed's rule: as dynamic, but the scale backs off only after
  ``hysteresis`` overflows since the last growth (each overflowing step is still skipped).
- ``"adaptive"``: reads the headroom of each clean step, ``fp16_max / (max|grad| * scale)``, and keeps it
  inside ``[min_headroom, max_headroom]``: it halves the scale before gradients get close to overflowing
  (no step lost) and doubles it as soon as ``adapt_interval`` clean steps all had headroom to spare (so
  small gradients do not underflow). An overflow still backs off and skips.

A non-finite loss skips the step without touching the scale: it is not a scaling problem.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from lightning_hybrid._validate import check_int, check_number

__all__ = ["FP16_MAX", "LossScaleConfig", "LossScaleState", "LossScaler", "Policy", "StepDecision"]

FP16_MAX = 65504.0
Policy = Literal["adaptive", "dynamic", "hysteresis"]


@dataclass(frozen=True)
class LossScaleConfig:
    """How the scale moves. Scales and factors are powers of two, so scaling is exact in floating point.

    Args:
        init_scale: the scale of the first step.
        min_scale: the scale never goes below this (an overflow at it still skips the step).
        max_scale: the scale never goes above this.
        growth_factor: what the scale is multiplied by when it grows.
        backoff_factor: what the scale is multiplied by after an overflow.
        growth_interval: ``"dynamic"`` and ``"hysteresis"`` policies: steps without an overflow before the
            scale grows.
        hysteresis: ``"hysteresis"`` policy: the scale backs off at this many overflows since the last growth
            (each overflowing step is still skipped).
        min_headroom: ``"adaptive"`` policy: the scale shrinks when the largest scaled gradient comes closer
            than this factor to fp16's largest value.
        max_headroom: ``"adaptive"`` policy: the scale grows when every step since the last change kept more
            headroom than this factor.
        adapt_interval: ``"adaptive"`` policy: steps without an overflow between growths.
    """

    init_scale: float = 2.0**16
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # dynamic / hysteresis
    hysteresis: int = 2  # hysteresis
    min_headroom: float = 2.0**4  # adaptive: shrink when the largest scaled gradient is closer to fp16 max
    max_headroom: float = 2.0**10  # adaptive: grow when every recent step had more headroom than this
    adapt_interval: int = 50  # adaptive: clean steps between growths

    def __post_init__(self) -> None:
        for name in ("init_scale", "min_scale", "max_scale", "growth_factor", "backoff_factor"):
            value = check_number(name, getattr(self, name), minimum=0, inclusive=False)
            if not math.log2(value).is_integer():
                raise ValueError(f"{name} must be a power of two, got {value}.")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"init_scale ({self.init_scale}) must lie in [min_scale, max_scale] = [{self.min_scale},"
                f" {self.max_scale}]."
            )
        if self.growth_factor <= 1 or self.backoff_factor >= 1:
            raise ValueError(
                f"growth_factor must be > 1 and backoff_factor < 1, got {self.growth_factor}, {self.backoff_factor}."
            )
        for name in ("growth_interval", "hysteresis", "adapt_interval"):
            check_int(name, getattr(self, name), minimum=1)
        check_number("min_headroom", self.min_headroom, minimum=1)
        check_number(
            "max_headroom", self.max_headroom, minimum=self.min_headroom, inclusive=False,
            fix="the adaptive band needs min_headroom < max_headroom",
        )  # fmt: skip
        if not 1 <= self.min_headroom < self.max_headroom:
            raise ValueError(f"need 1 <= min_headroom < max_headroom, got {self.min_headroom}, {self.max_headroom}.")


@dataclass
class LossScaleState:
    """Everything the scaler knows; plain numbers, so it round-trips through any checkpoint."""

    scale: float
    growth_tracker: int = 0  # clean steps since the scale last changed
    hysteresis_left: int = 1
    min_headroom_seen: float = math.inf  # adaptive: smallest headroom since the scale last changed
    steps: int = 0  # optimizer steps decided
    skipped_steps: int = 0  # all skipped steps (overflow or non-finite loss)
    nonfinite_loss_steps: int = 0
    consecutive_skips: int = 0
    last_headroom: float = math.nan


@dataclass(frozen=True)
class StepDecision:
    skip: bool
    reason: Literal["", "overflow", "nonfinite_loss"]
    scale: float  # the scale for the next step


class LossScaler:
    """Decides, from job-wide inputs, whether a step is taken and what the next scale is."""

    def __init__(self, policy: Policy = "adaptive", config: LossScaleConfig | None = None) -> None:
        if policy not in ("adaptive", "dynamic", "hysteresis"):
            raise ValueError(f"policy must be 'adaptive', 'dynamic' or 'hysteresis', got {policy!r}.")
        self.policy = policy
        self.config = config or LossScaleConfig()
        self.state = LossScaleState(scale=self.config.init_scale, hysteresis_left=self.config.hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, *, found_inf: bool, loss_nonfinite: bool = False, grad_absmax: float = math.nan) -> StepDecision:
        """One optimizer step: ``grad_absmax`` is the largest unscaled gradient magnitude (job-wide)."""
        s, c = self.state, self.config
        s.steps += 1
        if loss_nonfinite:
            s.skipped_steps += 1
            s.nonfinite_loss_steps += 1
            s.consecutive_skips += 1
            return StepDecision(True, "nonfinite_loss", s.scale)
        if found_inf:
            s.skipped_steps += 1
            s.consecutive_skips += 1
            s.growth_tracker = 0
            s.min_headroom_seen = math.inf
            if self.policy == "hysteresis":
                s.hysteresis_left -= 1
                if s.hysteresis_left <= 0:
                    self._set(s.scale * c.backoff_factor)
            else:
                self._set(s.scale * c.backoff_factor)
            return StepDecision(True, "overflow", s.scale)

        s.consecutive_skips = 0
        s.growth_tracker += 1
        if self.policy == "adaptive":
            self._adapt(grad_absmax)
        elif s.growth_tracker >= c.growth_interval:
            self._set(s.scale * c.growth_factor)
            s.hysteresis_left = c.hysteresis
        return StepDecision(False, "", s.scale)

    def _adapt(self, grad_absmax: float) -> None:
        s, c = self.state, self.config
        if not math.isfinite(grad_absmax) or grad_absmax <= 0:
            headroom = math.inf  # no gradient signal (all zero): as much room as there is
        else:
            headroom = FP16_MAX / (grad_absmax * s.scale)
        s.last_headroom = headroom
        s.min_headroom_seen = min(s.min_headroom_seen, headroom)
        if headroom < c.min_headroom:
            # shrink before an overflow costs a step: by as many halvings as the headroom is short
            halvings = max(1, math.ceil(math.log2(c.min_headroom / headroom)))
            self._set(s.scale * c.backoff_factor**halvings)
        elif s.growth_tracker >= c.adapt_interval and s.min_headroom_seen > c.max_headroom:
            self._set(s.scale * c.growth_factor)

    def _set(self, scale: float) -> None:
        c = self.config
        self.state.scale = float(min(max(scale, c.min_scale), c.max_scale))
        self.state.growth_tracker = 0
        self.state.min_headroom_seen = math.inf

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, **asdict(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fields = LossScaleState.__dataclass_fields__
        self.state = LossScaleState(**{k: v for k, v in state.items() if k in fields})
