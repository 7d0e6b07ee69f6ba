"""Cross-rank agreement: one small all-reduce that makes a per-rank observation a job-wide decision.

Used wherever ranks must take the same branch (preemption, non-finite values, checkpoint readiness, loss
scaling): if ranks decided alone, one would save or skip while another waits in a collective, and the job
would hang or silently diverge. Every caller packs its flags into one tensor so a decision costs one
all-reduce (a host sync point: call it once per step, not per tensor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree", "agreed_problem", "all_finite", "distributed_ready", "raise_agreed"]


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(
    values: Sequence[float],
    *,
    op: Literal["max", "min", "sum"] = "max",
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """Reduce ``values`` element-wise over ``group`` (default: the world); identical result on every rank.

    ``device`` must be where the backend communicates (CUDA for NCCL); without a process group the values
    come back unchanged, so single-device code takes the same path.
    """
    if not distributed_ready():
        return [float(v) for v in values]
    if device is None:
        device = _comm_device(group)
    buf = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}[op]
    dist.all_reduce(buf, op=reduce_op, group=group)
    return buf.tolist()


def agreed_problem(
    problem: str | None, *, device: torch.device | None = None, group: dist.ProcessGroup | None = None
) -> str | None:
    """What went wrong on any rank of ``group``, the same text on every rank (``None`` when nothing did).

    One all-reduce when all is well; the messages are gathered only when some rank has one. Ranks with the
    same message are named together, so a problem every rank saw reads once.
    """
    if problem is not None and not problem:
        problem = "failed without a message"  # an empty message is still a failure
    (ok,) = agree([0.0 if problem is not None else 1.0], op="min", device=device, group=group)
    if ok:
        return None
    if not distributed_ready():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    ranks: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p:
            ranks.setdefault(p, []).append(r)
    if len(problems) == 1:
        return next(iter(ranks))
    return "; ".join(f"{p} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})" for p, rs in ranks.items())


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of every (local) tensor is finite; DTensors are checked on their local shard."""
    flags = [torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in tensors]
    if not flags:
        return True
    return bool(torch.stack(flags).all())  # one host sync for all tensors


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    # gloo reduces host tensors; device backends (NCCL, ...) need a tensor on the current accelerator
    if str(dist.get_backend(group)) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def raise_agreed(
    problem: str | None, error: type[Exception] = ValueError, *, device: torch.device | None = None
) -> None:
    """Raise ``error`` with what went wrong on any rank, on every rank (:func:`agreed_problem`); nothing when
    no rank had a problem."""
    problem = agreed_problem(problem, device=device)
    if problem:
        raise error(problem)
