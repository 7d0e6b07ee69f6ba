"""In-place restarts under ``torchrun --max-restarts`` with a clean rendezvous store.

torchrun restarts the workers of a failed job in place, and the restarted workers meet again in the
agent's key-value store, which still holds the previous attempt's entries. gloo reads a peer's address
from there and can pick up the dead process's one (``Gloo connectFullMesh failed ... Connection
refused``): on torch 2.13 most in-place restarts failed that way. A restarted worker therefore forms its
process group through a fresh store that global rank 0 hosts on ``MASTER_PORT + 1 + attempt`` (on the
same host as the agent's store), which holds only this attempt's keys, after a short pause. First
attempts are untouched.

It must run before the process group exists, so the pack's components that are built before the
``Trainer`` (the strategy and the checkpoint callback) call it from their constructors. It only changes
the environment of a worker torchrun restarted.
"""

from __future__ import annotations

import os
import time

__all__ = ["prepare_elastic_restart"]

_DONE = "LIGHTNING_HYBRID_FRESH_STORE"
RESTART_PAUSE_S = 2.0


def prepare_elastic_restart() -> bool:
    """Point a torchrun-restarted worker at a fresh rendezvous store; True if it did (once per process)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    # done once per process: the marker names this process, so one inherited from a parent (a launcher
    # that itself imported the pack) cannot turn the redirect off in the workers it starts
    if os.environ.get(_DONE, "").startswith(f"{os.getpid()}:") or "MASTER_PORT" not in os.environ:
        return False
    port = int(os.environ["MASTER_PORT"]) + 1 + attempt
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    os.environ[_DONE] = f"{os.getpid()}:{port}"
    # and let the previous attempt's sockets close first: without this pause the re-initialisation still
    # failed now and then (gloo connecting to a peer address that was not listening yet)
    time.sleep(RESTART_PAUSE_S)
    return True
