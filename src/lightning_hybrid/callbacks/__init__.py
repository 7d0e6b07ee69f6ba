"""Lightning callbacks of lightning-hybrid."""

from lightning_hybrid.callbacks._accumulation import Ramp
from lightning_hybrid.callbacks._resume import ResumableSampler
from lightning_hybrid.callbacks.accumulation import AccumulationScheduler
from lightning_hybrid.callbacks.fault_tolerant import (
    HANG_EXIT_CODE,
    PREEMPTION_EXIT_CODE,
    PREEMPTION_SAVE_FAILED_EXIT_CODE,
    FaultTolerantCheckpoint,
)

__all__ = [
    "HANG_EXIT_CODE",
    "PREEMPTION_EXIT_CODE",
    "PREEMPTION_SAVE_FAILED_EXIT_CODE",
    "AccumulationScheduler",
    "FaultTolerantCheckpoint",
    "Ramp",
    "ResumableSampler",
]
