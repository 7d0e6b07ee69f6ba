"""What to do when a step's gradients or loss are not finite: skip the update, roll back, or raise.

The verdict is agreed across ranks (one rank's NaN is every rank's NaN), so all ranks take the same
branch: a rank that skipped while another stepped would silently diverge.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.optim import Optimizer

from lightning_hybrid._agree import agree, all_finite
from lightning_hybrid._protocols import ShardedCheckpointing
from lightning_hybrid.callbacks._resume_choice import agreed_verdict
from lightning_hybrid.checkpoint._safe_load import load_payload
from lightning_hybrid.checkpoint._store import StepFolder, parse_step_name

__all__ = ["NanPolicy", "NanPolicyName", "roll_back"]

log = logging.getLogger(__name__)

NanPolicyName = Literal["skip", "rollback", "raise"]


class NanPolicy:
    """Detects non-finite gradients before the optimizer step and applies the policy after it.

    Args:
        policy: ``"skip"``, ``"rollback"`` or ``"raise"``.
        max_rollbacks: raise after this many rollbacks.
        report: where events are reported (once per job).
    """

    def __init__(self, policy: NanPolicyName, *, max_rollbacks: int, report: Callable[[str], Any]) -> None:
        self.policy = policy
        self.max_rollbacks = max_rollbacks
        self.report = report
        self.rollbacks = 0
        self.nonfinite_steps = 0
        self.now = False  # the current step's update was dropped

    def check_gradients(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        """Before the optimizer step: agree whether any rank's gradient is non-finite; drop them if so."""
        self.now = False
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = agree([0.0 if all_finite(p.grad for p in params) else 1.0], device=trainer.strategy.root_device)[0]
        if not bad:
            return
        self.now = True
        if self.policy in ("skip", "rollback"):
            for p in params:
                p.grad = None  # torch optimizers leave parameters without a gradient (and their state) alone

    def skipped_last_step(self) -> bool:
        return self.now  # the update was dropped: the LR schedule does not advance either

    def after_step(self, step: int, *, rollback: Callable[[], str | None]) -> None:
        """After a step whose loss or gradients were non-finite (agreed): apply the policy.

        ``rollback()`` restores model and optimizer from the newest checkpoint and returns where it came
        from (``None`` when there is none yet).
        """
        self.nonfinite_steps += 1
        what = f"non-finite loss or gradients at step {step} (seen by at least one rank; all ranks agree)"
        if self.policy == "raise":
            raise FloatingPointError(f"FaultTolerantCheckpoint: {what}; nan_policy='raise'.")
        if self.policy == "skip":
            self.report(f"FaultTolerantCheckpoint: {what}; the update was skipped.")
            return
        if self.rollbacks >= self.max_rollbacks:
            raise FloatingPointError(
                f"FaultTolerantCheckpoint: {what}, after {self.rollbacks} rollbacks (max_rollbacks="
                f"{self.max_rollbacks}); giving up. Lower the learning rate or inspect the data near this step."
            )
        source = rollback()
        if source is None:
            raise FloatingPointError(f"FaultTolerantCheckpoint: {what}, and no checkpoint to roll back to yet.")
        self.rollbacks += 1
        self.report(
            f"FaultTolerantCheckpoint: {what}; rolled back model and optimizer to {source}"
            f" (rollback {self.rollbacks}/{self.max_rollbacks}); the data since that checkpoint is skipped."
        )


def roll_back(trainer: pl.Trainer, target: Path) -> str:
    """Model and optimizer state from ``target``, a checkpoint of this run (verified again first, with every
    rank); the step counter, LR schedule and data go on. Returns the checkpoint's folder."""
    folder_path = target if target.is_dir() else target.parent
    parsed = parse_step_name(folder_path.name)
    assert parsed is not None, folder_path
    why = agreed_verdict(trainer, StepFolder(*parsed, folder_path))
    if why is not None:
        raise FloatingPointError(f"FaultTolerantCheckpoint: cannot roll back to {folder_path}: {why}.")
    _restore_weights(trainer, target)
    return str(folder_path)


def _restore_weights(trainer: pl.Trainer, target: Path) -> None:
    strategy = trainer.strategy
    # the optimizer's state comes back, its hyperparameters (the scheduled LR) stay those of now
    hyper = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in trainer.optimizers]
    if isinstance(strategy, (ModelParallelStrategy, ShardedCheckpointing)):
        strategy.load_checkpoint(target)  # loads in place, resharding as needed
    else:
        checkpoint = load_payload(target)
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)
    for optimizer, groups in zip(trainer.optimizers, hyper):
        for group, saved in zip(optimizer.param_groups, groups):
            group.update(saved)
