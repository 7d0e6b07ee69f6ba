"""The pack's GPU paths in one table: exactness on NCCL, bf16, fp16 with the agreed scaler, both engines,
the overlap benchmark and the peak memory per ZeRO stage (``torch.cuda.max_memory_allocated``).

    bash benchmarks/gpu_check.sh              # every GPU of this node (1 or more); a dry run without one
    bash benchmarks/gpu_check.sh --cpu        # the same checks on 2 CPU processes (gloo): the script's self-test

Each check is one ``torchrun`` job of this file (``--worker``) training the example GPT for a few steps on
fixed data; a multi-rank job is compared with the same global batch on one device (per-step losses and the
final loss). Checks that need more devices than the node has, or a package that is missing, are listed as
skipped with the reason. One table is printed and kept in ``benchmarks/results/``
(``gpu_check_gpu.txt``; ``gpu_check_cpu.txt`` with ``--cpu``; ``gpu_check_dry_run.txt`` without a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_in_session, run_job  # noqa: E402

STEPS = 6
# name: (ranks: "all" = the node's devices (an even count), "one" = one device; strategy spec; precision;
# tolerance on the per-step losses against one device in fp32 with the same global batch)
CHECKS: dict[str, tuple[str, Any, str, float]] = {
    "hybrid ZeRO-0, all ranks data-parallel": ("all", {"zero_stage": 0}, "32-true", 1e-4),
    "hybrid ZeRO-1": ("all", {"zero_stage": 1}, "32-true", 1e-4),
    "hybrid ZeRO-2": ("all", {"zero_stage": 2}, "32-true", 1e-4),
    "hybrid ZeRO-3": ("all", {"zero_stage": 3}, "32-true", 1e-4),
    "hybrid pp2 x ZeRO-1 (1f1b), dp = devices / 2": (
        "all",
        {"pipeline_parallel_size": 2, "zero_stage": 1},
        "32-true",
        1e-4,
    ),
    # tensor parallelism over NCCL: the example GPT's plan (heads and MLP split, vocabulary-parallel ends)
    "hybrid tp2 x ZeRO-1, dp = devices / 2": ("all", {"tensor_parallel_size": 2, "zero_stage": 1}, "32-true", 1e-4),
    "hybrid tp2 x ZeRO-3 (2-D FSDP2), dp = devices / 2": (
        "all",
        {"tensor_parallel_size": 2, "zero_stage": 3},
        "32-true",
        1e-4,
    ),
    "hybrid pp2 x tp2 (1f1b), dp = devices / 4": (
        "all",
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "32-true",
        1e-4,
    ),
    "hybrid ZeRO-2, bf16-mixed": ("all", {"zero_stage": 2}, "bf16-mixed", 2e-2),
    "hybrid ZeRO-2, fp16 AdaptiveLossScaling": ("all", {"zero_stage": 2}, "fp16-adaptive", 2e-2),
    "DeepSpeedPipelineStrategy pp2 x ZeRO-1": (
        "all",
        {"engine": "deepspeed", "pipeline_parallel_size": 2, "zero_stage": 1},
        "32-true",
        1e-4,
    ),
    "one device, bf16-mixed": ("one", None, "bf16-mixed", 5e-2),
    "one device, fp16 AdaptiveLossScaling": ("one", None, "fp16-adaptive", 5e-2),
}
BUDGET_S = 540  # the checks stop starting jobs past this; gpu_check.sh allows 600

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
    if gpu:  # this rank's device first: a reset on the default device would open a context on device 0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.reset_peak_memory_stats()
    # the same global batch on every layout: replica r of dp reads the r-th slice of each global batch (the
    # mesh is pp x dp x tp with tp innermost; every stage and every tensor-parallel peer of a replica reads the
    # same samples)
    world, rank = trainer.world_size, trainer.global_rank
    tp = spec.get("tensor_parallel_size", 1) if cfg["devices"] > 1 else 1
    dp = world // ((spec.get("pipeline_parallel_size", 1) if cfg["devices"] > 1 else 1) * tp)
    b, replica = cfg["batch_size"], (rank // tp) % dp
    order = [s * dp * b + replica * b + i for s in range(STEPS) for i in range(b)]
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
    work = Path(tempfile.mkdtemp(prefix="lightning-hybrid-gpu-check-"))
    try:
        _check(args, start, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check(args: argparse.Namespace, start: float, work: Path) -> None:
    n, machine = _devices(args.cpu)
    kind = "cpu" if args.cpu else "gpu" if n else "dry_run"
    table = _Table(args.out, f"gpu_check_{kind}.txt", machine)
    # on a GPU a model whose states dominate the peak (about 150M parameters); the CPU self-test a small one
    size = {"n_layer": 4, "d_model": 256} if args.cpu else {"n_layer": 12, "d_model": 1024}
    base = {"accelerator": "cpu" if args.cpu else "gpu", "batch_size": 8, **size}
    references: dict[tuple[str, int], list[float]] = {}
    for name, (want, spec, precision, tol) in CHECKS.items():
        ranks = 1 if want == "one" else n - n % 2
        skip = _skip(n, ranks, spec, precision, args.cpu, time.monotonic() - start)
        if skip:
            table.check(name, ranks, "skipped", skip)
            continue
        model_parallel = (spec or {}).get("pipeline_parallel_size", 1) * (spec or {}).get("tensor_parallel_size", 1)
        global_batch = 8 * (ranks // model_parallel)  # 8 samples per data-parallel replica
        # several devices: one device in the same precision (the distribution is exact); one device: fp32
        key = (precision if want == "all" else "32-true", global_batch)
        try:
            if key not in references:
                cfg = {**base, "precision": key[0], "strategy": None, "batch_size": global_batch}
                references[key] = run_job(__file__, cfg, 1, work / "reference")[0]["losses"]
            reports = run_job(__file__, {**base, "precision": precision, "strategy": spec}, ranks, work / "job")
        except RuntimeError as exc:
            table.check(name, ranks, "FAILED", _last_error(str(exc)), failed=True)
            continue
        table.result(name, ranks, reports, references[key], tol, spec, precision, key[0])
    table.memory_section(n)
    table.lines += _overlap(n, args.cpu, BUDGET_S + 60 - (time.monotonic() - start), table)
    table.finish(time.monotonic() - start)
    sys.exit(1 if table.failed or (n == 0 and not args.cpu and _nvidia_gpus()) else 0)


class _Table:
    """The one table, written again after every row (a run cut short keeps what it measured)."""

    def __init__(self, out: Path, name: str, machine: str) -> None:
        self.out, self.name, self.failed = out, name, 0
        self.lines = [f"# gpu_check: {machine}", "", "| check | ranks | result | detail |", "|---|---|---|---|"]
        self.memory: list[str] = []
        if machine == "no CUDA GPU" and _nvidia_gpus():
            self.lines[0] += " (nvidia-smi lists GPUs: this Python's torch is a CPU build; install a CUDA build)"

    def check(self, name: str, ranks: int, result: str, detail: str, *, failed: bool = False) -> None:
        self.failed += failed
        self.lines.append(f"| {name} | {ranks} | {result} | {detail} |")
        self.write()

    def result(self, name, ranks, reports, reference, tol, spec, precision, against) -> None:
        ours = reports[0]["losses"]
        finite = all(math.isfinite(x) for x in ours) and len(ours) == len(reference) == STEPS
        diff = max(abs(a - b) for a, b in zip(ours, reference)) if finite else float("inf")
        detail = f"max per-step loss difference {diff:.1e} from {against} on one device (tolerance {tol:.0e})"
        if "scaler" in reports[0]:
            same = all(r["scaler"] == reports[0]["scaler"] for r in reports)
            skipped = reports[0]["scaler"].get("skipped_steps", 0)
            detail += f"; scaler state {'identical' if same else 'DIFFERS'} on every rank, {skipped:.0f} skipped steps"
            diff = diff if same else float("inf")
        peak = max(r.get("peak_memory", 0) for r in reports)
        if peak:
            detail += f"; peak {peak / 2**20:.0f} MiB"
        passed = "exact" if against == precision else "close"  # the same precision, or against fp32
        self.check(name, ranks, passed if diff <= tol else "FAILED", detail, failed=not diff <= tol)
        stage = spec.get("zero_stage") if spec and precision == "32-true" and "engine" not in spec else None
        if peak and stage is not None and "pipeline_parallel_size" not in spec and "tensor_parallel_size" not in spec:
            formula = reports[0]["psi"] * {0: 16, 1: 8 + 8 / ranks, 2: 4 + 12 / ranks, 3: 16 / ranks}[stage]
            mib = f"{peak / 2**20:.0f} | {formula / 2**20:.0f}"
            self.memory.append(f"| ZeRO-{stage} | {ranks} | {mib} | {peak / formula:.2f} |")

    def memory_section(self, n: int) -> None:
        self.lines += ["", "Peak `torch.cuda.max_memory_allocated` per rank against the ZeRO formula (fp32 AdamW):", ""]
        if self.memory:
            self.lines += ["| stage | ranks | peak MiB | formula MiB | peak / formula |", "|---|---|---|---|---|"]
            self.lines += self.memory
        else:
            self.lines.append("skipped: " + ("no CUDA GPU on this machine" if n == 0 else "measured on 2+ GPUs only"))
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / self.name).write_text("\n".join(self.lines) + "\n")

    def finish(self, seconds: float) -> None:
        self.lines += ["", f"{self.failed} failed; {seconds:.0f} s"]
        publish(self.lines, self.out, self.name)


def _skip(n: int, ranks: int, spec: Any, precision: str, cpu: bool, elapsed: float) -> str:
    if n == 0:
        return "no CUDA GPU on this machine"
    if ranks < 2 and spec is not None:
        return f"needs 2 devices, the node has {n}"
    model_parallel = (spec or {}).get("pipeline_parallel_size", 1) * (spec or {}).get("tensor_parallel_size", 1)
    if spec is not None and ranks % model_parallel:
        return f"needs a multiple of {model_parallel} devices, the node has {n}"
    if spec is not None and spec.get("engine") == "deepspeed" and not _deepspeed():
        return "deepspeed is not installed"
    if precision == "bf16-mixed" and not cpu and not _bf16():
        return "this GPU has no bf16"
    if elapsed > BUDGET_S:
        return f"out of time ({elapsed:.0f} s of {BUDGET_S} s)"
    return ""


def _bf16() -> bool:
    import torch

    return torch.cuda.is_bf16_supported()


def _nvidia_gpus() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "Error" in line or "timed out" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "failed")[:200]


def _overlap(n: int, cpu: bool, seconds_left: float, table: _Table) -> list[str]:
    if n < 2 or cpu:
        reason = "no CUDA GPU on this machine" if n == 0 else "needs 2 GPUs" if n < 2 else "run it alone on CPU"
        return ["", f"overlap benchmark: skipped ({reason}; `python benchmarks/overlap.py`)"]
    if seconds_left < 150:
        return ["", "overlap benchmark: skipped (out of time; `python benchmarks/overlap.py`)"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "overlap.py"), "--repeats", "1", "--steps", "6", "--quick"]
    try:
        returncode, out, err = run_in_session(cmd, seconds_left - 20)
    except subprocess.TimeoutExpired:
        table.failed += 1
        return ["", "overlap benchmark FAILED: out of time (run `python benchmarks/overlap.py` alone)"]
    if returncode != 0:
        table.failed += 1
        return ["", f"overlap benchmark FAILED: {_last_error(err)}"]
    return ["", out.strip()]


if __name__ == "__main__":
    main()
