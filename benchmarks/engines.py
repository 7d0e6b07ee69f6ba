"""Pipeline engines head to head: torch pipelining, HybridParallelStrategy, DeepSpeed, DeepSpeedPipelineStrategy.

    python benchmarks/engines.py                  # pp2 (and pp2 x dp2 with >= 4 CPU cores), ~5 min
    python benchmarks/engines.py --layouts pp2 pp2xdp2 --steps 20

One model (a residual MLP whose micro-batch compute, tens of ms on a CPU core, dwarfs a gloo send of its
activations), one data stream, one layout, the 1F1B schedule and the same micro-batches for

    (a) torch.distributed.pipelining's Schedule1F1B in a plain loop,
    (b) HybridParallelStrategy in a Lightning Trainer (the same torch schedule under the pack),
    (c) DeepSpeed's PipelineEngine.train_batch in a plain loop,
    (d) DeepSpeedPipelineStrategy in a Lightning Trainer (the same engine under the pack).

Each is its own ``torchrun`` job of this file (``--worker``). Printed: the median step time (the wall time
from one batch to the next, data loading and, for (b) and (d), everything Lightning does per step included)
and each rank's peak resident memory above its baseline after imports, as ratios to (a) and to (c); and the
1F1B bubble of each measured per rank (the idle share of the span from the rank's first forward to its last
backward), against the first stage's ideal ``(p - 1) / (m + p - 1)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job  # noqa: E402

ENGINES = {
    "a": "torch pipelining (plain loop)",
    "b": "HybridParallelStrategy",
    "c": "DeepSpeed PipelineEngine (plain loop)",
    "d": "DeepSpeedPipelineStrategy",
}

# ------------------------------------------------------------------------------------------------ worker


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(cfg: dict[str, Any], layers: bool = True) -> Any:
    import lightning as L
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class ResMLP(L.LightningModule):
        """The pipeline contract: blocks in self.layers, pipeline_loss; trains as is under DDP too."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[Block(cfg["d_model"]) for _ in range(cfg["blocks"] if layers else 0)])
            self.block = Block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(output, target)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.pipeline_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"])

    torch.manual_seed(0)
    return ResMLP()


def _loader(cfg: dict[str, Any], dp_rank: int, dp: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = cfg["batch"] * dp * (cfg["steps"] + 1)
    x = torch.randn(n, cfg["d_model"], generator=g)
    y = torch.randn(n, cfg["d_model"], generator=g)
    shard = slice(dp_rank, None, dp)  # every stage of one pipeline reads the same samples
    return DataLoader(TensorDataset(x[shard], y[shard]), batch_size=cfg["batch"], drop_last=True)


def _timed_stages(stages: list[Any], timeline: list[tuple[str, float, float]]) -> None:
    """Record when each forward / backward of a torch PipelineStage ran (benchmark only)."""

    def timed(kind: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timeline.append((kind, start, time.perf_counter()))

        return wrapper

    for st in stages:
        st.forward_one_chunk = timed("F", st.forward_one_chunk)
        st.backward_one_chunk = timed("B", st.backward_one_chunk)


def _timed_deepspeed(timeline: list[tuple[str, float, float]]) -> None:
    """Record when each forward / backward pass of DeepSpeed's pipeline engine ran (benchmark only): its
    schedule dispatches through the class's instruction map."""
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    table = PipelineEngine._INSTRUCTION_MAP
    for kind, instr in (("F", schedule.ForwardPass), ("B", schedule.BackwardPass)):
        fn = table[instr]

        def wrapper(self: Any, *args: Any, _fn: Any = fn, _kind: str = kind, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                timeline.append((_kind, start, time.perf_counter()))

        table[instr] = wrapper


def _bubble(timeline: list[tuple[str, float, float]]) -> float | None:
    if not timeline:
        return None
    span = max(e for _, _, e in timeline) - min(s for _, s, _ in timeline)
    return 1.0 - sum(e - s for _, s, e in timeline) / span


def worker(cfg: dict[str, Any]) -> None:
    # every engine imports the same modules before its baseline (DeepSpeed's pipeline engine alone is ~70 MB),
    # so the memory figures compare what the engines allocate
    import deepspeed
    import deepspeed.pipe
    import deepspeed.runtime.pipe.engine
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining

    from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy

    torch.set_num_threads(1)
    engine, pp, m = cfg["engine"], cfg["pp"], cfg["microbatches"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dp = world // pp
    times: list[float] = []
    timeline: list[tuple[str, float, float]] = []
    bubbles: list[float] = []
    baseline = _rss_now_mb()
    # the model as a user builds it (whole, then the strategy keeps a stage); (c) builds only its stage's
    # blocks from LayerSpecs, as DeepSpeed's examples do
    module = _model(cfg, layers=engine != "c")
    if engine in ("c", "d"):
        _timed_deepspeed(timeline)

    def tick() -> None:
        times.append(time.perf_counter())
        bubble = _bubble(timeline)
        if bubble is not None:
            bubbles.append(bubble)
        timeline.clear()

    if engine in ("b", "d"):

        class Clock(L.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                tick()

            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                if isinstance(trainer.strategy, HybridParallelStrategy):
                    _timed_stages(trainer.strategy.pipeline_runner.stages, timeline)

        if engine == "b":
            strategy: Any = HybridParallelStrategy(pipeline_parallel_size=pp, schedule="1f1b", num_microbatches=m)
        else:
            strategy = DeepSpeedPipelineStrategy(pipeline_parallel_size=pp, num_microbatches=m)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["steps"], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            use_distributed_sampler=False, callbacks=[Clock()],
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=_loader(cfg, rank % dp, dp))
        tick()  # the end of the last step
    elif engine == "a":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        dist.init_process_group("gloo")
        stage_id = rank // dp
        mesh_groups = [dist.new_group([s * dp + d for s in range(pp)]) for d in range(dp)]
        dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(pp)]
        per = cfg["blocks"] // pp
        blocks = torch.nn.Sequential(*list(module.layers)[stage_id * per : (stage_id + 1) * per])
        del module.layers
        stage = PipelineStage(blocks, stage_id, pp, torch.device("cpu"), group=mesh_groups[rank % dp])
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=module.pipeline_loss)
        _timed_stages([stage], timeline)
        optimizer = torch.optim.SGD(blocks.parameters(), lr=cfg["lr"])
        for x, y in _loader(cfg, rank % dp, dp):
            if len(times) > cfg["steps"]:
                break
            tick()
            optimizer.zero_grad()
            if stage_id == 0:
                schedule.step(x)
            elif stage_id == pp - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            if dp > 1:
                for p in blocks.parameters():
                    dist.all_reduce(p.grad, group=dp_groups[stage_id])
                    p.grad /= dp
            optimizer.step()
        dist.destroy_process_group()
    else:  # "c": DeepSpeed's engine as its examples drive it (LayerSpec: each rank builds only its blocks)
        from deepspeed.pipe import LayerSpec, PipelineModule

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT-built collective on CPU
        deepspeed.init_distributed("gloo", verbose=False)
        specs = [LayerSpec(module.block, cfg["d_model"]) for _ in range(cfg["blocks"])]
        pipe = PipelineModule(layers=specs, num_stages=pp, loss_fn=module.pipeline_loss, partition_method="uniform")
        optimizer = torch.optim.SGD(pipe.parameters(), lr=cfg["lr"])
        config = {"train_micro_batch_size_per_gpu": cfg["batch"] // m, "gradient_accumulation_steps": m,
                  "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1}  # fmt: skip
        engine_, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=config)
        for x, y in _loader(cfg, rank % dp, dp):
            if len(times) > cfg["steps"]:
                break
            tick()
            engine_.train_batch(iter(list(zip(x.chunk(m), y.chunk(m)))))
    steps = [b - a for a, b in itertools.pairwise(times)][cfg["warmup"] :]
    report = {
        "rank": rank,
        "step_time": statistics.median(steps),
        "peak_mb": _rss_peak_mb() - baseline,
        "bubble": statistics.median(bubbles[cfg["warmup"] :]) if bubbles[cfg["warmup"] :] else None,
    }
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", nargs="+", choices=["pp2", "pp2xdp2"], default=None)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128, help="per data-parallel replica, cut into micro-batches")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of every engine, interleaved (a b c d a b c d ...)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker.read_text()))
        return
    layouts = args.layouts or (["pp2", "pp2xdp2"] if (os.cpu_count() or 1) >= 4 else ["pp2"])
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "262144")  # freed blocks leave the RSS: a peak is a peak
    base = {"blocks": args.blocks, "d_model": args.d_model, "batch": args.batch, "microbatches": args.microbatches,
            "steps": args.steps, "warmup": args.warmup, "lr": 0.01, "pp": 2}  # fmt: skip
    m, p = args.microbatches, 2
    lines = [
        f"residual MLP, {args.blocks} blocks of d_model {args.d_model} (4x hidden), SGD, 1F1B, {m} micro-batches of"
        f" {args.batch // m} samples, 1 thread per rank (CPU, gloo); {args.repeats} runs of each engine, interleaved;"
        " (a), (b), (d) build the whole model and keep a stage, (c) builds its stage from LayerSpecs;"
        f" step time: median over runs of the median of {args.steps - args.warmup} steps after {args.warmup} warm-up;"
        " peak RSS above each rank's baseline after imports (max over ranks and runs)",
    ]
    for layout in layouts:
        nproc = 2 if layout == "pp2" else 4
        runs: dict[str, list[list[dict[str, Any]]]] = {key: [] for key in ENGINES}
        for repeat in range(args.repeats):
            for key in ENGINES:
                workdir = Path(tempfile.gettempdir()) / f"engines-{layout}-{key}"
                runs[key].append(run_job(__file__, {**base, "engine": key}, nproc, workdir))
                ms = runs[key][-1][0]["step_time"] * 1000
                print(f"{layout} ({key}) {ENGINES[key]}, run {repeat + 1}: {ms:.1f} ms", flush=True)
        results = {
            key: {  # the median over runs of each run's median step (ranks agree within a step); the peak's max
                "time": statistics.median(statistics.median(r["step_time"] for r in run) for run in done),
                "runs": [statistics.median(r["step_time"] for r in run) for run in done],
                "peak": max(r["peak_mb"] for run in done for r in run),
                "bubble": [statistics.median(run[i]["bubble"] for run in done) for i in range(nproc)]
                if done[0][0]["bubble"] is not None
                else [],
            }
            for key, done in runs.items()
        }
        head = (
            f"{'engine':<42} {'step ms':>8} {'runs min-max':>13} {'/ (a)':>6} {'/ (c)':>6} {'peak MB':>8} {'/ (a)':>6}"
            f" {'/ (c)':>6}"
        )
        lines += ["", f"layout {layout} ({nproc} processes)", head]
        for key, name in ENGINES.items():
            r, a, c = results[key], results["a"], results["c"]
            t, mb = r["time"], r["peak"]
            spread = f"{min(r['runs']) * 1000:.0f}-{max(r['runs']) * 1000:.0f}"
            lines.append(
                f"({key}) {name:<38} {t * 1000:>8.1f} {spread:>13} {t / a['time']:>6.2f} {t / c['time']:>6.2f}"
                f" {mb:>8.0f} {mb / a['peak']:>6.2f} {mb / c['peak']:>6.2f}"
            )
        ideal = (p - 1) / (m + p - 1)
        lines.append(
            f"1F1B bubble per rank (idle share of the span from the rank's first forward to its last backward);"
            f" ideal for the first stage (p-1)/(m+p-1) = {ideal:.3f}, for the last stage about 0:"
        )
        for key in ENGINES:
            measured = ", ".join(f"{b:.3f}" for b in results[key]["bubble"])
            lines.append(f"  ({key}) {ENGINES[key]}: {measured}")
        lines.append(
            f"like for like: raw torch / raw DeepSpeed (a)/(c) = {results['a']['time'] / results['c']['time']:.3f},"
            f" under Lightning (b)/(d) = {results['b']['time'] / results['d']['time']:.3f}"
        )
        targets = [
            ("(b) / (a) step time <= 1.05", results["b"]["time"] / results["a"]["time"], 1.05),
            ("(d) / (c) step time <= 1.05", results["d"]["time"] / results["c"]["time"], 1.05),
            ("(b) / (c) step time <= 1.00", results["b"]["time"] / results["c"]["time"], 1.00),
        ]
        for label, value, bound in targets:
            verdict = "met" if value <= bound else f"missed by {100 * (value / bound - 1):.1f}%"
            lines.append(f"target {label}: {value:.3f} ({verdict})")
    publish(lines, args.out, "engines_cpu.txt")


if __name__ == "__main__":
    main()
