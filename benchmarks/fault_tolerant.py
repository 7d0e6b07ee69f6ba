"""FaultTolerantCheckpoint side by side: save stall sync vs async, size, write throughput vs the disk, relaunch.

    python benchmarks/fault_tolerant.py                        # 2 CPU processes (gloo)
    python benchmarks/fault_tolerant.py --d-model 512 --every 5 --out benchmarks/results

For the example GPT under DDP (one full checkpoint written by rank 0) and under HybridParallelStrategy
with ZeRO-1 (sharded DCP, every rank writes its part), each a separate ``torchrun`` job of this file:

- stall per checkpoint: (duration of a step that saves - median step) / median step, sync and async;
- checkpoint size and the synchronous save's end-to-end throughput (state dump, serialisation, fsync,
  SHA-256) against the disk's own sequential write speed, measured here with the same number of bytes;
- time from launch to the first training step, for a fresh start and for a relaunch that resumes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import build_example, publish, run_job  # noqa: E402

# ------------------------------------------------------------------------------------------------ worker


def worker(cfg: dict[str, Any]) -> None:
    import lightning as L

    from lightning_hybrid.callbacks import FaultTolerantCheckpoint

    model, data, strategy = build_example(cfg)
    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts.append(time.time())

        def on_train_end(self, trainer, pl_module):
            starts.append(time.time())

    ft = FaultTolerantCheckpoint(
        dirpath=cfg["dirpath"], every_n_train_steps=cfg["every"], async_save=cfg["async_save"], keep_last=2
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=cfg["devices"], strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[Clock(), ft],
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    first = trainer.global_step - (len(starts) - 1)  # the step number of the first batch of this run
    saved_at = [s for s in range(first + 1, trainer.global_step) if s % cfg["every"] == 0]
    if trainer.global_rank == 0:
        step_dir = Path(ft.last_model_path)
        step_dir = step_dir if step_dir.is_dir() else step_dir.parent
        manifest = json.loads((step_dir / "manifest.json").read_text())
        report = {
            "launched": float(os.environ["BENCH_LAUNCHED"]),
            "starts": starts,
            "first_step": first,
            "saved_at": saved_at,
            "bytes": sum(f["bytes"] for f in manifest["files"].values()),
        }
        (Path(cfg["out"]) / "rank0.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver


def disk_write_speed(directory: Path, nbytes: int) -> float:
    """Bytes per second of one sequential write of ``nbytes`` (incompressible) plus fsync, in ``directory``."""
    payload = memoryview(os.urandom(nbytes))  # prepared before the clock starts
    path = directory / f"disk-speed-{time.monotonic_ns()}.bin"  # a new file each time, as a checkpoint is
    start = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, 8 << 20):
            f.write(payload[offset : offset + (8 << 20)])
        f.flush()
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - start)


def analyse(report: dict[str, Any]) -> dict[str, float]:
    starts = report["starts"]
    first = report["first_step"]
    durations = {first + i + 1: b - a for i, (a, b) in enumerate(itertools.pairwise(starts))}
    saving = set(report["saved_at"])
    # the first two steps carry one-off start-up costs; the last one carries the final synchronous save
    plain = [d for s, d in durations.items() if s not in saving and s > first + 2 and s < max(durations)]
    step = statistics.median(plain) if plain else float("nan")
    stalls = [durations[s] - step for s in saving if s in durations]
    return {
        "step_s": step,
        "stall_s": statistics.median(stalls) if stalls else float("nan"),
        "to_first_step_s": starts[0] - report["launched"],
        "bytes": report["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return

    jobs = args.out / "jobs" / "fault_tolerant"
    scratch = Path(tempfile.mkdtemp(prefix="lh-ft-bench-", dir=jobs.parent if jobs.parent.exists() else None))
    base = {
        "block_size": 128, "batch_size": 8, "n_layer": args.n_layer, "d_model": args.d_model,
        "steps": args.steps, "every": args.every,
    }  # fmt: skip
    layouts = {"DDP (rank 0 writes)": "ddp", "hybrid ZeRO-1 (DCP)": {"zero_stage": 1}}
    rows = []
    for label, strategy in layouts.items():
        results = {}
        for mode in ("sync", "async"):
            cfg = {**base, "strategy": strategy, "async_save": mode == "async", "dirpath": str(scratch / label / mode)}
            os.environ["BENCH_LAUNCHED"] = repr(time.time())
            (report,) = run_job(__file__, cfg, 2, jobs / f"{strategy if strategy == 'ddp' else 'hybrid'}-{mode}")
            results[mode] = analyse(report)
        # relaunch the sync run's job for a few more steps: it resumes from its last checkpoint
        cfg = {**base, "strategy": strategy, "async_save": False, "dirpath": str(scratch / label / "sync")}
        cfg["steps"] = args.steps + 4
        os.environ["BENCH_LAUNCHED"] = repr(time.time())
        (report,) = run_job(__file__, cfg, 2, jobs / f"{strategy if strategy == 'ddp' else 'hybrid'}-resume")
        results["resume"] = analyse(report)
        # the disk's speed for new files: the median of three (kept until all three are written)
        disk = statistics.median(disk_write_speed(scratch, results["sync"]["bytes"]) for _ in range(3))
        for leftover in scratch.glob("disk-speed-*.bin"):
            leftover.unlink()
        rows.append((label, results, disk))

    lines = [
        f"FaultTolerantCheckpoint on 2 CPU processes, GPT d_model={args.d_model} n_layer={args.n_layer}, AdamW,"
        f" a checkpoint every {args.every} steps (medians; ratios measured side by side in this run)",
        "",
        f"{'layout':<22} {'ckpt MB':>8} {'step s':>7} {'sync stall/step':>16} {'async stall/step':>17}"
        f" {'async/sync stall':>17} {'save MB/s':>10} {'disk MB/s':>10} {'save/disk':>10}"
        f" {'fresh->step1 s':>15} {'resume->step1 s':>16} {'resume/fresh':>13}",
    ]
    for label, r, disk in rows:
        sync, asy, resume = r["sync"], r["async"], r["resume"]
        mb = sync["bytes"] / 1e6
        save_speed = sync["bytes"] / max(sync["stall_s"], 1e-9)
        lines.append(
            f"{label:<22} {mb:>8.1f} {sync['step_s']:>7.3f} {sync['stall_s'] / sync['step_s']:>16.2f}"
            f" {asy['stall_s'] / asy['step_s']:>17.2f} {asy['stall_s'] / max(sync['stall_s'], 1e-9):>17.2f}"
            f" {save_speed / 1e6:>10.0f} {disk / 1e6:>10.0f} {save_speed / disk:>10.2f}"
            f" {sync['to_first_step_s']:>15.1f} {resume['to_first_step_s']:>16.1f}"
            f" {resume['to_first_step_s'] / sync['to_first_step_s']:>13.2f}"
        )
    lines += [
        "",
        "stall = (a saving step - the median step); save MB/s = checkpoint bytes / synchronous stall (state dump,",
        "serialisation, fsync and SHA-256 included); disk MB/s = median of 3 new-file writes + fsync of as many bytes.",
        "Targets: async stall <= 0.10 x sync stall; save throughput >= 0.80 x disk.",
    ]
    publish(lines, args.out, "fault_tolerant_cpu.txt")


if __name__ == "__main__":
    main()
