"""The pack's GPU paths in one table: exactness on NCCL, bf16, fp16 with the agreed scaler, both engines,
the overlap benchmark and the peak memory per ZeRO stage (``torch.cuda.max_memory_allocated``).

    bash benchmarks/gpu_check.sh              # every GPU of this node (1 or more); a dry run without one
    bash benchmarks/gpu_check.sh --cpu        # the same checks on 2 CPU processes (gloo): the script's self-test

Each check is one ``torchrun`` job of this file (``--worker``) training the example GPT for a few steps on
fixed data; a multi-rank job is compared with the same global batch on one device (per-step losses and the
final loss). Checks that need more devices than the node has, or a package that is missing, are listed as
skipped with the reason. One table is printed and kept in ``benchmarks/results/gpu_check_<machine>.txt``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job  # noqa: E402

STEPS = 6
# name: (ranks wanted, strategy spec, precision, tolerance on losses)
CHECKS: dict[str, tuple[int, Any, str, float]] = {
    "hybrid ZeRO-0, all ranks data-parallel": (-1, {"zero_stage": 0}, "32-true", 1e-4),
    "hybrid ZeRO-1": (-1, {"zero_stage": 1}, "32-true", 1e-4),
    "hybrid ZeRO-2": (-1, {"zero_stage": 2}, "32-true", 1e-4),
    "hybrid ZeRO-3": (-1, {"zero_stage": 3}, "32-true", 1e-4),
    "hybrid pp2 x ZeRO-1 (1f1b)": (2, {"pipeline_parallel_size": 2, "zero_stage": 1}, "32-true", 1e-4),
    "hybrid ZeRO-2, bf16-mixed": (-1, {"zero_stage": 2}, "bf16-mixed", 2e-2),
    "hybrid ZeRO-2, fp16 AdaptiveLossScaling": (-1, {"zero_stage": 2}, "fp16-adaptive", 2e-2),
    "DeepSpeedPipelineStrategy pp2 x ZeRO-1": (
        2,
        {"engine": "deepspeed", "pipeline_parallel_size": 2, "zero_stage": 1},
        "32-true",
        1e-4,
    ),
}

# ------------------------------------------------------------------------------------------------ worker


def worker(cfg: dict[str, Any]) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    from lightning_hybrid.plugins import AdaptiveLossScalingPrecision
    from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = cfg["accelerator"] == "gpu"
    torch.manual_seed(0)
    data = CharDataModule(block_size=64, batch_size=cfg["batch_size"], stride=4)
    size = {"n_layer": cfg["n_layer"], "d_model": cfg["d_model"], "n_head": 8}
    model = GPT(vocab_size=data.vocab_size, block_size=64, dropout=0.0, optimizer="adamw", **size)
    psi = sum(p.numel() for p in model.parameters())  # before fit: the whole model
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append(float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")))

    spec = dict(cfg["strategy"] or {})
    strategy: Any = "auto"
    if cfg["devices"] > 1 and spec.pop("engine", None) == "deepspeed":
        strategy = DeepSpeedPipelineStrategy(**spec)
    elif cfg["devices"] > 1:
        strategy = HybridParallelStrategy(**spec)
    precision, plugins = cfg["precision"], []
    if precision == "fp16-adaptive":
        plugins, precision = [AdaptiveLossScalingPrecision()], None
    trainer = L.Trainer(
        accelerator=cfg["accelerator"], devices=cfg["devices"], strategy=strategy, precision=precision,
        plugins=plugins, max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[Record()], use_distributed_sampler=False,
    )  # fmt: skip
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    # the same global batch on every layout: replica r of dp reads the r-th slice of each global batch (the
    # data-parallel ranks of one stage are adjacent; every stage of a replica reads the same samples)
    world, rank = trainer.world_size, trainer.global_rank
    dp = world // (spec.get("pipeline_parallel_size", 1) if cfg["devices"] > 1 else 1)
    b = cfg["batch_size"]
    order = [s * dp * b + (rank % dp) * b + i for s in range(STEPS) for i in range(b)]
    loader = DataLoader(data.train_set, batch_size=b, sampler=order, drop_last=True)
    trainer.fit(model, train_dataloaders=loader)
    report = {"rank": trainer.global_rank, "losses": losses, "psi": psi}
    if gpu:
        report["peak_memory"] = torch.cuda.max_memory_allocated()
    if plugins:
        report["scaler"] = {k: float(v) for k, v in trainer.precision_plugin.state_dict().items() if _number(v)}
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------------ driver


def _devices(cpu: bool) -> tuple[int, str]:
    if cpu:
        return 2, "2 CPU processes (gloo)"
    import torch

    if not torch.cuda.is_available():
        return 0, "no CUDA GPU"
    return torch.cuda.device_count(), f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (NCCL)"


def _deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", action="store_true", help="run the checks on 2 CPU processes (self-test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker.read_text()))
        return
    start = time.monotonic()
    n, machine = _devices(args.cpu)
    accelerator = "cpu" if args.cpu else "gpu"
    work = Path("/tmp") / "lightning-hybrid-gpu-check"
    rows = [f"# gpu_check: {machine}", "", "| check | ranks | result | detail |", "|---|---|---|---|"]
    failed = 0
    references: dict[tuple[str, int], list[float]] = {}
    memory: list[str] = []
    for name, (want, spec, precision, tol) in CHECKS.items():
        ranks = n if want == -1 else want
        if n == 0:
            rows.append(f"| {name} | - | skipped | no CUDA GPU on this machine |")
            continue
        if ranks < 2 or ranks > n or (want == -1 and ranks % 2):
            rows.append(f"| {name} | {ranks} | skipped | needs {max(2, want)} devices, the node has {n} |")
            continue
        if isinstance(spec, dict) and spec.get("engine") == "deepspeed" and not _deepspeed():
            rows.append(f"| {name} | {ranks} | skipped | deepspeed is not installed |")
            continue
        # on a GPU a model whose states dominate the peak (about 150M parameters); the CPU self-test a small one
        size = {"n_layer": 4, "d_model": 256} if args.cpu else {"n_layer": 12, "d_model": 1024}
        base = {"accelerator": accelerator, "precision": precision, "batch_size": 8, **size}
        key = (precision, 8 * _dp(spec, ranks))  # one device, the job's global batch
        if key not in references:
            ref = run_job(__file__, {**base, "strategy": None, "batch_size": key[1]}, 1, work / "reference")
            references[key] = ref[0]["losses"]
        try:
            reports = run_job(__file__, {**base, "strategy": spec}, ranks, work / "job")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failed += 1
            rows.append(f"| {name} | {ranks} | FAILED | {str(exc).splitlines()[-1][:160]} |")
            continue
        ours, reference = reports[0]["losses"], references[key]
        diff = max(abs(a - b) for a, b in zip(ours, reference)) if len(ours) == len(reference) else float("inf")
        detail = f"max per-step loss difference {diff:.1e} (tolerance {tol:.0e})"
        if "scaler" in reports[0]:
            same = all(r["scaler"] == reports[0]["scaler"] for r in reports)
            detail += f"; scaler state {'identical' if same else 'DIFFERS'} on every rank"
            diff = diff if same else float("inf")
        if "peak_memory" in reports[0]:
            detail += f"; peak {max(r['peak_memory'] for r in reports) / 2**20:.0f} MiB"
        ok = diff <= tol
        failed += not ok
        rows.append(f"| {name} | {ranks} | {'exact' if ok else 'FAILED'} | {detail} |")
        stage = spec.get("zero_stage") if precision == "32-true" and "engine" not in spec else None
        if "peak_memory" in reports[0] and stage is not None and "pipeline_parallel_size" not in spec:
            formula = reports[0]["psi"] * {0: 16, 1: 8 + 8 / ranks, 2: 4 + 12 / ranks, 3: 16 / ranks}[stage]
            peak = max(r["peak_memory"] for r in reports)
            memory.append(
                f"| ZeRO-{stage} | {ranks} | {peak / 2**20:.0f} | {formula / 2**20:.0f} | {peak / formula:.2f} |"
            )
    rows += ["", "Peak `torch.cuda.max_memory_allocated` per rank against the ZeRO formula (fp32 AdamW):", ""]
    if memory:
        rows += ["| stage | ranks | peak MiB | formula MiB | peak / formula |", "|---|---|---|---|---|", *memory]
    else:
        rows.append("skipped: " + ("no CUDA GPU on this machine" if n == 0 else "measured on GPUs only"))
    rows += _overlap(n, args.cpu)
    rows += ["", f"{failed} failed; {time.monotonic() - start:.0f} s"]
    publish(rows, args.out, f"gpu_check_{'cpu' if args.cpu or n == 0 else 'gpu'}.txt")
    sys.exit(1 if failed else 0)


def _dp(spec: dict[str, Any], ranks: int) -> int:
    return ranks // spec.get("pipeline_parallel_size", 1)


def _overlap(n: int, cpu: bool) -> list[str]:
    if n < 2 or cpu:
        reason = "no CUDA GPU on this machine" if n == 0 else "needs 2 devices" if n < 2 else "run it alone on CPU"
        return ["", f"overlap benchmark: skipped ({reason}; `python benchmarks/overlap.py`)"]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overlap.py"), "--repeats", "1"],
                          capture_output=True, text=True, timeout=420)  # fmt: skip
    return ["", proc.stdout.strip() if proc.returncode == 0 else f"overlap benchmark FAILED: {proc.stderr[-400:]}"]


if __name__ == "__main__":
    main()
