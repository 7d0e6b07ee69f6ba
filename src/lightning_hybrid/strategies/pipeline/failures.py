"""A failure inside a pipeline schedule on some stages, raised on every rank with the same message.

A stage that raises (a block that breaks the pipeline contract, torch refusing reentrant activation
checkpointing inside a stage) leaves the other stages blocked in the schedule's point-to-point messages:
they learn of it only when the failing process exits and its connections close, as gloo's "Connection closed
by peer" (NCCL: when its timeout ends them), which says nothing of the cause. So the first rank whose schedule
raises posts its message in the job's key-value store before it raises; every rank of the pipeline watches
that key from a thread (one check a second), so the message is known even when the store lived in the failing
process; a rank whose schedule then fails raises the posted message instead of its transport error. The
failing rank waits (at most ``ACK_TIMEOUT`` seconds) until every other rank has read it.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch.distributed as dist

from lightning_hybrid._torch_compat import default_store

__all__ = ["ACK_TIMEOUT", "PipelineFailures", "describe"]

ACK_TIMEOUT = 10.0
_POLL = 1.0
_RUNNERS = itertools.count()  # one key per pipeline in a process: the same numbering on every rank


class PipelineFailures:
    """One pipeline's failure board. ``failed(exc)`` is called where a schedule raised; raise what it returns."""

    def __init__(self, *, stages: list[int]) -> None:
        self.stages = stages
        self.key = f"lightning_hybrid/pipeline/{next(_RUNNERS)}/failure"
        self.store = default_store()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.message: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """Start watching (once; a no-op without a store or a second rank)."""
        if self._thread is not None or self.store is None or self.world == 1:
            return
        self._thread = threading.Thread(target=self._poll, name="lightning-hybrid-pipeline-failures", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.wait(_POLL):
            try:
                if self.message is None and self.store.check([self.key]):
                    self._read()
                    return
            except Exception:  # the store went away with its process: the main thread will hear of it
                return

    def _read(self) -> None:
        assert self.store is not None
        self.message = self.store.get(self.key).decode()
        self.store.add(f"{self.key}/read", 1)

    def failed(self, exc: Exception) -> Exception:
        """The exception to raise for ``exc``, raised by this rank's schedule: the job's first posted failure."""
        if self.store is None or self.world == 1:
            return exc
        if self.message is not None:
            return RuntimeError(self.message)
        ours = f"{describe(exc)} (raised on rank {self.rank}, pipeline stage {self.stages})"
        self.message = ours  # first: the watching thread must not count this rank as a reader of its own
        try:
            winner = self.store.compare_set(self.key, "", ours).decode()
        except Exception:  # no store to agree through (its process ended): this rank's own error
            return exc
        if winner != ours:  # another rank failed first: this is a consequence of it
            self.message = winner
            self.store.add(f"{self.key}/read", 1)
            return RuntimeError(winner)
        deadline = time.monotonic() + ACK_TIMEOUT
        while time.monotonic() < deadline:  # the store may live in this process: let every rank read it
            if self.store.add(f"{self.key}/read", 0) >= self.world - 1:
                break
            time.sleep(0.1)
        return RuntimeError(ours)


def describe(exc: BaseException) -> str:
    """``exc`` named by its root cause: torch's stages wrap a block's own error ("[Stage 1] failed to run
    forward: args ...") and keep it as ``__cause__``; the user's error comes first, torch's context after."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    if root is exc:
        return f"{type(exc).__name__}: {exc}"
    context = " ".join(str(exc).split())
    context = context if len(context) <= 160 else context[:157] + "..."
    return f"{type(root).__name__}: {root} (inside torch's {type(exc).__name__}: {context})"
