"""AdaptiveLossScalingPrecision side by side: skipped steps, fp16 underflow, final loss, overhead.

    python benchmarks/loss_scaling.py                 # one CPU process, fp16 autocast
    python benchmarks/loss_scaling.py --steps 600 --out benchmarks/results

The same fp16 run of the example GPT under each policy, with gradient magnitudes that drift over
training: the loss is multiplied by a weight that rises from 2**-12 to 2**6 and falls back (as when a
loss term is ramped in, or the LR schedule changes the gradient scale). Per policy it prints the skipped
steps, the fraction of gradient elements that would underflow to zero in fp16 (``|grad * scale| <
2**-24``, measured on the scaled gradients after each backward), the final unweighted loss, and the
per-step time against Lightning's ``MixedPrecision("16-mixed")`` on the same run without drift.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish  # noqa: E402
from gpt import GPT, CharDataModule  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lightning_hybrid.plugins import AdaptiveLossScalingPrecision, LossScaleConfig  # noqa: E402

TINY = 2.0**-24  # the smallest fp16 subnormal


class DriftingGPT(GPT):
    """The example model whose loss weight drifts over training (the reported loss is unweighted)."""

    def __init__(self, *, drift_steps: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drift_steps = drift_steps

    def loss_weight(self) -> float:
        t = min(self.global_step / max(self.drift_steps, 1), 1.0)
        exponent = -12 + 18 * math.sin(math.pi * t)  # 2**-12 -> 2**6 -> 2**-12
        return 2.0**exponent

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = self.pipeline_loss(self(inputs), target)
        self.log("train_loss", loss)
        return loss * self.loss_weight() if self.drift_steps else loss


class Probe(L.Callback):
    def __init__(self) -> None:
        self.underflow: list[float] = []
        self.times: list[float] = []
        self.scales: list[float] = []
        self.loss = math.nan

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_after_backward(self, trainer, pl_module):
        # the gradients are still scaled here: count what fp16 could not have represented
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        tiny = sum(int((g.abs() < TINY).sum()) for g in grads)
        self.underflow.append(tiny / sum(g.numel() for g in grads))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self.t0)
        self.loss = float(trainer.callback_metrics["train_loss"])
        plugin = trainer.precision_plugin
        self.scales.append(plugin.loss_scale if hasattr(plugin, "loss_scale") else plugin.scaler.get_scale())

    def skipped(self, plugin: Any) -> int:
        if hasattr(plugin, "skipped_steps"):
            return plugin.skipped_steps
        # GradScaler does not count: it skips exactly the steps after which it backs off
        return sum(1 for a, b in zip(self.scales, self.scales[1:]) if b < a)


def run(plugin: Any, steps: int, drift: bool) -> tuple[Probe, Any]:
    L.seed_everything(0, verbose=False)
    data = CharDataModule(block_size=32, batch_size=16, stride=8)
    model = DriftingGPT(
        vocab_size=data.vocab_size, block_size=32, n_layer=2, d_model=64, n_head=4, lr=1e-3,
        drift_steps=steps if drift else 0,
    )  # fmt: skip
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        plugins=[plugin], callbacks=[probe],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return probe, plugin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--growth-interval", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gi = args.growth_interval

    def grad_scaler() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=gi))

    policies = {
        "GradScaler (Lightning MixedPrecision)": grad_scaler,
        "dynamic": lambda: AdaptiveLossScalingPrecision(policy="dynamic", config=LossScaleConfig(growth_interval=gi)),
        "hysteresis": lambda: AdaptiveLossScalingPrecision(
            policy="hysteresis", config=LossScaleConfig(growth_interval=gi)
        ),
        "adaptive": lambda: AdaptiveLossScalingPrecision(policy="adaptive"),
    }
    rows = []
    for name, make in policies.items():
        probe, plugin = run(make(), args.steps, drift=True)
        rows.append((name, probe, probe.skipped(plugin)))

    # overhead: no drift, no overflow; alternate the two plugins and take medians of the steady steps
    overhead = {"MixedPrecision": [], "AdaptiveLossScalingPrecision": []}
    for _ in range(3):
        for key, make in (("MixedPrecision", grad_scaler), ("AdaptiveLossScalingPrecision", policies["adaptive"])):
            probe, _ = run(make(), 60, drift=False)
            overhead[key].append(statistics.median(probe.times[10:]))
    ratio = statistics.median(overhead["AdaptiveLossScalingPrecision"]) / statistics.median(overhead["MixedPrecision"])

    header = (
        f"fp16 example GPT (1 CPU process), {args.steps} steps, loss weight drifting 2**-12 -> 2**6 -> 2**-12;"
        f" growth_interval={gi} for GradScaler / dynamic / hysteresis"
    )
    lines = [
        header,
        "",
        f"{'policy':<40} {'skipped':>8} {'vs GradScaler':>14} {'underflow':>10} {'vs GradScaler':>14}"
        f" {'final loss':>11}",
    ]
    base_skipped, base_underflow = rows[0][2], statistics.mean(rows[0][1].underflow)
    for name, probe, skipped in rows:
        underflow = statistics.mean(probe.underflow)
        lines.append(
            f"{name:<40} {skipped:>8} {skipped / max(base_skipped, 1):>14.2f} {underflow:>10.4f}"
            f" {underflow / base_underflow:>14.2f} {probe.loss:>11.4f}"
        )
    lines += [
        "",
        "per-step time, AdaptiveLossScalingPrecision / MixedPrecision('16-mixed') (no drift, medians of 3):"
        f" {ratio:.3f}",
        "Targets: adaptive skips at most half of GradScaler's steps with no more underflow; overhead <= 1.02.",
    ]
    publish(lines, args.out, "loss_scaling_cpu.txt")


if __name__ == "__main__":
    main()
