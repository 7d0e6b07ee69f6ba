"""Run one benchmark configuration as its own ``torchrun`` job of a benchmark script (``--worker``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_in_session(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` in a session of its own and return (exit code, stdout, stderr); past ``timeout`` it is
    killed with every process it started (ranks that hold devices) and ``TimeoutExpired`` is raised."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, stdout, stderr


def run_job(script: str, cfg: dict[str, Any], nproc: int, workdir: Path, timeout: float = 600) -> list[dict[str, Any]]:
    """``torchrun --standalone`` ``script --worker config.json`` on ``nproc`` processes; the rank reports."""
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank*.json"):
        old.unlink()
    cfg = {**cfg, "out": str(workdir), "devices": nproc}
    (workdir / "config.json").write_text(json.dumps(cfg))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
        script, "--worker", str(workdir / "config.json"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    try:
        returncode, stdout, stderr = run_in_session(cmd, timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"benchmark job timed out after {timeout:.0f} s: {cfg}") from None
    if returncode != 0:
        raise RuntimeError(f"benchmark job failed: {cfg}\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return [json.loads(f.read_text()) for f in sorted(workdir.glob("rank*.json"))]


def build_example(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The example GPT, its data and the strategy named by ``cfg`` (``"ddp"`` or HybridParallelStrategy kwargs)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    from lightning_hybrid.strategies import HybridParallelStrategy

    torch.manual_seed(0)
    data = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"], stride=4)
    model = GPT(
        vocab_size=data.vocab_size, block_size=cfg["block_size"], n_layer=cfg["n_layer"], d_model=cfg["d_model"],
        n_head=4, optimizer="adamw",
    )  # fmt: skip
    strategy: Any = "ddp" if cfg["strategy"] == "ddp" else HybridParallelStrategy(**cfg["strategy"])
    return model, data, strategy


def sharded_gpt() -> type:
    """The example GPT as Lightning's ``ModelParallelStrategy`` wants it: the module applies FSDP2 itself."""
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT

    class ShardedGPT(GPT):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    return ShardedGPT


def benchmark_arguments(doc: str | None, *, d_model: int, n_layer: int) -> argparse.ArgumentParser:
    """The arguments every model benchmark takes: its worker's config, the model's size, the results folder."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--d-model", type=int, default=d_model)
    parser.add_argument("--n-layer", type=int, default=n_layer)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser


def publish(lines: list[str], out: Path, name: str) -> None:
    """Print a benchmark's table and keep it as ``out/name``."""
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(table + "\n")
