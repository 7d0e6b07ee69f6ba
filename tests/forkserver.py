"""Fork server for the test jobs' ranks: import torch, Lightning and the pack once, fork every rank from there.

A rank started as ``python worker.py`` spends about 6 s of one core importing torch, Lightning (with
torchmetrics, which imports transformers and matplotlib when they are installed) and the pack before its
first line runs; a 2-rank job on a 2-core machine waits those 6 s on every launch, a 4-rank job 12 s. Here
one server process per rank slot does the imports once and forks each rank of each job from that state,
as ``multiprocessing``'s forkserver does. Each slot is its own interpreter, started on its own, so the
ranks of one job differ in what separate processes differ in (the string hash seed, and so the order of a
set of names; torch's initial seed is drawn again in every child).

What a forked rank has, it has as ``python <script> <args>`` would: ``sys.argv``, ``sys.path[0]`` (the
script's folder), ``__main__``, the whole environment (``os.environ`` replaced, so C++ reads the same),
the working directory, stdout and stderr to its log, stdin from ``/dev/null``, a process group (its own, or
the first rank's), Lightning's ``rank_zero_only.rank`` read from the new environment (Lightning reads it
once at import), and the interpreter's normal exit (non-daemon threads joined, ``atexit`` run, an uncaught
exception printed with exit status 1).

The server speaks JSON lines on stdin/stdout: ``{"op": "spawn", ...}`` answers ``{"pid": P}``,
``{"op": "poll", "pid": P}`` answers ``{"code": None | exit status}`` (negative: the signal, as
``Popen.returncode``); end of input stops the server. Run as ``python tests/forkserver.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch.distributed.checkpoint", "lightning.pytorch", "lightning_hybrid")


# -- the server -------------------------------------------------------------------------------------------


def serve() -> dict[str, Any] | None:
    """Answer requests until end of input (returns None), or return a spawn request in the forked child."""
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    # what the imports put into the environment (Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK) every rank
    # of a fresh interpreter has too: the child adds it back to the job's environment
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    codes: dict[int, int] = {}
    _reply({"ready": os.getpid()})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            if request["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    return {**request, "env": {**added, **request["env"]}}
                codes.pop(pid, None)  # a pid reused by the system: the old rank's status is not this one's
                # as the child does: whichever runs first, the group is set before anyone can signal it (an
                # error: the child has already exited)
                with contextlib.suppress(PermissionError, ProcessLookupError):
                    os.setpgid(pid, request["pgid"] or pid)
                _reply({"pid": pid})
            elif request["op"] == "poll":
                _reap(codes)
                _reply({"code": codes.get(request["pid"])})
            else:
                raise ValueError(f"unknown request {request!r}")
        except Exception as e:  # the server outlives a bad request (a fork refused for memory, say)
            _reply({"error": f"{type(e).__name__}: {e}"})
    return None


def _reap(codes: dict[int, int]) -> None:
    """Collect every child that has ended (a job killed by its test leaves no zombie behind)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = os.waitstatus_to_exitcode(status)


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def run_child(request: dict[str, Any]) -> None:
    """Become ``python <script> <args>`` in ``request["cwd"]`` with ``request["env"]``, logging to ``log``."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # first: whatever the child prints from here on is in its log, never in the server's pipe
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
    os.setpgid(0, request["pgid"])
    _die_with_parent()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)

    import numpy
    import torch
    import torchmetrics.utilities.prints as torchmetrics_prints
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    # what a process of its own would have drawn or read at import
    torch.seed()
    numpy.random.seed()
    rank_zero_only.rank = _get_rank() or 0
    torchmetrics_prints.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))

    import runpy

    runpy.run_path(script, run_name="__main__")


def _die_with_parent() -> None:
    """SIGKILL this rank if its server dies (a server killed by the test process leaves no orphaned rank)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# -- the client (the test process) ------------------------------------------------------------------------


class ForkedProcess:
    """The part of ``subprocess.Popen`` the launcher uses, for a rank forked by a server."""

    def __init__(self, server: Server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.request({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """One server process (one rank slot), started from ``env``; ``spawn`` forks a rank from it.

    Its own output (the imports' warnings) goes to ``stderr_path``, not into any rank's log.
    """

    def __init__(self, env: dict[str, str], cwd: Path, stderr_path: Path) -> None:
        with open(stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, __file__],
                env=env,
                cwd=cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                bufsize=0,
            )
        self.ready = False
        self.pending = b""

    def wait_ready(self, timeout: float = 180.0) -> None:
        if not self.ready:
            if "ready" not in json.loads(self._readline(timeout)):
                raise RuntimeError("fork server did not start")
            self.ready = True

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        self.wait_ready()
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        answer = json.loads(self._readline(60.0))
        if "error" in answer:
            raise RuntimeError(f"fork server: {answer['error']}")
        return answer

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: str, log: str, pgid: int) -> ForkedProcess:
        request = {"op": "spawn", "argv": argv, "env": env, "cwd": cwd, "log": log, "pgid": pgid}
        return ForkedProcess(self, self.request(request)["pid"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _readline(self, timeout: float) -> bytes:
        """One line from the server; once ``timeout`` passes or the server has died, kill it and raise."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            chunk = os.read(fd, 65536) if left > 0 and select.select([fd], [], [], left)[0] else b""
            if not chunk:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"fork server gave no answer within {timeout}s (exit status {self.proc.returncode})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line


if __name__ == "__main__":
    child = serve()
    if child is not None:
        run_child(child)
