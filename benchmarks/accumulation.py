"""AccumulationScheduler side by side: samples and wall time to reach a target validation loss.

    python benchmarks/accumulation.py                    # one CPU process
    python benchmarks/accumulation.py --target 2.6 --out benchmarks/results

The example GPT trained with a fixed small batch (K=1), a fixed large batch (K=8), a linear ramp of K
from 1 to 8, and the adaptive schedule (K from the measured gradient noise scale), all with the same
micro-batch, optimizer and LR. Validation runs every ``--val-every`` micro-batches (the same number of
samples for every run); each run stops at the first validation at or below the target.
"""

from __future__ import annotations

import argparse
import math
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

from lightning_hybrid.callbacks import AccumulationScheduler, Ramp  # noqa: E402


class StopAtTarget(L.Callback):
    def __init__(self, target: float) -> None:
        self.target = target
        self.samples = 0
        self.reached: tuple[int, float] | None = None
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.samples += batch[0].shape[0]

    def on_validation_end(self, trainer, pl_module):
        loss = float(trainer.callback_metrics.get("val_loss", math.inf))
        if self.reached is None and loss <= self.target:
            self.reached = (self.samples, time.perf_counter() - self.start)
            trainer.should_stop = True


def run(scheduler: Any, args: argparse.Namespace) -> StopAtTarget:
    L.seed_everything(0, verbose=False)
    data = CharDataModule(block_size=32, batch_size=args.micro_batch, stride=4)
    model = GPT(vocab_size=data.vocab_size, block_size=32, n_layer=2, d_model=64, n_head=4, lr=args.lr)
    probe = StopAtTarget(args.target)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=-1, max_epochs=args.max_epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=args.val_every, check_val_every_n_epoch=None, limit_val_batches=8,
        num_sanity_val_steps=0, callbacks=[probe, *([scheduler] if scheduler is not None else [])],
        accumulate_grad_batches=1,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=2.45)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-every", type=int, default=32)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configs = {
        "fixed small batch (K=1)": lambda: None,
        "fixed large batch (K=8)": lambda: AccumulationScheduler(schedule={0: 8}),
        "linear ramp K 1 -> 8 over 20k samples": lambda: AccumulationScheduler(
            ramp=Ramp(start=1, end=8, length=20_000, increments="linear"), unit="samples"
        ),
        "adaptive (noise scale, K in [2, 8])": lambda: AccumulationScheduler(unit="adaptive", min_k=2, max_k=8),
    }
    results = {name: run(make(), args) for name, make in configs.items()}
    base = results["fixed small batch (K=1)"].reached
    lines = [
        f"example GPT (1 CPU process), micro-batch {args.micro_batch}, AdamW lr {args.lr}: samples and wall time"
        f" to reach val_loss <= {args.target} (validation every {args.val_every} micro-batches)",
        "",
        f"{'schedule':<40} {'samples':>9} {'vs K=1':>8} {'wall s':>8} {'vs K=1':>8}",
    ]
    for name, probe in results.items():
        if probe.reached is None:
            lines.append(f"{name:<40} {'not reached in ' + str(args.max_epochs) + ' epochs':>36}")
            continue
        samples, wall = probe.reached
        rel_s = f"{samples / base[0]:.2f}" if base else "-"
        rel_t = f"{wall / base[1]:.2f}" if base else "-"
        lines.append(f"{name:<40} {samples:>9} {rel_s:>8} {wall:>8.1f} {rel_t:>8}")
    lines += ["", "Target: the adaptive schedule reaches the target in fewer samples than the best fixed batch."]
    publish(lines, args.out, "accumulation_cpu.txt")


if __name__ == "__main__":
    main()
