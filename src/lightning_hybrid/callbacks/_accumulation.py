"""Accumulation schedules as plain data: validation, lookup, ramps, the switch rule and the noise scale.

Lightning closes an accumulation window after batch ``b`` when ``(b + 1) % K == 0`` (``b`` counted within
the epoch) and divides each micro-batch loss by the current ``K``. A window therefore averages exactly its
own gradients only if it starts at a multiple of its size, so a new ``K`` is applied at a batch ``b`` where
the old window has ended (``b % K_old == 0``) and ``b % K_new == 0``; until then the change waits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["NoiseScale", "Ramp", "can_switch", "lookup", "validate_schedule"]


def validate_schedule(schedule: dict[int, int]) -> dict[int, int]:
    """Keys strictly increasing integers >= 0, values integers >= 1; ``K = 1`` before the first key."""
    if not schedule:
        raise ValueError("schedule must not be empty, e.g. {0: 1, 1000: 4}.")
    keys = list(schedule)
    for key, k in schedule.items():
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ValueError(f"schedule keys must be integers >= 0, got {key!r}.")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"accumulate_grad_batches must be an integer >= 1, got {k!r} at key {key}.")
    if any(b <= a for a, b in itertools.pairwise(keys)):
        raise ValueError(f"schedule keys must be strictly increasing, got {keys}.")
    return dict(schedule)


def lookup(schedule: dict[int, int], position: float) -> int:
    """The ``K`` in force at ``position`` (the value of the largest key <= position)."""
    k = 1
    for key, value in schedule.items():
        if key > position:
            break
        k = value
    return k


def can_switch(batch_idx: int, k_old: int, k_new: int) -> bool:
    """Whether ``K`` may change from ``k_old`` to ``k_new`` at the start of within-epoch batch ``batch_idx``."""
    return batch_idx % k_old == 0 and batch_idx % k_new == 0


@dataclass(frozen=True)
class Ramp:
    """``K`` from ``start`` to ``end`` over ``length`` units beginning at ``begin``, doubling or by +1.

    Args:
        start: ``K`` at ``begin`` (at least 1).
        end: ``K`` from ``begin + length`` on (more than ``start``).
        length: units (of the scheduler's ``unit``) the ramp takes, its steps spread evenly over them.
        begin: the unit at which the ramp starts.
        increments: ``"pow2"`` doubles ``K`` at each of its steps, ``"linear"`` adds 1.
    """

    start: int
    end: int
    length: int
    begin: int = 0
    increments: Literal["pow2", "linear"] = "pow2"

    def __post_init__(self) -> None:
        if self.start < 1 or self.end < 1:
            raise ValueError(f"ramp K values must be >= 1, got start={self.start}, end={self.end}.")
        if self.end <= self.start:
            raise ValueError(f"a ramp must increase: end ({self.end}) must be > start ({self.start}).")
        if self.length < 1 or self.begin < 0:
            raise ValueError(f"a ramp needs length >= 1 and begin >= 0, got {self.length}, {self.begin}.")
        if self.increments not in ("pow2", "linear"):
            raise ValueError(f"increments must be 'pow2' or 'linear', got {self.increments!r}.")

    def schedule(self) -> dict[int, int]:
        if self.increments == "pow2":
            values, k = [], self.start
            while k < self.end:
                values.append(k)
                k *= 2
            values.append(self.end)
        else:
            values = list(range(self.start, self.end + 1))
        # equal shares of the ramp's length for each value but the last, which holds from the end on
        step = self.length / (len(values) - 1)
        out = {0: 1} if self.begin else {}
        out.update({self.begin + round(i * step): v for i, v in enumerate(values)})
        return validate_schedule(out)


class NoiseScale:
    """The simple gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, App. A).

    From the squared norm of a small-batch gradient (``b_small`` samples) and of a big-batch gradient
    (``b_big`` samples) of the same step, unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` are smoothed
    with an exponential moving average each (``beta=None``: a plain mean of all steps, for a stationary
    problem), and their ratio is the estimate.
    """

    def __init__(self, beta: float | None = 0.95) -> None:
        if beta is not None and not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1) or None (a plain mean of all steps), got {beta}.")
        self.beta = beta
        self.g2 = 0.0
        self.trace = 0.0
        self.count = 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float | None:
        if b_big <= b_small or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return self.value
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self.count += 1
        beta = self.beta if self.beta is not None else 1.0 - 1.0 / self.count
        self.g2 = beta * self.g2 + (1 - beta) * g2
        self.trace = beta * self.trace + (1 - beta) * trace
        return self.value

    @property
    def value(self) -> float | None:
        if self.count == 0 or self.g2 <= 0:
            return None
        return self.trace / self.g2  # the bias corrections of both averages cancel in the ratio

    def state_dict(self) -> dict[str, float]:
        return {"g2": self.g2, "trace": self.trace, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.g2, self.trace, self.count = state["g2"], state["trace"], int(state["count"])
