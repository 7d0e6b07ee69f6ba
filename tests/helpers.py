"""Test helpers: launch an N-process gloo job with torchrun and collect what each rank reported."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT), env.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore",
        }
    )
    env.update(extra)
    return env


@dataclass
class JobResult:
    returncode: int
    output: str
    reports: list[dict[str, Any]]

    def rank(self, r: int) -> dict[str, Any]:
        return next(rep for rep in self.reports if rep["rank"] == r)


def launch(
    script: str,
    config: dict[str, Any],
    *,
    nproc: int,
    nnodes: int = 1,
    timeout: float = 240.0,
    expect_success: bool = True,
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
) -> JobResult:
    """Run ``tests/workers/<script>`` under torchrun on loopback (gloo) with a hard timeout.

    ``nnodes > 1`` starts one torchrun agent per node, meeting through a c10d rendezvous, as on a cluster.
    Each rank writes ``rank<R>.json`` into ``config["out"]`` (created here); those reports are returned.
    ``max_restarts`` lets torchrun restart all workers in place after one fails (as ``--max-restarts``).
    On an unexpected outcome the whole output is shown in the assertion message.
    """
    out = Path(config.get("out") or tempfile.mkdtemp(prefix="lh-job-"))
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(out)}
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(config))
    port = free_port()
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc // nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=lh-{port}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            str(WORKERS / script),
            str(cfg_path),
        ]
        if nnodes > 1:
            cmd.insert(3, f"--node-rank={node}")
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=child_env(**(env or {})),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs, codes = [], []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill_group(q)
            text, _ = p.communicate()
            raise AssertionError(f"job timed out after {timeout}s\n{text[-8000:]}") from None
        outputs.append(text)
        codes.append(p.returncode)
    output = "\n".join(outputs)
    code = max(codes, key=abs)
    if expect_success and code != 0:
        raise AssertionError(f"job failed with exit code {code}\n{output[-12000:]}")
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if expect_success and len(reports) != nproc:
        raise AssertionError(f"expected {nproc} rank reports, got {len(reports)}\n{output[-8000:]}")
    return JobResult(code, output, reports)


def _kill_group(p: subprocess.Popen) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
