"""Step time against model size: every ZeRO stage relative to Lightning's DDP on 1M to 100M parameters.

    python benchmarks/step_time.py                          # 2 CPU processes (gloo, fp32), about 60 minutes
    python benchmarks/step_time.py --sizes 1 10 --shapes large --repeats 1     # a quick look
    python benchmarks/step_time.py --revision 3c821b3       # the same sweep with that revision's package

A ratio measured on one model says little about another: a cost that grows with the parameter bytes (a buffer
allocated afresh each step, a copy, a zero-fill) hides in the noise on a small model and shows on a large one.
This sweep trains a residual MLP of about 1M, 10M, 30M and 100M parameters in two shapes:

- ``large``: two blocks of two bias-free matrices (``d -> 4d -> d``): a few large tensors;
- ``small``: blocks of width 256 with a LayerNorm and biases: many small tensors, as a transformer's norms and
  biases (six per block; 57 blocks at 30M). Up to ``--small-max`` (30M): at 100M its second job needs more
  than 12 GiB per rank.

Per size and shape, K = 1 and 4 micro-batches per step, fused AdamW, each configuration against Lightning's
DDP on the same model and data, in the same processes: by default each configuration fitted alone, one
Trainer after the other after an untimed one, in an order each round rotates (``--interleave trainers``: one
model in memory at a time, as a user runs it); or all of them at once, a step of each in turn
(``--interleave steps``, ``overlap.py``'s ``_Turns``: a slow spell falls on every configuration alike, but at
100M five models share each rank's memory and cache, and ZeRO-0/1 measured 1.1-1.2 of DDP at K=1 there, 0.93
fitted alone). Rows: a second DDP Trainer (the noise row), ZeRO-0, ZeRO-1, ZeRO-2 (``every_microbatch``) against DDP
and against its floor row (DDP plus the reduce-scatters ZeRO-2's memory bound requires: ``overlap.py``'s
``ddp+reduce-scatters``), and ZeRO-3 against Lightning's ``ModelParallelStrategy`` (FSDP2) sharded the same
way (one unit per block, and the root). The configurations run in two jobs per round (the first: DDP, DDP
again, ZeRO-0, ZeRO-1; the second: DDP, ZeRO-2, its floor, ZeRO-3, FSDP2), so that a 100M model fits once
per configuration in memory; each ratio is to the DDP of its own job.

Printed: per size and shape, each ratio's median over the rounds and its spread; a plot of the ratio against
the parameter count (``step_time_cpu.png``); the ratios as JSON (``step_time_cpu.json``), which
``--before FILE`` draws dashed in the plot. ``--revision REV`` runs the sweep on the package of an earlier
revision (its ``src`` exported with ``git archive``; this file and ``overlap.py`` from the working tree) and
writes ``step_time_cpu_REV.*``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job  # noqa: E402

SIZES = {1: "1M", 10: "10M", 30: "30M", 100: "100M"}
JOBS = [
    ["DDP (Lightning)", "DDP (Lightning), again", "hybrid ZeRO-0", "hybrid ZeRO-1"],
    ["DDP (Lightning)", "hybrid ZeRO-2 every_microbatch", "DDP + ZeRO-2's extra reduce-scatters", "hybrid ZeRO-3",
     "FSDP2 (ModelParallelStrategy)"],
]  # fmt: skip
# row: (configuration, its baseline)
ROWS = [
    ("DDP (Lightning), again", "DDP (Lightning)"),
    ("hybrid ZeRO-0", "DDP (Lightning)"),
    ("hybrid ZeRO-1", "DDP (Lightning)"),
    ("hybrid ZeRO-2 every_microbatch", "DDP (Lightning)"),
    ("DDP + ZeRO-2's extra reduce-scatters", "DDP (Lightning)"),
    ("hybrid ZeRO-2 every_microbatch", "DDP + ZeRO-2's extra reduce-scatters"),
    ("hybrid ZeRO-3", "FSDP2 (ModelParallelStrategy)"),
]
SHORT = {
    "DDP (Lightning)": "DDP",
    "DDP (Lightning), again": "DDP again (noise)",
    "hybrid ZeRO-0": "ZeRO-0",
    "hybrid ZeRO-1": "ZeRO-1",
    "hybrid ZeRO-2 every_microbatch": "ZeRO-2",
    "DDP + ZeRO-2's extra reduce-scatters": "ZeRO-2 floor",
    "hybrid ZeRO-3": "ZeRO-3",
    "FSDP2 (ModelParallelStrategy)": "FSDP2",
}
SMALL_WIDTH = 256


def shape_of(shape: str, millions: int) -> dict[str, int]:
    """Width and depth of a residual MLP of about ``millions`` parameters."""
    if shape == "large":  # 2 blocks x 8 d^2: d rounded to 64
        return {"width": max(64, round((millions * 1e6 / 16) ** 0.5 / 64) * 64), "depth": 2, "norms": 0}
    per_block = size_of({"width": SMALL_WIDTH, "depth": 1, "norms": 1})[0]
    return {"width": SMALL_WIDTH, "depth": max(1, round(millions * 1e6 / per_block)), "norms": 1}


def size_of(model: dict[str, int]) -> tuple[int, int]:
    """Parameters and tensors of the residual MLP ``model`` (``shape_of``'s): per block two matrices, and with
    ``norms`` their biases and a LayerNorm."""
    w, d, norms = model["width"], model["depth"], model["norms"]
    return d * (8 * w * w + norms * 7 * w), d * (2 + norms * 4)


# ------------------------------------------------------------------------------------------------ worker


def _mlp_and_data(cfg: dict[str, Any], spec: Any) -> tuple[Any, Any]:
    """The residual MLP of ``cfg["model"]`` for ``spec`` (sharded per block for FSDP2) and random batches."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    width, depth, norms = (cfg["model"][key] for key in ("width", "depth", "norms"))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width) if norms else nn.Identity()
            self.up = nn.Linear(width, 4 * width, bias=bool(norms))
            self.down = nn.Linear(4 * width, width, bias=bool(norms))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class ResidualMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*(Block() for _ in range(depth)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_model(self) -> None:
            if spec == "fsdp2":  # ZeRO-3's units: each block, then the root
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.layers:
                    fully_shard(block, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    torch.manual_seed(0)
    model = ResidualMLP()
    n = cfg["batch_size"] * cfg["steps"] * max(cfg["accumulation"]) * cfg["devices"]
    data = TensorDataset(torch.randn(n, width), torch.randn(n, width))
    return model, DataLoader(data, batch_size=cfg["batch_size"], drop_last=True)


def _trace(cfg: dict[str, Any]) -> dict[str, Any]:
    """Each configuration of ``cfg["configs"]`` fitted alone with ``cfg["k"]`` micro-batches: the minor page
    faults of each step after warm-up (memory touched for the first time since the system handed it out), and
    torch.profiler's table of the last step's operators by their own CPU time."""
    import resource

    import lightning as L
    import torch
    from overlap import CONFIGS, _extra_reductions, _strategy

    k, last = cfg["k"], cfg["steps"] - 1

    class Probe(L.Callback):
        def __init__(self) -> None:
            self.faults: list[int] = []
            self.table = ""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % k == 0:
                self.start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                if batch_idx // k == last:
                    self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profiler.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % k == 0:
                self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.start)
                if batch_idx // k == last:
                    self.profiler.__exit__(None, None, None)
                    self.table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)

    out: dict[str, Any] = {}
    for name in cfg["configs"]:
        spec = CONFIGS[name]
        model, loader = _mlp_and_data({**cfg, "accumulation": [k]}, spec)
        probe = Probe()
        trainer = L.Trainer(
            accelerator="cpu", strategy=_strategy({**cfg, "strategy": spec}), devices=cfg["devices"],
            max_steps=cfg["steps"], accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[probe, *([_extra_reductions(k)] if spec == "ddp+reduce-scatters" else [])],
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=loader)
        out[name] = {"faults": probe.faults[cfg["warmup"] :], "table": probe.table}
    return out


def worker(cfg: dict[str, Any]) -> None:
    """One job: ``cfg["configs"]`` interleaved step by step, for each K (``overlap.py``'s ``_lockstep``); with
    ``cfg["k"]``, each traced alone (``_trace``)."""
    if cfg.get("tree"):  # an earlier revision's package, ahead of the installed one
        sys.path.insert(0, str(Path(cfg["tree"]) / "src"))
    import torch.distributed as dist
    from overlap import _lockstep, _one_by_one

    import lightning_hybrid

    if cfg.get("k"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps({"rank": rank, "trace": _trace(cfg)}))
        return

    names, shift = cfg["configs"], cfg["shift"] % len(cfg["configs"])
    order = names[shift:] + names[:shift]
    runs = []
    for k in cfg["accumulation"]:
        if cfg["interleave"] == "trainers":
            reports = _one_by_one(cfg, order, k, build=_mlp_and_data, warm_up=not runs)
        else:
            reports = _lockstep(cfg, order, k, seed=cfg["shift"], build=_mlp_and_data)
        runs += [{"k": k, "name": name, "step_time": reports[name]["step_time"]} for name in names]
        gc.collect()  # the last K's Trainers and models (reference cycles) before the next K builds its own
    rank = dist.get_rank() if dist.is_initialized() else 0
    report = {"rank": rank, "runs": runs, "package": str(Path(lightning_hybrid.__file__).parent)}
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver


def _export(revision: str, into: Path) -> None:
    """``revision``'s ``src`` under ``into`` (``git archive``: nothing in the repository changes)."""
    archive = subprocess.run(["git", "archive", revision, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _plot(results: dict[str, Any], before: dict[str, Any] | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({key.split("|")[1] for key in results["ratios"]})
    ks = sorted({int(key.split("|")[2]) for key in results["ratios"]})
    fig, axes = plt.subplots(len(shapes), len(ks), figsize=(6 * len(ks), 4 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        for j, k in enumerate(ks):
            ax = axes[i][j]
            for n, (row, base) in enumerate(ROWS):
                label = f"{SHORT[row]} / {SHORT[base]}"
                for data, style in ((results, "-"), (before, "--")):
                    if data is None:
                        continue
                    points = sorted(
                        (data["psi"][f"{size}|{shape}"], statistics.median(data["ratios"][key][label]))
                        for key in data["ratios"]
                        for size, sh, kk in [key.split("|")]
                        if sh == shape and int(kk) == k and label in data["ratios"][key]
                    )
                    if points:
                        ax.plot(*zip(*points), style, marker="o", color=f"C{n}",
                                label=label if style == "-" else None)  # fmt: skip
            ax.set_xscale("log")
            ax.axhline(1.0, color="grey", linewidth=0.5)
            ax.set_title(f"{shape} tensors, K={k}" + (" (dashed: before)" if before else ""))
            ax.set_xlabel("parameters")
            ax.set_ylabel("step time ratio")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


TRACED = [
    "DDP (Lightning)", "hybrid ZeRO-0", "hybrid ZeRO-1", "hybrid ZeRO-2 every_microbatch",
    "DDP + ZeRO-2's extra reduce-scatters",
]  # fmt: skip


def _run_trace(args: argparse.Namespace, tree: Path | None, work: Path) -> None:
    shape = args.trace_shape
    model = shape_of(shape, args.trace)
    psi, tensors = size_of(model)
    lines = [
        f"# one step of each, traced: 2 CPU processes, residual MLP of {psi / 1e6:.1f}M parameters in"
        f" {tensors} tensors ({psi * 4 / 2**20:.0f} MiB fp32), fused AdamW, per-rank micro-batch"
        f" {args.batch_size}, {'revision ' + args.revision if args.revision else 'the working tree'}",
        "",
        "minor page faults per optimizer step (rank 0, median of the steps after warm-up; a fault is a 4 KiB page"
        " touched for the first time since the system handed it out: memory allocated afresh):",
        "",
        "| configuration | K=1 | K=4 | MiB touched afresh per step, K=1 | K=4 |",
        "|---|---|---|---|---|",
    ]
    tables: list[str] = []
    faults: dict[str, dict[int, float]] = {}
    for k in (1, 4):
        cfg = {"steps": args.steps or 7, "warmup": 3, "batch_size": args.batch_size, "accumulation": [k], "k": k,
               "model": model, "configs": TRACED, "tree": str(tree) if tree else None}  # fmt: skip
        reports = run_job(__file__, cfg, 2, work / "trace", 300 + 40 * cfg["steps"] * k * psi / 1e8)
        trace = next(r for r in reports if r["rank"] == 0)["trace"]
        for name in TRACED:
            faults.setdefault(name, {})[k] = statistics.median(trace[name]["faults"])
            tables += ["", f"## {name}, K={k}: operators of one step by self CPU time (rank 0)", "",
                       trace[name]["table"]]  # fmt: skip
    for name in TRACED:
        f = faults[name]
        lines.append(f"| {name} | {f[1]:.0f} | {f[4]:.0f} | {f[1] * 4 / 1024:.0f} | {f[4] * 4 / 1024:.0f} |")
    suffix = ("_small" if shape == "small" else "") + (f"_{args.revision}" if args.revision else "")
    publish(lines + tables, args.out, f"step_time_trace_cpu{suffix}.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="millions of parameters")
    parser.add_argument("--shapes", nargs="*", default=["large", "small"], choices=["large", "small"])
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every job (the order rotated)")
    parser.add_argument(
        "--steps", type=int, default=None,
        help="optimizer steps per configuration, 3 of them warm-up (default: 7 at 100M, more on smaller models,"
        " up to 40: about the same seconds of timed steps per configuration at every size)",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", choices=["trainers", "steps"], default="trainers",
        help="trainers: each configuration fitted alone, one after the other (default); steps: all at once, a"
        " step of each in turn",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch and rank")
    parser.add_argument(
        "--small-max", type=int, default=30,
        help="largest size of the small-tensor shape: at 100M (1140 tensors) the second job's five Trainers at once"
        " take more than 12 GiB per rank, past a 24 GiB machine",
    )  # fmt: skip
    parser.add_argument("--revision", default=None, help="run on this git revision's package")
    parser.add_argument("--before", type=Path, default=None, help="an earlier run's JSON, drawn dashed")
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the sizes of the results JSON this run would write (from an earlier run) and add these",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--trace", type=int, default=None, metavar="MILLIONS",
        help="instead of the sweep: page faults per step and the operators of one step of DDP and ZeRO-0/1/2 on"
        " the large-tensor model of this size, each fitted alone (step_time_trace_cpu*.txt)",
    )  # fmt: skip
    parser.add_argument(
        "--trace-shape", choices=["large", "small"], default="large",
        help="the model --trace runs: a few large tensors, or many small ones (step_time_trace_cpu_small*.txt)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker.read_text()))
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes, whatever the machine has
    work = Path(tempfile.mkdtemp(prefix="lightning-hybrid-step-time-"))
    tree = None
    if args.revision:
        tree = work / "tree"
        tree.mkdir()
        _export(args.revision, tree)
    if args.trace:
        _run_trace(args, tree, work)
        return
    base = {"steps": args.steps, "warmup": 3, "batch_size": args.batch_size, "accumulation": [1, 4],
            "interleave": args.interleave, "tree": str(tree) if tree else None}  # fmt: skip
    suffix = f"_{args.revision}" if args.revision else ""
    saved = args.out / f"step_time_cpu{suffix}.json"
    results: dict[str, Any] = {"ratios": {}, "psi": {}, "ms": {}, "rounds": {}}
    if args.resume and saved.exists():  # sizes measured by an earlier run are kept unless measured again
        results = json.loads(saved.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for size in args.sizes:
        for shape in args.shapes:
            if shape == "small" and size > args.small_max:
                print(f"{SIZES.get(size, size)} small: left out (--small-max {args.small_max})", flush=True)
                continue
            _sweep_one(args, base, size, shape, work, results)
            saved.write_text(json.dumps(results, indent=1))  # after each size: an interrupted sweep keeps it
    label = f"revision {args.revision}" if args.revision else "the working tree"
    lines = [
        f"# step time against model size: 2 CPU processes (gloo, fp32), residual MLP, fused AdamW, {label}",
        f"# per-rank micro-batch {args.batch_size} samples, {args.steps or 'up to 40 (7 at 100M)'} steps per"
        f" configuration and round ({base['warmup']} warm-up), "
        + (
            "each configuration fitted alone, the order rotated by round"
            if args.interleave == "trainers"
            else "interleaved step by step"
        )
        + "; ratio: median over rounds (min-max)",
        "",
        "| size | shape | tensors | rounds | ratio | K=1 | K=4 | DDP ms K=1 | DDP ms K=4 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(results["psi"], key=lambda key: (results["psi"][key], key)):
        size, shape = key.split("|")
        tensors = size_of(shape_of(shape, int(size)))[1]
        for row, ref in ROWS:
            label_ = f"{SHORT[row]} / {SHORT[ref]}"
            cells = []
            for k in base["accumulation"]:
                r = results["ratios"][f"{key}|{k}"][label_]
                cells.append(f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})")
            ddp = [f"{results['ms'][f'{key}|{k}']['DDP']:.0f}" for k in base["accumulation"]]
            lines.append(f"| {results['psi'][key] / 1e6:.1f}M | {shape} | {tensors} | {results['rounds'][key]} |"
                         f" {label_} | {' | '.join(cells)} | {' | '.join(ddp)} |")  # fmt: skip
    lines += [
        "",
        "DDP again / DDP: a second, identical DDP Trainer: the measurement's own noise.",
        "ZeRO-2 floor: DDP plus, after each backward that does not close the window, one reduce-scatter of a"
        " gradient-sized buffer (allocated once): the bytes ZeRO-2's memory bound requires beyond DDP's.",
        "ZeRO-3 / FSDP2: Lightning's ModelParallelStrategy with fully_shard on each block and the root.",
    ]
    publish(lines, args.out, f"step_time_cpu{suffix}.txt")
    before = json.loads(args.before.read_text()) if args.before else None
    _plot(results, before, args.out / f"step_time_cpu{suffix}.png")
    print(f"plot: {args.out / f'step_time_cpu{suffix}.png'}")


def _sweep_one(
    args: argparse.Namespace, base: dict[str, Any], size: int, shape: str, work: Path, results: dict[str, Any]
) -> None:
    """Every job of ``JOBS`` for ``args.repeats`` rounds on the model of ``size`` and ``shape``: its ratios
    into ``results``."""
    model = shape_of(shape, size)
    psi = size_of(model)[0]
    times: dict[tuple[str, int], list[float]] = {}
    # about the same timed seconds per configuration at every size: a 1M step takes 16 ms, a 100M one 1.1 s
    steps = args.steps or max(7, min(40, round(7 * 1e8 / psi)))
    for round_ in range(args.repeats):
        for j, names in enumerate(JOBS):
            cfg = {**base, "steps": steps, "model": model, "configs": names, "shift": round_}
            budget = 300 + len(names) * steps * 5 * psi / 1e7
            reports = run_job(__file__, cfg, 2, work / f"job{j}", budget)
            for i, run in enumerate(reports[0]["runs"]):
                step = max(r["runs"][i]["step_time"] for r in reports)  # the slowest rank's
                times.setdefault((f"{run['name']}#{j}", run["k"]), []).append(step)
        print(f"{SIZES.get(size, size)} {shape}: round {round_ + 1}/{args.repeats} done", flush=True)
    key = f"{size}|{shape}"
    results["psi"][key], results["rounds"][key] = psi, args.repeats
    for k in base["accumulation"]:
        ratios: dict[str, list[float]] = {}
        ms: dict[str, float] = {"DDP": statistics.median(times[("DDP (Lightning)#0", k)]) * 1e3}
        for row, ref in ROWS:
            j = next(j for j, names in enumerate(JOBS) if row in names and ref in names)
            a, b = times[(f"{row}#{j}", k)], times[(f"{ref}#{j}", k)]
            ratios[f"{SHORT[row]} / {SHORT[ref]}"] = [x / y for x, y in zip(a, b)]
            ms[SHORT[row]] = statistics.median(a) * 1e3
        results["ratios"][f"{key}|{k}"], results["ms"][f"{key}|{k}"] = ratios, ms


if __name__ == "__main__":
    main()
