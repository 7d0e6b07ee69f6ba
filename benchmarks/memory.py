"""Per-rank PEAK memory of training steps, each layout in its own processes, against the ZeRO formula.

    python benchmarks/memory.py                       # 2 CPU processes, a 340 MB (fp32) GPT, AdamW
    python benchmarks/memory.py --d-model 512         # smaller and faster

Each layout trains on one sequence of 64 tokens per rank, so activations stay small next to the model
states the ZeRO formula counts; a separate table measures what each pipeline schedule keeps in flight.

What is measured is what decides whether a model fits: the high-water mark of each process's resident
memory while it trains (``VmHWM``), above the same process's resident memory before the model exists. On
CPU, glibc keeps freed chunks resident unless its mmap threshold is pinned, so every job runs with
``MALLOC_MMAP_THRESHOLD_=262144`` (freed tensors go back to the system and the high-water mark follows
live tensors). On GPU the same table would read ``torch.cuda.max_memory_allocated``.

Rows: Lightning's own DDP and ModelParallelStrategy (FSDP2) on the same model, and HybridParallelStrategy at
every ZeRO stage (ZeRO-2 with both gradient-reduction settings), and with tensor_parallel_size=2 (against the
formula on the parameters a rank holds). Also: the peak while materialising a
meta-built model at pp2, and while loading pretrained weights (``init_from``) at pp2, against the model
size. A PNG draws each rank's resident memory over one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job, sharded_gpt  # noqa: E402

MMAP_THRESHOLD = "262144"


# ------------------------------------------------------------------------------------------------ worker


def _status(field: str) -> int:
    """A field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


class _Sampler:
    """Resident memory every few milliseconds while a step runs (for the plot)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples, t0 = [], time.perf_counter()
        self._stop.clear()

        def run() -> None:
            while not self._stop.is_set():
                self.samples.append((time.perf_counter() - t0, _status("VmRSS")))
                time.sleep(0.002)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def worker(cfg: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    from lightning_hybrid.strategies import HybridParallelStrategy, ZeroConfig

    torch.manual_seed(0)
    data = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"], stride=64)
    loader = DataLoader(data.train_set, batch_size=cfg["batch_size"], drop_last=True)
    kind = cfg["kind"]
    baseline = _status("VmRSS")  # imports, data: everything but the model
    _reset_peak()
    model_kwargs = dict(
        vocab_size=data.vocab_size, block_size=cfg["block_size"], n_layer=cfg["n_layer"], d_model=cfg["d_model"],
        n_head=8, optimizer="adamw", dropout=0.0,
    )  # fmt: skip

    if kind.startswith("plain_"):
        _plain_loop(cfg, model_kwargs, loader, baseline)
        return
    held: list[Any] = []  # what a naive rank keeps while it loads
    if kind == "ddp":
        model, strategy = GPT(**model_kwargs), "ddp"
    elif kind == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        model = sharded_gpt()(**model_kwargs)
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        kwargs = dict(cfg["strategy"])
        if "zero" in kwargs:
            kwargs["zero"] = ZeroConfig(**kwargs["zero"])
        if kind == "init_from_whole":
            held.append(torch.load(kwargs["init_from"], weights_only=True))  # a rank that reads the whole file first
        model, strategy = GPT(**model_kwargs, build_on_meta=cfg.get("meta", False)), HybridParallelStrategy(**kwargs)
    shape_only = GPT(**model_kwargs, build_on_meta=True)
    shape_only.configure_model()  # on the meta device: counts parameters without allocating them
    psi = sum(p.numel() for p in shape_only.layers.parameters())
    sampler, steps, setup_peak, earlier_peak, last_start = _Sampler(), [], [], [], []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            setup_peak.append(_status("VmHWM") - baseline)  # building, materialising, loading: before step 0
            _reset_peak()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == cfg["steps"] - 1:
                # the last step, drawn; its rise above where it started is what it keeps in flight
                earlier_peak.append(_status("VmHWM") - baseline)
                last_start.append(_status("VmRSS"))
                _reset_peak()
                sampler.start()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(time.perf_counter() - self.t0)
            if batch_idx == cfg["steps"] - 1:
                sampler.stop()

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    report = {
        "rank": trainer.global_rank, "psi": psi, "setup_peak": setup_peak[0],
        "step_peak": max(_status("VmHWM") - baseline, *earlier_peak), "baseline": baseline,
        "last_step_rise": _status("VmHWM") - last_start[0],
        "step_time": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
        "samples": [(t, rss - baseline) for t, rss in sampler.samples],
    }  # fmt: skip
    report["peak"] = max(report["step_peak"], report["setup_peak"])
    # the parameters this rank holds (a tensor-parallel slice, a DTensor's local part): the formula's count
    report["held"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
    held.clear()


def _plain_loop(cfg: dict[str, Any], model_kwargs: dict[str, Any], loader: Any, baseline: int) -> None:
    """The floor: torch's DDP or FSDP2 in a plain loop, no Lightning (``zero_grad(set_to_none=True)`` before
    each forward, so the previous step's gradients are gone while activations build up)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = GPT(**model_kwargs)
    psi = sum(p.numel() for p in model.layers.parameters())
    if cfg["kind"] == "plain_fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        net: Any = fully_shard(model, mesh=mesh)
    else:
        net = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    setup_peak = _status("VmHWM") - baseline
    _reset_peak()
    sampler, steps, batches = _Sampler(), [], iter(loader)
    last_start = 0
    for step in range(cfg["steps"]):
        if step == cfg["steps"] - 1:
            last_start = _status("VmRSS")
            sampler.start()
        t0 = time.perf_counter()
        inputs, target = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = model.pipeline_loss(net(inputs), target)
        loss.backward()
        optimizer.step()
        steps.append(time.perf_counter() - t0)
    sampler.stop()
    report = {
        "rank": rank, "psi": psi, "setup_peak": setup_peak, "step_peak": _status("VmHWM") - baseline,
        "baseline": baseline, "last_step_rise": _status("VmHWM") - last_start,
        "step_time": statistics.median(steps[1:]), "samples": [(t, rss - baseline) for t, rss in sampler.samples],
    }  # fmt: skip
    report["peak"] = max(report["step_peak"], report["setup_peak"])
    # the parameters this rank holds (a tensor-parallel slice, a DTensor's local part): the formula's count
    report["held"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver


def zero_formula(kind: str, n: int) -> float:
    """Bytes per parameter of fp32 params + grads + Adam state per rank (ZeRO paper, K = 8 for Adam)."""
    return {"ddp": 16.0, "plain_ddp": 16.0, "plain_fsdp": 16 / n, "model_parallel": 16 / n, "z0": 16.0,
            "z1": 8 + 8 / n, "z2": 4 + 12 / n, "z2w": 8 + 8 / n, "z3": 16 / n, "z3s": 16 / n,
            "tp2": 16.0}[kind]  # fmt: skip


def draw(runs: dict[str, list[dict[str, Any]]], psi: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (label, reports) in zip(axes, runs.items()):
        for rep in reports:
            t = [s[0] for s in rep["samples"]]
            mb = [s[1] / 1e6 for s in rep["samples"]]
            ax.plot(t, mb, label=f"rank {rep['rank']}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("seconds into the step")
        ax.axhline(psi * 4 / 1e6, color="grey", lw=0.6, ls=":")
    axes[0].set_ylabel("resident MB above baseline")
    axes[0].legend(fontsize=7)
    fig.suptitle("resident memory over one training step (dotted: the fp32 parameters)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="run only these rows (labels as printed)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--mmap-threshold", default=MMAP_THRESHOLD, help="glibc's MALLOC_MMAP_THRESHOLD_ (bytes)")
    parser.add_argument("--name", default="memory_cpu.txt", help="the results file (in --out)")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return

    os.environ["MALLOC_MMAP_THRESHOLD_"] = args.mmap_threshold  # the jobs inherit it
    base = {"block_size": 64, "batch_size": 1, "n_layer": args.n_layer, "d_model": args.d_model, "steps": args.steps}
    once = {"zero": {"reduce_gradients": "once_per_step"}}
    rows = {
        "torch DDP, plain loop": ("plain_ddp", {"kind": "plain_ddp"}),
        "torch FSDP2, plain loop": ("plain_fsdp", {"kind": "plain_fsdp"}),
        "Lightning DDP": ("ddp", {"kind": "ddp"}),
        "Lightning ModelParallel": ("model_parallel", {"kind": "model_parallel"}),
        "hybrid zero_stage=0": ("z0", {"kind": "hybrid", "strategy": {"zero_stage": 0}}),
        "hybrid zero_stage=1": ("z1", {"kind": "hybrid", "strategy": {"zero_stage": 1}}),
        "hybrid zero_stage=2": ("z2", {"kind": "hybrid", "strategy": {"zero_stage": 2}}),
        "hybrid zero_stage=2 once_per_step": ("z2w", {"kind": "hybrid", "strategy": {"zero_stage": 2, **once}}),
        "hybrid zero_stage=3": ("z3", {"kind": "hybrid", "strategy": {"zero_stage": 3}}),
        "hybrid zero_stage=3 blocks": (
            "z3s",
            {"kind": "hybrid", "strategy": {"zero_stage": 3, "zero": {"shard_units": "blocks"}}},
        ),
        # tensor parallelism over the 2 processes (dp 1): the formula on P_tp = P_split / 2 + P_whole, the
        # parameters a rank holds (4-process layouts with ZeRO on top: benchmarks/tensor_parallel.py)
        "hybrid tensor_parallel_size=2": ("tp2", {"kind": "hybrid", "strategy": {"tensor_parallel_size": 2}}),
    }
    weights = Path(tempfile.mkdtemp(prefix="lh-memory-")) / "weights.pt"
    pp2 = {"pipeline_parallel_size": 2, "num_microbatches": 2}
    setup_rows = {
        "meta-built, pp2: materialise own stage": ("materialize", {"kind": "hybrid", "meta": True, "strategy": pp2}),
        "init_from .pt, pp2 (own tensors)": (
            "init_from",
            {"kind": "hybrid", "meta": True, "strategy": {**pp2, "init_from": str(weights)}},
        ),
        "init_from .pt, pp2, whole file read": (
            "init_from_whole",
            {"kind": "init_from_whole", "meta": True, "strategy": {**pp2, "init_from": str(weights)}},
        ),
    }
    # what a schedule keeps in flight: long sequences, a small model, 8 micro-batches over 2 stages
    act = {"d_model": 256, "n_layer": 8, "block_size": 256, "batch_size": 16}
    act_rows = {
        f"{schedule}{' + activation ckpt' if ac else ''}": (
            schedule,
            {
                "kind": "hybrid",
                **act,
                "strategy": {
                    "pipeline_parallel_size": 2,
                    "num_microbatches": 8,
                    "schedule": schedule,
                    "activation_checkpointing": ac,
                },
            },
        )
        for schedule in ("gpipe", "1f1b")
        for ac in (False, True)
    }
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only}
        setup_rows = {k: v for k, v in setup_rows.items() if k in args.only}
        act_rows = {k: v for k, v in act_rows.items() if k in args.only}
    jobs = args.out / "jobs" / "memory"
    results: dict[str, list[dict[str, Any]]] = {}
    for label, (key, cfg) in rows.items():
        print(f"running {label} ...", flush=True)
        results[label] = run_job(__file__, {**base, **cfg}, 2, jobs / key, timeout=1200)
    setup_results: dict[str, list[dict[str, Any]]] = {}
    if setup_rows:
        _write_weights(base, weights)
        for label, (key, cfg) in setup_rows.items():
            print(f"running {label} ...", flush=True)
            job = {**base, **cfg, "steps": 1, "batch_size": 2}  # two micro-batches of one sequence
            setup_results[label] = run_job(__file__, job, 2, jobs / key, timeout=1200)
        file_size = weights.stat().st_size
        weights.unlink()
    act_results: dict[str, list[dict[str, Any]]] = {}
    for label, (_, cfg) in act_rows.items():
        print(f"running activations {label} ...", flush=True)
        act_results[label] = run_job(__file__, {**base, **cfg}, 2, jobs / f"act-{label.replace(' ', '_')}", 1200)
    psi = next(iter({**results, **setup_results, **act_results}.values()))[0]["psi"]
    lines = [
        f"Per-rank PEAK resident memory, 2 CPU processes, GPT d_model={args.d_model} n_layer={args.n_layer}"
        f" ({psi / 1e6:.1f}M parameters, {psi * 4 / 1e6:.0f} MB fp32), AdamW,"
        f" MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}",
        "",
        f"| {'layout':<34} | {'peak MB (max rank)':>18} | {'formula MB':>10} | {'peak / formula':>14} |"
        f" {'step s':>7} |",
        f"|{'-' * 36}|{'-' * 20}|{'-' * 12}|{'-' * 16}|{'-' * 9}|",
    ]
    peaks = {}
    for label, reports in results.items():
        key = rows[label][0]
        peaks[key] = peak = max(r["peak"] for r in reports)
        # tensor parallelism: the formula on what a rank holds (P_tp), not on the whole model
        formula = zero_formula(key, 2) * (max(r["held"] for r in reports) if key == "tp2" else psi)
        step = statistics.median(r["step_time"] for r in reports)
        lines.append(
            f"| {label:<34} | {peak / 1e6:>18.0f} | {formula / 1e6:>10.0f} | {peak / formula:>14.2f} | {step:>7.2f} |"
        )
    if "model_parallel" in peaks and "z3" in peaks:
        lines.append(
            f"\nhybrid ZeRO-3 / Lightning ModelParallelStrategy peak: {peaks['z3'] / peaks['model_parallel']:.2f}"
        )
    if "plain_fsdp" in peaks and "z3" in peaks:
        lines.append(f"hybrid ZeRO-3 / torch FSDP2 plain loop peak: {peaks['z3'] / peaks['plain_fsdp']:.2f}")
    lines.append(
        "\npeak = high-water mark of resident memory above the process's own baseline before the model existed"
        " (set-up and steps);\nformula = fp32 params + grads + AdamW state per rank (DDP 16, Z1 8+8/N, Z2 4+12/N,"
        " Z3 16/N bytes/param;\n          ZeRO-2 once_per_step holds the full gradient for the window by design:"
        " compared with ZeRO-1's;\n          tensor_parallel_size=2: 16 bytes per parameter the rank holds, P_tp ="
        " P_split / 2 + P_whole)."
    )
    if setup_results:
        model_bytes = psi * 4
        lines += [
            "",
            f"Before step 0 (model {model_bytes / 1e6:.0f} MB fp32, weights file {file_size / 1e6:.0f} MB):",
            "",
            f"| {'set-up':<40} | {'peak MB (max rank)':>18} | {'/ model':>8} | {'/ file':>7} |",
            f"|{'-' * 42}|{'-' * 20}|{'-' * 10}|{'-' * 9}|",
        ]
        for label, reports in setup_results.items():
            peak = max(r["setup_peak"] for r in reports)
            lines.append(
                f"| {label:<40} | {peak / 1e6:>18.0f} | {peak / model_bytes:>8.2f} | {peak / file_size:>7.2f} |"
            )
    if act_results:
        ref = act_results.get("gpipe")
        lines += [
            "",
            f"Activations in flight, pp2, 8 micro-batches of 2 x {act['block_size']} tokens, d_model={act['d_model']},"
            f" n_layer={act['n_layer']}: the rise of resident memory within a step above where it started"
            " (gradients included, the same in every row):",
            "",
            f"| {'schedule':<28} | {'rise MB (max rank)':>18} | {'/ gpipe':>8} |",
            f"|{'-' * 30}|{'-' * 20}|{'-' * 10}|",
        ]
        ref_rise = max(r["last_step_rise"] for r in ref) if ref else None
        for label, reports in act_results.items():
            rise = max(r["last_step_rise"] for r in reports)
            ratio = f"{rise / ref_rise:>8.2f}" if ref_rise else f"{'-':>8}"
            lines.append(f"| {label:<28} | {rise / 1e6:>18.0f} | {ratio} |")
    plotted = {k: v for k, v in results.items() if "zero_stage=1" in k or "zero_stage=2" in k or "zero_stage=3" in k}
    if plotted:
        draw(plotted, psi, args.out / "memory_over_a_step.png")
        png = args.out / "memory_over_a_step.png"
        lines.append(f"\nper-rank memory over one step: {png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}")
    publish(lines, args.out, args.name)


def _write_weights(base: dict[str, Any], path: Path) -> None:
    """The example model's full state_dict, as a pretrained file would hold it."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    data = CharDataModule(block_size=base["block_size"])
    model = GPT(vocab_size=data.vocab_size, block_size=base["block_size"], n_layer=base["n_layer"],
                d_model=base["d_model"], n_head=8)  # fmt: skip
    torch.save(model.state_dict(), path)
    del model


if __name__ == "__main__":
    main()
