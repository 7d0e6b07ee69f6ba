"""Test helpers: launch an N-process gloo job (as torchrun would) and collect what each rank reported."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import forkserver

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
    codes: list[int] | None = None  # each rank's exit status, by rank (ranks started here; not under torchrun)

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
    torchrun: bool = False,
) -> JobResult:
    """Run ``tests/workers/<script>`` as ``nproc`` gloo ranks on loopback with a hard timeout.

    Ranks are started directly with the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, so Lightning sees a torchrun
    launch), and torchrun's failure policy is kept: once a rank fails, the others get SIGTERM and, 30 s
    later, SIGKILL. This saves torchrun's own start-up (its agent and rendezvous, seconds per launch).
    torchrun itself runs the job when its agent is part of what a test checks: ``nnodes > 1`` (one agent per
    node, meeting through a c10d rendezvous, as on a cluster), ``max_restarts`` (the agent restarts all
    workers in place after one fails, as ``--max-restarts``) or ``torchrun=True``.
    Each rank writes ``rank<R>.json`` into ``config["out"]``; those reports are returned. Without an
    ``out`` the job's folder is temporary and removed afterwards.
    On an unexpected outcome the whole output is shown in the assertion message.
    """
    temporary = not config.get("out")
    out = Path(config.get("out") or tempfile.mkdtemp(prefix="lh-job-"))
    try:
        return _launch(script, config, out, nproc, nnodes, timeout, expect_success, env, max_restarts, torchrun)
    finally:
        if temporary:
            shutil.rmtree(out, ignore_errors=True)


def _launch(
    script: str,
    config: dict[str, Any],
    out: Path,
    nproc: int,
    nnodes: int,
    timeout: float,
    expect_success: bool,
    env: dict[str, str] | None,
    max_restarts: int,
    torchrun: bool,
) -> JobResult:
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "out": str(out)}
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(config))
    if not (torchrun or nnodes > 1 or max_restarts):
        codes, output = _run_ranks(WORKERS / script, cfg_path, nproc, timeout, env or {})
        return _result(max(codes, key=abs), output, out, nproc, expect_success, codes)
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
    return _result(max(codes, key=abs), "\n".join(outputs), out, nproc, expect_success)


def _run_ranks(script: Path, cfg_path: Path, nproc: int, timeout: float, env: dict[str, str]) -> tuple[list[int], str]:
    """Start ``nproc`` ranks in one process group and supervise them as torchrun's agent does: each rank's exit
    status (negative: the signal that ended it) and the ranks' output."""
    port = free_port()
    logs = [cfg_path.parent / f"rank{rank}.log" for rank in range(nproc)]
    procs: list = []
    # fresh interpreters where the job sets a variable read at start-up or import: a server has read its own
    fork = FORK and all(k.startswith(_FORKABLE_ENV) for k in env)
    if fork:  # every slot the job needs starts now, side by side (ranks 0-3: four interpreters)
        _start_servers(min(nproc, 4))
    try:
        for rank, log in enumerate(logs):
            rank_env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "GROUP_WORLD_SIZE": "1",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(nproc),
                "ROLE_NAME": "default",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": f"lh-{port}",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                **env,
            }
            pgid = procs[0].pid if procs else 0  # one group: one killpg stops them all
            procs.append(_start_rank(rank, [str(script), str(cfg_path)], child_env(**rank_env), log, pgid, fork))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                _kill_group(procs[0])
                raise AssertionError(f"job timed out after {timeout}s\n{_read(logs)[-8000:]}")
            if any(p.poll() not in (None, 0) for p in procs):  # torchrun's policy: stop the others
                _stop(procs, grace=30.0)
                break
            time.sleep(0.5)
        codes = [p.wait() for p in procs]
    finally:
        running = True  # unless known otherwise (a fork server gone): no rank outlives its job
        with contextlib.suppress(Exception):
            running = any(p.poll() is None for p in procs)
        if procs and running:  # a live rank keeps the group's id from being reused: safe to signal
            _kill_group(procs[0])
    return codes, _read(logs)


_SERVERS: dict[int, forkserver.Server] = {}
_SERVER_LOGS = Path(tempfile.mkdtemp(prefix="lh-forkserver-"))
FORK = os.environ.get("LH_TEST_FORK", "1") != "0"  # LH_TEST_FORK=0: every rank a fresh interpreter
# what a job's own environment may set and still be forked: read at run time, never at import
_FORKABLE_ENV = ("PATH", "SLURM_")


def _start_servers(slots: int) -> None:
    for slot in range(slots):
        if slot not in _SERVERS or not _SERVERS[slot].alive():
            _SERVERS[slot] = forkserver.Server(child_env(), ROOT, _SERVER_LOGS / f"slot{slot}.log")


def _start_rank(rank: int, argv: list[str], env: dict[str, str], log: Path, pgid: int, fork: bool):
    """Rank ``rank`` of a job as ``python <argv>``: forked from the warm server of its slot, or started fresh."""
    if not fork:
        with open(log, "w") as sink:
            return subprocess.Popen(
                [sys.executable, *argv], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, process_group=pgid
            )
    return _SERVERS[rank % 4].spawn(argv, env=env, cwd=str(ROOT), log=str(log), pgid=pgid)


@atexit.register
def _close_servers() -> None:
    for server in _SERVERS.values():
        server.close()
    shutil.rmtree(_SERVER_LOGS, ignore_errors=True)


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()


def _read(logs: list[Path]) -> str:
    return "\n".join(log.read_text(errors="replace") for log in logs if log.exists())


def _result(
    code: int, output: str, out: Path, nproc: int, expect_success: bool, codes: list[int] | None = None
) -> JobResult:
    if expect_success and code != 0:
        raise AssertionError(f"job failed with exit code {code}\n{output[-12000:]}")
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if expect_success and len(reports) != nproc:
        raise AssertionError(f"expected {nproc} rank reports, got {len(reports)}\n{output[-8000:]}")
    return JobResult(code, output, reports, codes)


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
