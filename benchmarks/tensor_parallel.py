"""Tensor parallelism: pp2 x tp2 under the pack against torch's own parallelize_module + pipelining in a plain
loop, and each rank's peak memory against the formula with tensor parallelism.

    python benchmarks/tensor_parallel.py                 # 4 CPU processes, ~5 min
    python benchmarks/tensor_parallel.py --rounds 3 --d-model 512

The same example GPT (its blocks cut into the same two stages), the same data, the 1F1B schedule with the
same micro-batches, AdamW, and the same tensor-parallel plan (Megatron's: attention heads and the MLP's
hidden units column-wise in, row-wise out; vocabulary-parallel embedding and head) for

    (a) torch in a plain loop: ``parallelize_module`` on each block over the tp sub-mesh of a (pp, tp) mesh,
        ``PipelineStage`` + ``Schedule1F1B`` over the pp group, ``optimizer.step()``;
    (b) ``HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)`` in a Lightning Trainer.

Each is its own ``torchrun`` job of this file; (a) and (b) alternate over ``--rounds`` rounds so that a
machine's drift falls on both. Printed: the median step time of each (batch to batch, everything Lightning
does per step included for (b)) and their ratio per round; and for (b) at pp2 x tp2 and at tp2 x dp2 with
ZeRO-1 / ZeRO-3 each rank's peak resident memory against ``P_tp = P_split / T + P_whole`` parameters held
(the ZeRO formula on ``P_tp``: fp32 Adam 16, 8 + 8/N, 4 + 12/N, 16/N bytes per parameter).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import benchmark_arguments, publish, run_job  # noqa: E402
from memory import _reset_peak, _status  # noqa: E402

MMAP_THRESHOLD = "262144"  # freed tensors go back to the system: the high-water mark follows live tensors


def _build(cfg: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    torch.manual_seed(0)
    data = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"], stride=cfg["block_size"])
    vocab = data.vocab_size + data.vocab_size % 2  # even: the vocabulary-parallel embedding splits it in two
    model = GPT(
        vocab_size=vocab, block_size=cfg["block_size"], n_layer=cfg["n_layer"], d_model=cfg["d_model"], n_head=8,
        optimizer="adamw", dropout=0.0, build_on_meta=cfg.get("meta", False),
    )  # fmt: skip
    loader = DataLoader(data.train_set, batch_size=cfg["batch_size"], drop_last=True)
    model.configure_model()  # built on the meta device (``meta``): its blocks exist, nothing is allocated
    blocks = len(model.layers)
    return model, loader, [blocks // 2, blocks - blocks // 2]


def _plan(block: Any) -> dict[str, Any]:
    """Megatron's plan, written out for the plain loop (the example's tensor_parallel_plan gives the same)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = type(block).__name__
    if kind == "TokenEmbedding":
        return {"token": RowwiseParallel(input_layouts=Replicate())}
    if kind == "Block":
        col, row = ColwiseParallel, RowwiseParallel
        return {"attn.q": col(), "attn.k": col(), "attn.v": col(), "attn.proj": row(), "mlp.0": col(), "mlp.2": row()}
    return {"head": ColwiseParallel(output_layouts=Replicate())}


def worker(cfg: dict[str, Any]) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    baseline = _status("VmRSS")
    _reset_peak()
    model, loader, split = _build(cfg)
    steps: list[float] = []
    if cfg["kind"] == "torch":
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.distributed.tensor.parallel import parallelize_module

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pp_rank = rank // 2
        blocks = list(model.layers)
        mine = blocks[: split[0]] if pp_rank == 0 else blocks[split[0] :]
        for block in mine:
            parallelize_module(block, mesh["tp"], _plan(block))
        stage_module = nn.Sequential(*mine)
        del model
        stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches=cfg["microbatches"], loss_fn=_loss)
        optimizer = torch.optim.AdamW(stage_module.parameters(), lr=3e-4)
        batches = itertools.cycle(loader)  # a small corpus: the same batches again, as Lightning's epochs
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            x, y = next(batches)
            optimizer.zero_grad()
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            optimizer.step()
            steps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        report = {"rank": rank, "steps": steps}
        dist.destroy_process_group()
    else:
        from lightning_hybrid.strategies import HybridParallelStrategy, PipelineSplit, ZeroConfig

        kwargs = dict(cfg["strategy"])
        if kwargs.get("pipeline_parallel_size", 1) > 1:
            kwargs["split"] = PipelineSplit(layers_per_stage=split)
        if "zero" in kwargs:
            kwargs["zero"] = ZeroConfig(**kwargs["zero"])

        class Clock(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.t0 = getattr(self, "t0", time.perf_counter())

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                steps.append(time.perf_counter() - self.t0)
                self.t0 = time.perf_counter()

        trainer = L.Trainer(
            accelerator="cpu", devices=cfg["devices"], strategy=HybridParallelStrategy(**kwargs),
            max_steps=cfg["steps"], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()],
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=loader)
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        report = {"rank": trainer.global_rank, "steps": steps, "held": held}
    report["peak"] = _status("VmHWM") - baseline
    Path(cfg["out"], f"rank{report['rank']}.json").write_text(json.dumps(report))


def _loss(output: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())


FORMULA = {0: lambda n: 16.0, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}


def main() -> None:
    parser = benchmark_arguments(__doc__, d_model=384, n_layer=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--memory-d-model", type=int, default=768, help="the memory rows' model (states dominate)")
    parser.add_argument("--memory-n-layer", type=int, default=12)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    base = {"d_model": args.d_model, "n_layer": args.n_layer, "block_size": 128, "batch_size": 8,
            "microbatches": 4, "steps": args.steps}  # fmt: skip
    pp_tp = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_microbatches": 4}
    jobs = args.out / "jobs" / "tensor_parallel"
    rounds = []
    for r in range(args.rounds):
        times = {}
        for kind in ("torch", "hybrid"):
            print(f"round {r + 1}: {kind} ...", flush=True)
            reports = run_job(__file__, {**base, "kind": kind, "strategy": pp_tp}, 4, jobs / f"{kind}-{r}", 1200)
            # the slowest rank's median step after the first two (warm-up, shape inference)
            times[kind] = max(statistics.median(rep["steps"][2:]) for rep in reports)
        rounds.append(times)
    model, _, _ = _build(base)
    psi = sum(p.numel() for p in model.parameters())
    lines = (
        []
        if not rounds
        else [
            f"pp2 x tp2 on 4 CPU processes, GPT d_model={args.d_model} n_layer={args.n_layer} ({psi / 1e6:.1f}M"
            f" parameters), 1F1B, 4 micro-batches of 2 x 128 tokens, AdamW; median step of the slowest rank",
            "",
            "| round | torch plain loop s | HybridParallelStrategy s | hybrid / torch |",
            "|---|---|---|---|",
        ]
    )
    for i, t in enumerate(rounds):
        lines.append(f"| {i + 1} | {t['torch']:.3f} | {t['hybrid']:.3f} | {t['hybrid'] / t['torch']:.3f} |")
    if rounds:
        ratio = statistics.median(t["hybrid"] / t["torch"] for t in rounds)
        lines += ["", f"median hybrid / torch: {ratio:.3f}", ""]
    layouts = {
        "pp2 x tp2, ZeRO-0": ({**pp_tp, "num_microbatches": 2}, 0, 1),
        "tp2 x dp2, ZeRO-1": ({"tensor_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 1}, 1, 2),
        "tp2 x dp2, ZeRO-3": ({"tensor_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3}, 3, 2),
        # the control: no tensor parallelism, the same formula as the row above (16 / 4 x P = 16 / 2 x P / 2)
        "dp4, ZeRO-3 (no TP)": ({"data_parallel_size": 4, "zero_stage": 3}, 3, 4),
    }
    # a model whose states dominate the peak: one or two sequences of 64 tokens per rank and step
    # built on the meta device, as a model that needs tensor parallelism is: each rank materialises its blocks
    # one at a time and splits each at once
    memory = {"d_model": args.memory_d_model, "n_layer": args.memory_n_layer, "block_size": 64, "steps": 3}
    shape_only, _, _ = _build({**base, **memory, "meta": True})
    psi = sum(p.numel() for p in shape_only.parameters())
    del shape_only
    lines += [
        f"Per-rank peak resident memory, GPT d_model={args.memory_d_model} n_layer={args.memory_n_layer}"
        f" ({psi / 1e6:.1f}M parameters), 64-token sequences, AdamW, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}:",
        "the high-water mark above the process's baseline (set-up and steps), against the ZeRO formula on the",
        "parameters a rank holds with tensor parallelism, P_tp = P_split / T + P_whole:",
        "",
        "| layout | P_tp (max rank) | P_tp / P | peak MB (max rank) | formula MB | peak / formula |",
        "|---|---|---|---|---|---|",
    ]
    for label, (strategy, zero, n) in layouts.items():
        print(f"memory {label} ...", flush=True)
        job = {**base, **memory, "meta": True, "batch_size": 2 if n == 1 else 1, "kind": "hybrid", "strategy": strategy}
        reports = run_job(__file__, job, 4, jobs / label.replace(" ", "_").replace(",", ""), 1800)
        held = max(rep["held"] * (n if zero == 3 else 1) for rep in reports)
        peak = max(rep["peak"] for rep in reports)
        formula = FORMULA[zero](n) * held
        lines.append(
            f"| {label} | {held / 1e6:.2f}M | {held / psi:.2f} | {peak / 1e6:.0f} | {formula / 1e6:.0f} |"
            f" {peak / formula:.2f} |"
        )
    lines.append(
        "\nP_tp counts a rank's own slices and the parameters it holds whole (norms, positions, row-wise biases);"
        " under ZeRO-3 a rank's shard times N. The peak includes the step's activations and the library's own"
        " memory, which the formula does not count."
    )
    publish(lines, args.out, "tensor_parallel_cpu.txt" if rounds else "tensor_parallel_memory_cpu.txt")


if __name__ == "__main__":
    main()
