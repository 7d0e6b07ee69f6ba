"""A per-rank watchdog that turns a hung step into a prompt, restartable process exit.

A rank that dies or hangs leaves its peers blocked in a collective until the process-group timeout (30
minutes by default). The watchdog thread sees that no step finished for far longer than usual, names the
ranks that are behind (each rank publishes its last finished step to the job's key-value store now and
then), and exits the process so ``torchrun --max-restarts`` or a Slurm requeue restarts the job from the
last checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from datetime import timedelta

from lightning_hybrid._torch_compat import default_store

__all__ = ["HANG_EXIT_CODE", "Watchdog"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 76
"""Exit status of a process whose watchdog found the job hung (retryable: restart from the last checkpoint)."""

_KEY = "lightning_hybrid/heartbeat/{}"


class Watchdog:
    """Exit the process when no step finishes within the limit.

    Args:
        timeout: seconds without a finished step; ``None`` derives it from the step times seen so far
            (``max(min_timeout, factor * median)``) once ``warmup`` steps have finished, and never fires before.
        rank, world_size: this process's global rank and the world size (for the report).
        on_timeout: called with the report instead of exiting (tests, custom handling).
    """

    def __init__(
        self,
        *,
        timeout: float | None,
        rank: int,
        world_size: int,
        min_timeout: float = 300.0,
        factor: float = 20.0,
        warmup: int = 5,
        on_timeout: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout, self.rank, self.world_size = timeout, rank, world_size
        self.min_timeout, self.factor, self.warmup = min_timeout, factor, warmup
        self.on_timeout = on_timeout
        self._durations: deque[float] = deque(maxlen=50)
        self._last_beat = time.monotonic()
        self._step = -1
        self._progress = -1  # 2 * last finished step, +1 once the next batch started
        self._published = -2
        self._paused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = default_store()

    def start(self) -> None:
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lightning-hybrid-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # wait for the thread to leave any store call: a thread inside C++ at interpreter exit aborts it
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def beat(self, step: int) -> None:
        """A step finished (called from the training loop; cheap: no I/O here)."""
        now = time.monotonic()
        with self._lock:
            if step != self._step:
                self._durations.append(now - self._last_beat)
            self._step, self._last_beat = step, now
            self._progress = 2 * step

    def enter(self, step: int) -> None:
        """A batch of step ``step + 1`` started: lets the report tell a rank that never got there."""
        with self._lock:
            self._progress = 2 * step + 1

    def pause(self) -> None:
        """Long non-step work follows (a synchronous save, a rollback): do not count it as a hang."""
        with self._lock:
            self._paused += 1

    def resume(self) -> None:
        with self._lock:
            self._paused = max(0, self._paused - 1)
            self._last_beat = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Generator[None, None, None]:
        """Checkpoint I/O or a rollback inside: however long it takes, it is not a hung step."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def limit(self) -> float | None:
        if self.timeout is not None:
            return self.timeout
        if len(self._durations) < self.warmup:
            return None
        return max(self.min_timeout, self.factor * statistics.median(self._durations))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                step, waited, paused = self._step, time.monotonic() - self._last_beat, self._paused
                progress = self._progress
            self._publish(progress)
            limit = self.limit()
            if paused or limit is None or waited <= limit:
                continue
            self._fire(self._report(step, waited, limit))
            return

    def _report(self, step: int, waited: float, limit: float) -> str:
        usual = f"{statistics.median(self._durations):.2f}s" if self._durations else "unknown"
        progress = self._peer_progress()
        behind = ""
        if progress:
            lowest = min(progress.values())
            stuck = sorted(r for r, p in progress.items() if p == lowest)
            where = {r: _describe(p) for r, p in sorted(progress.items())}
            behind = f"; progress per rank: {where}; stuck: rank(s) {stuck}"
        return (
            f"[rank {self.rank}] watchdog: no training step finished for {waited:.0f}s (limit {limit:.0f}s, usual"
            f" step {usual}, this rank's last finished step {step}){behind}. Exiting with code {HANG_EXIT_CODE}"
            " so the launcher can restart the job from the last checkpoint."
        )

    def _fire(self, report: str) -> None:
        if self.on_timeout is not None:
            self.on_timeout(report)
            return
        log.error(report)
        print(report, file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    def _publish(self, progress: int) -> None:
        if self._store is None or progress == self._published:
            return
        try:
            self._store.set(_KEY.format(self.rank), str(progress))
            self._published = progress
        except Exception:  # a lost store only costs the report its detail
            self._store = None

    def _peer_progress(self) -> dict[int, int]:
        if self._store is None:
            return {}
        steps = {}
        for r in range(self.world_size):
            try:
                self._store.wait([_KEY.format(r)], timedelta(seconds=2))
                steps[r] = int(self._store.get(_KEY.format(r)))
            except Exception:
                steps[r] = -1  # never published: it has not even started
        return steps


def _describe(progress: int) -> str:
    if progress < 0:
        return "not started"
    step, inside = divmod(progress, 2)
    return f"inside step {step + 1}" if inside else f"finished step {step}"
