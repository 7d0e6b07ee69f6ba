"""AccumulationScheduler: exact gradient-accumulation schedules by step, epoch, samples, ramp or noise scale."""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction
from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree
from lightning_hybrid._protocols import ExactWindowMeans, ReportsGradientLayout, StepsInsideTrainingStep
from lightning_hybrid._validate import check_choice, check_int, check_number
from lightning_hybrid.callbacks._accumulation import NoiseScale, Ramp, can_switch, lookup, validate_schedule
from lightning_hybrid.callbacks._samplers import data_replicas

__all__ = ["AccumulationScheduler"]

Unit = Literal["step", "epoch", "samples", "adaptive"]


class AccumulationScheduler(Callback):
    """Changes ``accumulate_grad_batches`` during training so that every step averages exactly its window.

    A new ``K`` takes effect only at a batch where the old window has ended and which is a multiple of the
    new ``K`` (Lightning aligns windows to multiples of ``K`` within an epoch); until then it waits. The
    partial last window of an epoch is scaled by ``K / r`` so it is the true mean of its ``r`` batches.
    Works with any strategy (DDP, HybridParallelStrategy, single device) and with loss scaling (one
    decision per window).

    Args:
        schedule: ``{position: K}``; ``position`` in ``unit``. ``K = 1`` before the first key.
        unit: ``"step"`` (optimizer steps taken), ``"epoch"``, ``"samples"`` (consumed samples over all
            data-parallel ranks), or ``"adaptive"`` (``K`` from the measured gradient noise scale).
        ramp: instead of ``schedule``: ``K`` from ``start`` to ``end`` over ``length`` units.
        min_k: lower bound of the adaptive ``K`` (powers of two in between; ``min_k >= 2`` to measure).
        max_k: upper bound of the adaptive ``K``.
        adapt_every: optimizer steps between adaptive changes (each at most x2 or /2).
        lr_scaling: multiply the LR by ``K / K0`` (``"linear"``) or its square root while ``K`` differs from
            the first ``K0``; applied around each optimizer step, so it composes with LR schedulers that set
            the LR from their base values (LambdaLR, cosine, OneCycle, ...).
        noise_ema: smoothing of the noise-scale estimate (exponential moving average factor per step);
            ``None`` averages all steps equally.
        noise_fraction: the adaptive batch aims at ``noise_fraction * B_noise`` samples. By the empirical
            model of large-batch training (McCandlish et al. 2018), a batch ``B = f * B_noise`` needs about
            ``1 + f`` times the fewest samples and ``1 + 1/f`` times the fewest steps: ``1.0`` (the critical
            batch) halves neither; ``0.1``-``0.25`` keeps the samples near those of a small batch while still
            cutting the steps.

    Example::

        AccumulationScheduler(schedule={0: 1, 1000: 2, 5000: 8}, unit="step")
    """

    def __init__(
        self,
        *,
        schedule: Union[dict[int, int], None] = None,
        unit: Unit = "step",
        ramp: Union[Ramp, None] = None,
        min_k: int = 2,
        max_k: int = 64,
        adapt_every: int = 10,
        lr_scaling: Literal["none", "linear", "sqrt"] = "none",
        noise_ema: Union[float, None] = 0.95,
        noise_fraction: float = 1.0,
    ) -> None:
        check_choice("unit", unit, ("step", "epoch", "samples", "adaptive"))
        check_choice("lr_scaling", lr_scaling, ("none", "linear", "sqrt"))
        if ramp is not None and not isinstance(ramp, Ramp):
            raise ValueError(f"ramp must be a Ramp(start, end, length, ...), got {ramp!r}.")
        if (schedule is None) == (ramp is None) and unit != "adaptive":
            raise ValueError("give exactly one of schedule= or ramp= (or unit='adaptive').")
        check_int("min_k", min_k, minimum=1)
        check_int("max_k", max_k, minimum=min_k, fix=f"max_k bounds K from above and min_k is {min_k}")
        if unit == "adaptive" and min_k < 2:
            raise ValueError(
                f"unit='adaptive' needs min_k >= 2 (got {min_k}): the noise scale is measured from one micro-batch"
                " against the window, so a window must hold at least two."
            )
        check_int("adapt_every", adapt_every, minimum=1)
        check_number("noise_ema", noise_ema, minimum=0.0, optional=True)
        if noise_ema is not None and not noise_ema < 1:
            raise ValueError(f"noise_ema must be in [0, 1) or None, got {noise_ema!r}.")
        check_number("noise_fraction", noise_fraction, minimum=0.0, inclusive=False,
                     fix="it is the batch aimed at, in units of the noise scale B_noise")  # fmt: skip
        if schedule is not None and not isinstance(schedule, dict):
            raise ValueError(f"schedule must be a mapping {{position: K}}, e.g. {{0: 1, 1000: 4}}, got {schedule!r}.")
        resolved = validate_schedule(
            ramp.schedule() if ramp is not None else schedule if schedule is not None else {0: min_k}
        )
        if unit == "adaptive":
            starts = {0: 1, **resolved}  # K is 1 before the first key
            outside = {pos: k for pos, k in starts.items() if not min_k <= k <= max_k}
            if outside:
                raise ValueError(
                    f"unit='adaptive' starts from schedule {resolved}, but K must stay in [min_k, max_k] ="
                    f" [{min_k}, {max_k}] (the noise scale needs K >= 2 to be measured); {outside} is outside."
                    " Leave schedule unset to start at min_k."
                )
        self.unit = unit
        self.schedule = resolved
        self.min_k, self.max_k, self.adapt_every = min_k, max_k, adapt_every
        self.lr_scaling = lr_scaling
        self.noise = NoiseScale(beta=noise_ema)
        self.noise_fraction = noise_fraction
        # state (saved)
        self.k = lookup(self.schedule, 0)
        self.k0 = self.k
        self.samples = 0
        self.scale = Fraction(1)  # K x scale is used: a resume on other replicas keeps the global batch
        self.last_adapt_step = 0
        self._in_window = 0
        self._window_of_one = False
        self._exact_windows = False  # the strategy divides each window by its own element count
        self._small_sq: Union[float, None] = None
        self._micro_samples = 0
        self._saved_lrs: list[tuple[dict[str, Any], float, float]] = []

    # ------------------------------------------------------------------------------------- readable

    @property
    def accumulate_grad_batches(self) -> int:
        return self.k

    @property
    def noise_scale(self) -> Union[float, None]:
        return self.noise.value

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks (known once a batch was seen)."""
        return self.k * self._micro_samples

    # -------------------------------------------------------------------------------------- hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _refuse_engine_accumulation(trainer.strategy)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _refuse_engine_accumulation(trainer.strategy)  # also when added after set-up (configure_model)
        if self.scale != 1 and not all((k * self.scale).denominator == 1 for k in self._ks()):
            raise ValueError(
                f"AccumulationScheduler: the checkpoint's run multiplied K by {self.scale} (a resume on another number"
                f" of data-parallel replicas), and this schedule's K values {sorted(self._ks())} are not all whole"
                " numbers under it; keep the schedule the run started with, or resume on the replicas it was written"
                " for."
            )
        trainer.accumulate_grad_batches = self.k
        strategy = trainer.strategy
        self._exact_windows = isinstance(strategy, ExactWindowMeans) and strategy.exact_window_means()
        if self._exact_windows and self.unit == "adaptive":
            raise ValueError(
                "AccumulationScheduler(unit='adaptive') estimates the gradient noise scale from equally weighted"
                " micro-batches; the module's pipeline_loss_count weighs them by their counts. Schedule by"
                " 'step', 'epoch' or 'samples' (a ramp), or drop pipeline_loss_count."
            )

    def _position(self, trainer: pl.Trainer) -> float:
        if self.unit == "epoch":
            return trainer.current_epoch
        if self.unit == "samples":
            return self.samples
        return trainer.global_step

    def _wanted(self, trainer: pl.Trainer) -> int:
        if self.unit != "adaptive":
            return int(lookup(self.schedule, self._position(trainer)) * self.scale)
        b_simple = self.noise.value
        if b_simple is None or trainer.global_step - self.last_adapt_step < self.adapt_every or not self._micro_samples:
            return self.k
        # a power of two in the first world's units (a resume on other replicas multiplies them by ``scale``)
        unscaled = 2 ** round(math.log2(max(self.noise_fraction * b_simple / (self._micro_samples * self.scale), 1.0)))
        k = Fraction(self.k) / self.scale
        target = min(max(unscaled, self.min_k, k // 2), self.max_k, k * 2)  # at most x2 per change
        return int(target * self.scale)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % self.k == 0:  # a window starts here
            wanted = self._wanted(trainer)
            if wanted != self.k and can_switch(batch_idx, self.k, wanted):
                self.k = wanted
                trainer.accumulate_grad_batches = wanted
                self.last_adapt_step = trainer.global_step
        self._in_window = batch_idx % self.k + 1
        # a window of one batch (the epoch's last, cut short): its first micro-batch is its whole batch
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or batch_idx + 1 == trainer.num_training_batches
        self._window_of_one = last and self._in_window == 1
        self._micro_samples = _batch_size(batch) * data_replicas(trainer)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # during accumulation DDP does not synchronise: after the window's first backward the gradient is
        # this rank's first micro-batch gradient divided by K (the noise scale's small batch)
        # (not in a window of one batch: its backward closes the window, and strategies reduce during it)
        if self.unit == "adaptive" and self._in_window == 1 and self.k > 1 and not self._window_of_one:
            self._small_sq = _sq_norm(_current_gradients(trainer, pl_module)) * self.k**2

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if 0 < self._in_window < self.k and not self._exact_windows:
            # the epoch's partial last window: Lightning divided by K, the window has r < K batches (a strategy
            # that already divides by the window's own element count needs nothing)
            for p in params:
                p.grad.mul_(self.k / self._in_window)
        if self.unit == "adaptive" and self._small_sq is not None:
            replicas, copies, reduced = data_replicas(trainer), *_gradient_layout(trainer)
            # the optimizer's gradients: full on every replica (copies = replicas) or disjoint shards (1)
            big_local = _sq_norm(_step_gradients(trainer, optimizer, params)) / copies
            # one 2-scalar all-reduce: the small-batch norms and the big-batch norm, each over all ranks
            small_sum, big_sum = agree([self._small_sq, big_local], op="sum", device=trainer.strategy.root_device)
            if reduced:  # the first micro-batch's gradient was already averaged over replicas (sharded)
                small_sq, b_small = small_sum, self._micro_samples
            else:  # each replica measured its own micro-batch: average the replicas' norms
                small_sq, b_small = small_sum / replicas, self._micro_samples / replicas
            self.noise.update(small_sq, big_sum, b_small, self._micro_samples * self.k)
            self._small_sq = None
        factor = self._lr_factor()
        self._saved_lrs = []
        if factor != 1.0:
            for group in optimizer.param_groups:
                self._saved_lrs.append((group, group["lr"], group["lr"] * factor))
                group["lr"] = group["lr"] * factor

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.samples += self._micro_samples
        for group, base, scaled in self._saved_lrs:
            if group["lr"] == scaled:  # a scheduler that set a new LR from its base values wins
                group["lr"] = base
        self._saved_lrs = []
        if trainer.loggers and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            metrics = {
                "accumulate_grad_batches": float(self.k),
                "effective_batch_size": float(self.effective_batch_size),
            }
            if self.noise.value is not None:
                metrics["noise_scale"] = self.noise.value
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _lr_factor(self) -> float:
        ratio = self.k / (self.k0 * self.scale)
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]

    # ---------------------------------------------------------------------- another number of replicas

    def _ks(self) -> set[int]:
        """Every K the schedule may choose, before the scale (K = 1 before a schedule's first key)."""
        if self.unit == "adaptive":
            return {self.min_k, self.max_k}
        return set(self.schedule.values()) | ({1} if min(self.schedule) > 0 else set())

    def can_rescale_accumulation(self, factor: Fraction) -> bool:
        """Whether K now and every K the schedule may choose stay whole numbers when multiplied by ``factor``."""
        scale = self.scale * factor
        # adaptive: the noise scale is measured from windows of at least two micro-batches
        smallest = 2 if self.unit == "adaptive" else 1
        whole = all((k * scale).denominator == 1 and k * scale >= smallest for k in self._ks())
        return (self.k * factor).denominator == 1 and whole

    def rescale_accumulation(self, factor: Fraction) -> int:
        """A resume on another number of data-parallel replicas keeps the global batch: K and the schedule's
        values are multiplied by ``factor`` (the schedule stays keyed by its unit, samples counted globally)."""
        if not self.can_rescale_accumulation(factor):
            raise ValueError(f"AccumulationScheduler: K={self.k} and the schedule cannot be multiplied by {factor}.")
        self.scale *= factor
        self.k = int(self.k * factor)
        return self.k

    def rewind_samples(self, samples: int) -> None:
        """A resume takes ``samples`` (global) again, from the start of a window the checkpoint was written
        inside: the samples seen go back by as many, so a schedule keyed by samples continues where it was."""
        self.samples = max(0, self.samples - samples)

    # -------------------------------------------------------------------------------------- state

    def leaves_model_gradients_alone(self) -> bool:  # its hooks read the optimizer's groups and the strategy's
        return True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "k0": self.k0,
            "samples": self.samples,
            "scale": [self.scale.numerator, self.scale.denominator],
            "last_adapt_step": self.last_adapt_step,
            "noise": self.noise.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.k, self.k0 = int(state_dict["k"]), int(state_dict["k0"])
        self.samples = int(state_dict["samples"])
        self.scale = Fraction(*state_dict.get("scale", (1, 1)))
        self.last_adapt_step = int(state_dict["last_adapt_step"])
        self.noise.load_state_dict(state_dict["noise"])


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return int(first.shape[0]) if isinstance(first, Tensor) else 1


def _gradient_layout(trainer: pl.Trainer) -> tuple[int, bool]:
    """How many ranks hold each gradient element the optimizer steps with, and whether every backward
    already averaged the gradients over the data-parallel replicas (ZeRO-3 / FSDP reduce-scatter each time).

    DDP replicates the gradients and synchronises only when a window closes; FSDP (Lightning's
    ``FSDPStrategy`` and ``ModelParallelStrategy``) reduce-scatters after every backward; the pack's
    strategies say it themselves.
    """
    strategy = trainer.strategy
    if isinstance(strategy, ReportsGradientLayout):
        return strategy.gradient_layout()
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        return 1, True
    return data_replicas(trainer), False


def _sq_norm(grads: Iterable[Tensor]) -> float:
    total = 0.0
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # a DTensor's own shard
        total += float(local.detach().float().pow(2).sum())
    return total


def _current_gradients(trainer: pl.Trainer, module: pl.LightningModule) -> list[Tensor]:
    """This rank's part of the gradient accumulated so far in the window."""
    strategy = trainer.strategy
    if isinstance(strategy, ReportsGradientLayout):
        return strategy.current_gradients(module)  # e.g. ZeRO-2 has handed the model's gradients off already
    return [p.grad for p in module.parameters() if p.grad is not None]


def _step_gradients(trainer: pl.Trainer, optimizer: Optimizer, params: list[Tensor]) -> list[Tensor]:
    """This rank's part of the gradients the optimizer steps with (a strategy that reports its layout says
    which: under tensor parallelism a gradient every tensor-parallel rank holds counts on one)."""
    strategy = trainer.strategy
    if isinstance(strategy, ReportsGradientLayout):
        return strategy.step_gradients(optimizer)
    return [p.grad for p in params]


def _refuse_engine_accumulation(strategy: Any) -> None:
    """An engine that accumulates inside ``training_step`` fixes its accumulation when it is built."""
    if isinstance(strategy, StepsInsideTrainingStep):
        raise ValueError(
            f"AccumulationScheduler cannot change {strategy.engine_name()}'s accumulation, which is fixed at engine"
            f" set-up ({strategy.engine_micro_batches()} micro-batches per step); raise num_microbatches or the"
            " batch size, or use HybridParallelStrategy for accumulation schedules."
        )
