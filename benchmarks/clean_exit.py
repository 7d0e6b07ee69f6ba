"""A finished job exits 0: back-to-back 2-rank runs, their exit codes counted.

    python benchmarks/clean_exit.py [--runs 30] [--switch-interval 0.5]

Two kinds of job, each launched ``--runs`` times in a row under ``torchrun`` on two CPU processes (gloo):

- the pack: a small model trained to the end of ``fit`` with ``HybridParallelStrategy(zero_stage=2)``, many
  small gradient buckets and fp16 with ``AdaptiveLossScalingPrecision`` (the configuration that aborted most);
- the minimal reproduction of the torch bug, without Lightning or the pack: a few asynchronous gloo
  all-reduces on views dropped at once and an all-gather into a fresh list, then the interpreter exits;
  run as it is (the bug) and with the pack's exit wait installed (the fix).

A gloo worker thread that drops a finished collective after the main thread entered ``Py_FinalizeEx`` takes
the GIL during finalisation and CPython ends it with ``pthread_exit``; through a noexcept destructor that is
``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun reports the job
failed (pytorch/pytorch#38228; see ``lightning_hybrid._torch_compat.wait_for_gloo_at_exit``). The race is
timing-dependent: ``--switch-interval`` (``sys.setswitchinterval`` in the workers) widens it without
changing it, so the fix can be seen working where the bug shows reliably.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _jobs import publish  # noqa: E402


def repro_worker(fix: bool) -> None:
    """The bug without the pack (plain torch + gloo)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if fix:
        from lightning_hybrid._torch_compat import wait_for_gloo_at_exit

        wait_for_gloo_at_exit()
    flat = torch.ones(1 << 14)
    n = flat.numel() // 16
    for _ in range(5):
        works = [dist.all_reduce(flat[i * n : (i + 1) * n], async_op=True) for i in range(16)]
        for w in works:
            w.wait()
        del works
        dist.all_gather([torch.empty(n) for _ in range(dist.get_world_size())], flat[:n])


def pack_worker() -> None:
    """A run of the pack to the end of fit: ZeRO-2 with many small buckets, fp16, the agreed loss scaler."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid.plugins import AdaptiveLossScalingPrecision
    from lightning_hybrid.strategies import HybridParallelStrategy, ZeroConfig

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=8)

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        strategy=HybridParallelStrategy(zero_stage=2, zero=ZeroConfig(bucket_size_mb=0.01)),
        plugins=[AdaptiveLossScalingPrecision(precision="16-mixed")],
    )  # fmt: skip
    trainer.fit(Tiny())


def launch(kind: str, switch: float | None) -> tuple[int, bool]:
    """One 2-rank job: (torchrun's exit code, whether a rank printed the abort)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           __file__, "--worker", kind] + ([f"--switch-interval={switch}"] if switch else [])  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return -9, False
    aborted = "terminate called without an active exception" in proc.stdout + proc.stderr
    return proc.returncode, aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--switch-interval", type=float, default=None)
    parser.add_argument("--worker", choices=["pack", "repro", "repro-fixed"], default=None)
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.worker == "pack":
        return pack_worker()
    if args.worker:
        return repro_worker(fix=args.worker == "repro-fixed")

    rows = []
    wide = args.switch_interval or 0.5
    # the pack as users run it; the bare bug and its fix where the race is widened enough to show reliably
    for kind, switch in (("pack", None), ("repro", wide), ("repro-fixed", wide)):
        codes, aborts, start = [], 0, time.monotonic()
        for _ in range(args.runs):
            code, aborted = launch(kind, switch)
            codes.append(code)
            aborts += aborted
        rows.append((kind, switch, codes, aborts, time.monotonic() - start))
        print(f"{kind} (switch interval {switch or 'default'}): exit codes {codes}", flush=True)
    lines = [
        f"# clean exit: {args.runs} back-to-back 2-rank jobs per row (torchrun, gloo, CPU)",
        "",
        "| job | switch interval | exit 0 | aborted (SIGABRT) | other | s per job |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "pack": "pack: HybridParallelStrategy ZeRO-2, 0.01 MB buckets, fp16 + AdaptiveLossScalingPrecision",
        "repro": "torch + gloo only (the bug, nothing installed)",
        "repro-fixed": "torch + gloo + the pack's exit wait",
    }
    for kind, switch, codes, aborts, seconds in rows:
        zero = sum(c == 0 for c in codes)
        lines.append(
            f"| {names[kind]} | {switch or 'default (0.005)'} | {zero} / {len(codes)} | {aborts} | "
            f"{len(codes) - zero - aborts} | {seconds / len(codes):.1f} |"
        )
    publish(lines, ROOT / "benchmarks" / "results", "clean_exit_cpu.txt")
    if any(c != 0 for kind, _, codes, _, _ in rows if kind != "repro" for c in codes):
        sys.exit(1)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
