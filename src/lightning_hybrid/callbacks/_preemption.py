"""Preemption: signal handlers that only raise a flag, Slurm requeue, and the exit codes a launcher sees.

A handler runs between two Python bytecodes of whatever the process was doing, possibly inside a
collective: it must not save, communicate or exit. The callback reads the flag at safe points (a
training or validation batch boundary), where the ranks agree with one all-reduce, save together and
exit with a code that tells the launcher what happened.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, NoReturn

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = [
    "PREEMPTION_EXIT_CODE",
    "PREEMPTION_SAVE_FAILED_EXIT_CODE",
    "SignalFlag",
    "exit_after_preemption",
    "parse_signals",
    "requeue_slurm_job",
    "under_slurm",
]

log = logging.getLogger(__name__)

PREEMPTION_EXIT_CODE = 75
"""Exit status after a preemption save (``EX_TEMPFAIL``): the job is safe to relaunch and resumes there."""

PREEMPTION_SAVE_FAILED_EXIT_CODE = 74
"""Exit status when a preemption signal came but its save failed (``EX_IOERR``). The job is not requeued: a
relaunch would resume from an older checkpoint, and the cause (a full disk, a lost mount) needs a look."""

_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
_NOT_PREEMPTION = {"SIGINT": "SIGINT is Ctrl-C: it stops the run (a save, exit 75 and a requeue would ignore it)"}


def parse_signals(names: Any) -> tuple[signal.Signals, ...]:
    """Signal names (``"SIGTERM"``, ``"SIGUSR1"``) as signals; raises ValueError naming what is wrong."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"signals must be a list of signal names such as ['SIGTERM', 'SIGUSR1'], got {names!r}.")
    parsed = []
    for name in names:
        value = getattr(signal, str(name), None) if isinstance(name, str) else None
        if not isinstance(value, signal.Signals):
            raise ValueError(f"Unknown signal name {name!r} in signals; use names such as 'SIGTERM', 'SIGUSR1'.")
        if name in _UNCATCHABLE:
            raise ValueError(f"{name} cannot be caught by any process, so it cannot trigger a save; remove it.")
        if name in _NOT_PREEMPTION:
            raise ValueError(f"{_NOT_PREEMPTION[name]}; remove it from signals.")
        parsed.append(value)
    return tuple(dict.fromkeys(parsed))


class SignalFlag:
    """Handlers for ``signals`` that record which arrived (in the process that installed them only)."""

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._pid = os.getpid()
        self._original: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # DataLoader workers inherit the handler: a signal to the process group must not count there
        if os.getpid() == self._pid:
            self.received = signal.Signals(signum)

    def install(self) -> None:
        """Install (or re-install) the handlers, remembering what was there first.

        Lightning installs its own SIGTERM handler right before training and wraps the one it finds; that
        handler broadcasts inside the signal context, so the callback calls this again at the first hook
        after, and the flag stays the only reaction.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        for signum in self.signals:
            previous = signal.signal(signum, self._handle)
            self._original.setdefault(signum, previous)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._original.items():
            try:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            except (TypeError, ValueError):
                signal.signal(signum, signal.SIG_DFL)
        self._original = {}


def under_slurm() -> bool:
    """Running as a Slurm batch job (not an interactive allocation, which a requeue would not help)."""
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this job (or array task); returns whether Slurm accepted it."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error(f"FaultTolerantCheckpoint: `scontrol requeue {job}` failed: {exc}")
        return False
    if result.returncode:
        log.error(f"FaultTolerantCheckpoint: `scontrol requeue {job}` failed: {result.stderr.strip()}")
        return False
    log.info(f"FaultTolerantCheckpoint: requeued Slurm job {job}")
    return True


def exit_after_preemption(
    trainer: pl.Trainer, step: int, *, saved: bool, requeue: bool, newest: str, report: Callable[[str], Any]
) -> NoReturn:
    """Every rank: exit 75 after a save that succeeded (requeued under Slurm), 74 after one that failed."""
    if not saved:
        report(
            f"FaultTolerantCheckpoint: preemption at step {step}: the save FAILED (see above); the newest valid"
            f" checkpoint is {newest or 'none'}. Not requeued; exiting with code {PREEMPTION_SAVE_FAILED_EXIT_CODE}."
        )
        raise SystemExit(PREEMPTION_SAVE_FAILED_EXIT_CODE)
    requeued = requeue and trainer.is_global_zero and requeue_slurm_job()
    rank_zero_info(
        f"FaultTolerantCheckpoint: saved step {step} after a preemption signal; exiting with code"
        f" {PREEMPTION_EXIT_CODE}{' (job requeued)' if requeued else ''}."
    )
    raise SystemExit(PREEMPTION_EXIT_CODE)
