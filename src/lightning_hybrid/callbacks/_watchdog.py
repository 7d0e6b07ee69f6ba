"""A per-rank watchdog that turns a hung step into a prompt, restartable process exit.

A rank that dies or hangs leaves its peers blocked in a collective until the process-group timeout (30
minutes by default). The watchdog thread sees that no step finished for far longer than usual, names the
ranks that are behind (each rank publishes its last finished step to the job's key-value store now and
then), and exits the process so ``torchrun --max-restarts`` or a Slurm requeue restarts the job from the
last checkpoint.

Checkpoint I/O does not count as a hung step, however long it takes, as long as every peer is alive: each
rank's watchdog thread also publishes a heartbeat, and a rank that has waited past the limit inside checkpoint
I/O (a save's commit waits on every rank) exits when a peer's heartbeat stopped for the limit (a stopped or
hung process; a process that died breaks the collective by itself). Store calls run on a thread of their own:
a store whose host process is stopped never answers, and the watchdog must not wait on it.
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
from typing import TypeVar

import torch.distributed as dist

from lightning_hybrid._torch_compat import default_store

__all__ = ["HANG_EXIT_CODE", "Watchdog"]

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 76
"""Exit status of a process whose watchdog found the job hung (retryable: restart from the last checkpoint)."""

T = TypeVar("T")
_KEY = "lightning_hybrid/heartbeat/{}"
_ALIVE = "lightning_hybrid/alive/{}"


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
        self._store = _Calls(default_store())
        self._ticks = 0  # heartbeats published
        self._peers: dict[int, tuple[str, float]] = {}  # rank -> (heartbeat seen, when it last changed)

    def start(self) -> None:
        self._last_beat = time.monotonic()
        self._publish(self._progress, None)  # at once: a rank may stop before the thread's first turn
        self._thread = threading.Thread(target=self._run, name="lightning-hybrid-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # wait for the threads to leave any store call: a thread inside C++ at interpreter exit aborts it
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._store.join(timeout=5.0)

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
            limit = self.limit()
            self._publish(progress, limit)
            if limit is None or waited <= (limit / 2 if paused else limit):
                self._peers.clear()
                continue
            if not paused:
                self._fire(self._report(step, waited, limit))
                return
            silent = self._silent_peers(limit)  # checkpoint I/O: a hang only if a peer stopped answering
            if silent and waited > limit:
                self._fire(self._report(step, waited, limit, silent=silent))
                return

    def _silent_peers(self, limit: float) -> str:
        """Why peers count as hung (empty if none): heartbeats unchanged for ``limit`` seconds, or a store that
        has not answered for that long (its host, rank 0, is stopped)."""
        now = time.monotonic()
        stuck = self._store.busy_for()
        if stuck > limit:
            return f"the job's key-value store (hosted by rank 0) has not answered for {stuck:.0f}s"
        keys = [_ALIVE.format(r) for r in range(self.world_size)]
        beats = self._store.call(lambda store: _read(store, keys), timeout=2.0)
        for r, beat in enumerate(beats or []):  # a rank never heard from (None) counts from the first look
            if r not in self._peers or self._peers[r][0] != beat:
                self._peers[r] = (beat, now)
        silent = sorted(r for r, (_, since) in self._peers.items() if r != self.rank and now - since > limit)
        if not silent:
            return ""
        return f"rank(s) {silent} sent no heartbeat for over {limit:.0f}s (stopped or hung)"

    def _publish(self, progress: int, limit: float | None) -> None:
        every = 5.0 if limit is None else min(10.0, max(1.0, limit / 8))
        self._ticks += 1
        beat = (self._ticks - 1) % max(1, round(every)) == 0
        if progress == self._published and not beat:
            return
        if self._store.busy_for() > 0:
            return  # the last call has not come back: its store is slow or gone
        keys, values = [_KEY.format(self.rank), _ALIVE.format(self.rank)], [str(progress), str(self._ticks)]
        self._store.call(lambda store: store.multi_set(keys, values), timeout=0.05)
        self._published = progress

    def _report(self, step: int, waited: float, limit: float, silent: str = "") -> str:
        usual = f"{statistics.median(self._durations):.2f}s" if self._durations else "unknown"
        progress = self._peer_progress()
        behind = ""
        if progress:
            lowest = min(progress.values())
            stuck = sorted(r for r, p in progress.items() if p == lowest)
            where = {r: _describe(p) for r, p in sorted(progress.items())}
            behind = f"; progress per rank: {where}; stuck: rank(s) {stuck}"
        if silent:
            behind += f"; this rank waits in checkpoint I/O and {silent}"
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

    def _peer_progress(self) -> dict[int, int]:
        keys = [_KEY.format(r) for r in range(self.world_size)]
        values = self._store.call(lambda store: _read(store, keys), timeout=5.0)
        # never published: it has not even started
        return {r: int(v) if v is not None else -1 for r, v in enumerate(values)} if values else {}


def _read(store: dist.Store, keys: list[str]) -> list[str | None]:
    """The values of ``keys`` (``None`` for a key not set), without waiting for a missing key to appear."""
    if store.check(keys):
        return [v.decode() for v in store.multi_get(keys)]
    return [store.get(k).decode() if store.check([k]) else None for k in keys]


class _Calls:
    """Calls on a store, each on a thread of its own, one at a time, waited for at most ``timeout``.

    A store call on a stopped host blocks for the store's own timeout (30 minutes by default); here the caller
    gets ``None`` instead, and ``busy_for`` says how long the call still in flight has been waiting.
    """

    def __init__(self, store: dist.Store | None) -> None:
        self._store = store
        self._thread: threading.Thread | None = None
        self._since = 0.0

    def busy_for(self) -> float:
        return time.monotonic() - self._since if self._thread is not None and self._thread.is_alive() else 0.0

    def call(self, fn: Callable[[dist.Store], T], *, timeout: float) -> T | None:
        if self._store is None or self.busy_for() > 0:
            return None
        result: list[T] = []
        store = self._store

        def run() -> None:
            try:
                result.append(fn(store))
            except Exception:  # a lost store only costs the report its detail
                self._store = None

        self._thread, self._since = (
            threading.Thread(target=run, name="lightning-hybrid-store", daemon=True),
            time.monotonic(),
        )
        self._thread.start()
        self._thread.join(timeout)
        return result[0] if result else None

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def _describe(progress: int) -> str:
    if progress < 0:
        return "not started"
    step, inside = divmod(progress, 2)
    return f"inside step {step + 1}" if inside else f"finished step {step}"
