"""Refusals and agreements both strategies make at set-up, each the same on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid._lightning_compat import averaging_callbacks

__all__ = ["agreed_setup", "refuse_aliased_parameters", "refuse_averaging"]


def refuse_aliased_parameters(module: torch.nn.Module, zero_stage: int) -> None:
    """Distinct Parameters on one storage (``head.weight = nn.Parameter(embed.weight)``) are one tensor to the
    model but two to ZeRO-1/2/3, which would copy or shard each on its own and so untie them. (One Parameter in
    two places is a tie the strategy keeps exact.) Checked on the whole module: every rank refuses alike."""
    if zero_stage == 0:
        return
    first: dict[tuple[int, int], tuple[str, torch.nn.Parameter]] = {}
    for name, p in module.named_parameters():
        if p.is_meta or p.numel() == 0:
            continue
        key = (p.untyped_storage().data_ptr(), p.storage_offset())
        if key in first and first[key][1] is not p:
            raise ValueError(
                f"{first[key][0]} and {name} are two Parameters over the same memory: zero_stage={zero_stage}"
                " would copy or shard each apart and untie them. Tie them as one Parameter (assign the same"
                " object, e.g. `head.weight = embed.weight`), which the strategy keeps exact, or use zero_stage=0."
            )
        first.setdefault(key, (name, p))


def agreed_setup(what: str, fn: Callable[[], Any], *, device: torch.device) -> None:
    """Run ``fn`` (user code that sees this rank's part of the model); if it fails on any rank, every rank
    raises the same error, naming the ranks, instead of the others waiting in the next collective."""
    problem = None
    try:
        fn()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
        if "empty parameter list" in str(exc):
            problem += (
                " (with a pipeline, configure_optimizers sees only this rank's stage: pass every parameter, frozen"
                " ones included, which are not stepped while frozen, or a split that gives every stage a trainable"
                " block)"
            )
    problem = agreed_problem(problem, device=device)
    if problem:
        raise RuntimeError(f"{what} failed: {problem}")


def refuse_averaging(trainer: pl.Trainer, layout: Any, *, engine: str = "") -> None:
    """Callbacks that copy the whole unsplit module and pair parameters by position cannot follow a module
    cut into stages, sharded by FSDP2 or held by another engine."""
    names = averaging_callbacks(trainer)
    if not names:
        return
    where = engine or (
        f"pipeline_parallel_size={layout.pipeline_parallel_size}"
        if layout.pipeline_parallel_size > 1
        else f"tensor_parallel_size={layout.tensor_parallel_size}"
        if layout.tensor_parallel_size > 1
        else ("zero_stage=3" if layout.zero_stage == 3 else "")
    )
    if where:
        raise ValueError(
            f"{names[0]} keeps a whole copy of the module and pairs its parameters with the module's by position;"
            f" under {where} this rank holds only part of the module, so the average would be silently wrong."
            " Use it with pipeline_parallel_size=1, tensor_parallel_size=1 and zero_stage 0, 1 or 2, or average with"
            " torch.optim.swa_utils"
            " inside the model."
        )
