"""HybridParallelStrategy side by side: ZeRO memory and step time vs DDP, pipeline bubbles per schedule.

    python benchmarks/hybrid_parallel.py                 # CPU processes (gloo); all GPUs (NCCL) if >= 2
    python benchmarks/hybrid_parallel.py --steps 12 --out benchmarks/results

Prints two tables of ratios measured in this run and draws the measured per-rank timeline of one 1F1B
step (forward / backward / weight-gradient / idle per micro-batch) to ``<out>/timeline_<schedule>.png``.
Each configuration is a separate ``torchrun`` job of this same file (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Union

from lightning_hybrid.strategies._layout import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import build_example, run_job  # noqa: E402

# ------------------------------------------------------------------------------------------------ worker


def _local_bytes(tensors) -> int:
    """Bytes of distinct storages (views of one flat buffer count once; DTensors count their shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def worker(cfg: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_hybrid.strategies import HybridParallelStrategy

    model, data, strategy = build_example(cfg)
    psi = sum(p.numel() for p in model.parameters())
    times: list[float] = []
    memory: dict[str, int] = {}
    timeline: list[tuple[str, int, float, float]] = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            timeline.clear()
            self.t0 = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters()]
            grads += [p.grad for g in optimizer.param_groups for p in g["params"]]
            memory["grads"] = _local_bytes(grads)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            self.timeline = list(timeline)
            opt = trainer.optimizers[0]
            memory["params"] = _local_bytes(list(pl_module.parameters()))
            memory["optim"] = _local_bytes(
                [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            )

    probe = Probe()
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator, devices=cfg["devices"], strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[probe],
    )  # fmt: skip

    if isinstance(strategy, HybridParallelStrategy) and cfg["strategy"].get("pipeline_parallel_size", 1) > 1:
        # wrap this rank's stages' compute calls to record when each forward / backward ran (benchmark only)
        def timed(kind, fn):
            def wrapper(chunk_id, *args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(chunk_id, *args, **kwargs)
                finally:
                    timeline.append((kind, chunk_id, start, time.perf_counter()))

            return wrapper

        class Instrument(L.Callback):
            def on_fit_start(self, trainer, pl_module):
                for st in trainer.strategy.pipeline_runner.stages:
                    st.forward_one_chunk = timed("F", st.forward_one_chunk)
                    st.backward_one_chunk = timed("B", st.backward_one_chunk)
                    st.backward_weight_one_chunk = timed("W", st.backward_weight_one_chunk)

        trainer.callbacks.append(Instrument())

    trainer.fit(model, train_dataloaders=DataLoader(data.train_set, batch_size=cfg["batch_size"], drop_last=True))
    warm = times[cfg["warmup"] :]
    step_time = statistics.median(warm)
    last = probe.timeline
    t_start = min((t[2] for t in last), default=0.0)
    busy = sum(t[3] - t[2] for t in last)
    span = (max(t[3] for t in last) - t_start) if last else 0.0
    report = {
        "rank": trainer.global_rank, "psi": psi, "step_time": step_time, "memory": memory, "busy": busy,
        "span": span, "timeline": [(k, c, s - t_start, e - t_start) for k, c, s, e in last],
    }  # fmt: skip
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver


def zero_formula(stage: Union[int, str], n: int) -> float:
    """Per-rank bytes per parameter of params + grads + Adam state in fp32 (ZeRO paper, K=8 for Adam)."""
    return {"ddp": 16.0, 0: 16.0, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def draw_timeline(reports: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.7 * len(reports)))
    end = max((e for r in reports for _, _, _, e in r["timeline"]), default=1.0)
    for r in reports:
        y = len(reports) - 1 - r["rank"]
        ax.broken_barh([(0, end * 1e3)], (y - 0.4, 0.8), facecolors="#dddddd")  # idle
        for kind, chunk, s, e in r["timeline"]:
            ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (y - 0.4, 0.8), facecolors=colors[kind], edgecolor="white")
            ax.text((s + e) / 2 * 1e3, y, f"{kind}{chunk}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, end * 1e3)
    ax.set_yticks(range(len(reports)), [f"rank {len(reports) - 1 - i}" for i in range(len(reports))])
    ax.set_xlabel("ms since the first compute of the step (grey: idle)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(
        handles, ["forward", "backward (input grad, or full)", "backward (weight grad)"], loc="upper right", fontsize=8
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return

    import torch

    ngpu = torch.cuda.device_count()
    nproc = ngpu if ngpu >= 2 else 2
    base = {
        "steps": args.steps,
        "warmup": args.warmup,
        "block_size": 64,
        "batch_size": 16,
        "n_layer": 6,
        "d_model": 128,
    }
    tmp = args.out / "jobs"
    print(f"# HybridParallelStrategy benchmark: {nproc} {'GPU' if ngpu >= 2 else 'CPU'} processes")

    # --- 1. ZeRO stages vs DDP (one pipeline stage, all ranks data-parallel)
    rows = []
    ddp = run_job(__file__, {**base, "strategy": "ddp"}, nproc, tmp / "ddp")
    for name, strat in [("ddp", "ddp")] + [(f"zero_stage={z}", {"zero_stage": z}) for z in range(4)]:
        reps = (
            ddp
            if strat == "ddp"
            else run_job(__file__, {**base, "strategy": strat}, nproc, tmp / name.replace("=", ""))
        )
        psi = reps[0]["psi"]
        per_rank = max(sum(r["memory"].values()) for r in reps) / psi
        formula = zero_formula("ddp" if strat == "ddp" else strat["zero_stage"], nproc)
        rel_time = statistics.median(r["step_time"] for r in reps) / statistics.median(r["step_time"] for r in ddp)
        rows.append((name, per_rank, formula, per_rank / formula, rel_time))
    print(
        f"\n## Per-rank bytes held in params + grads + AdamW state at the end of backward (fp32, N={nproc}),"
        " step time vs Lightning DDP\n(a count of what is stored by design, not the peak: benchmarks/memory.py"
        " measures the peak a rank reaches)"
    )
    print(f"| {'layout':<14} | bytes/param measured | ZeRO formula | measured/formula | step time / DDP |")
    print("|" + "-" * 16 + "|" + "-" * 22 + "|" + "-" * 14 + "|" + "-" * 18 + "|" + "-" * 17 + "|")
    for name, measured, formula, ratio, rel in rows:
        print(f"| {name:<14} | {measured:20.2f} | {formula:12.2f} | {ratio:16.3f} | {rel:15.2f} |")

    # --- 2. pipeline schedules (all ranks pipeline stages)
    p, m = nproc, args.microbatches
    print(f"\n## Pipeline schedules: p={p} ranks, m={m} micro-batches; bubble = idle share of one step's compute span")
    print(f"| {'schedule':<24} | step time / 1f1b | measured bubble | theory (p-1)/(m+p-1) |")
    print("|" + "-" * 26 + "|" + "-" * 18 + "|" + "-" * 17 + "|" + "-" * 22 + "|")
    results = {}
    for schedule in SCHEDULES:
        strat = {"pipeline_parallel_size": p, "schedule": schedule, "num_microbatches": m}
        reps = run_job(__file__, {**base, "strategy": strat}, nproc, tmp / schedule)
        results[schedule] = reps
    t1f1b = statistics.median(r["step_time"] for r in results["1f1b"])
    for schedule, reps in results.items():
        span = max(r["span"] for r in reps)
        bubble = statistics.mean(1 - r["busy"] / span for r in reps) if span else float("nan")
        theory = (p - 1) / (m + p - 1)
        v = 2 if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") else 1
        theory_s = (
            f"{theory:.3f}"
            if schedule in ("gpipe", "1f1b")
            else (f"{(p - 1) / (v * m + p - 1):.3f} (v={v})" if v > 1 else "-")
        )
        rel = statistics.median(r["step_time"] for r in reps) / t1f1b
        print(f"| {schedule:<24} | {rel:16.2f} | {bubble:15.3f} | {theory_s:>20} |")
    args.out.mkdir(parents=True, exist_ok=True)
    for schedule in ("1f1b", "zbv_zero_bubble"):
        path = args.out / f"timeline_{schedule}.png"
        draw_timeline(results[schedule], path, f"{schedule}: measured per-rank timeline of one step (p={p}, m={m})")
        print(f"\ntimeline of one {schedule} step: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    main()
