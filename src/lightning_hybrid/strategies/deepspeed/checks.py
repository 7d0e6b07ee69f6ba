"""What DeepSpeedPipelineStrategy refuses before it builds DeepSpeed's engine, each with what to use instead."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from lightning_hybrid._lightning_compat import group_adding_callbacks
from lightning_hybrid._protocols import ChecksItsStrategy, TakesTensorPartition
from lightning_hybrid.contract import check_pipeline_contract, find_ties
from lightning_hybrid.strategies._checks import refuse_averaging
from lightning_hybrid.strategies._user_code import user_gradient_code
from lightning_hybrid.strategies.deepspeed.config import precision_kind

__all__ = ["optimizer_problem", "refuse_unsupported"]


def refuse_unsupported(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    plugin: Precision,
    strategy: Any,
    *,
    zero_stage: int,
    num_microbatches: int,
    device: torch.device,
) -> None:
    """Raise, with what to use instead, for what DeepSpeed's engine cannot run as the Trainer asks. Reads
    only what every rank has, so every rank raises the same error. Callbacks that cannot work inside the engine
    refuse themselves (``StepsInsideTrainingStep``); the precision plugin is asked here (``ChecksItsStrategy``)."""
    check_pipeline_contract(module)
    if trainer.state.fn == TrainerFn.FITTING:
        refuse_averaging(trainer, None, engine="DeepSpeedPipelineStrategy")
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} uses manual optimization; DeepSpeed's engine runs forward, backward and"
                " the optimizer step of every batch in place of training_step. Use automatic optimization."
            )
        user = user_gradient_code(trainer, module)
        if user.after_backward or user.before_step:
            raise ValueError(
                "on_after_backward, on_before_optimizer_step or configure_gradient_clipping is overridden (by"
                f" {type(module).__name__} or a callback), and DeepSpeed's engine runs forward, backward and the"
                " optimizer step of every batch inside training_step: those hooks would run after the step, where"
                " editing or reading a gradient changes nothing. Use HybridParallelStrategy, under which they see"
                " the gradient before the step; or move the code out of those hooks."
            )
        adding = group_adding_callbacks(trainer)
        if adding:
            raise ValueError(
                f"{adding[0]} adds param groups to the optimizer during training; DeepSpeed's engine partitions and"
                " reduces only the groups it was built with. Put every parameter in the optimizer from the start, or"
                " use HybridParallelStrategy, which shards groups added later."
            )
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"{', '.join(scalars[:3])} {'is a 0-dim parameter' if len(scalars) == 1 else 'are 0-dim parameters'}:"
            " DeepSpeed's engine fails on them when it broadcasts the model (one rank raises while the others"
            " wait). Make each a 1-D tensor of one element, or use HybridParallelStrategy, which keeps them exact."
        )
    on_meta = [n for n, p in module.named_parameters() if p.is_meta]
    if on_meta:
        raise ValueError(
            f"{on_meta[0]} is on the meta device: DeepSpeedPipelineStrategy builds its stages from materialised"
            " blocks. Build the model normally, or use HybridParallelStrategy, which materialises only each"
            " rank's own blocks."
        )
    ties = find_ties(module)
    if ties:
        raise ValueError(
            f"{ties[0].names} are one parameter in two places; DeepSpeedPipelineStrategy does not build"
            " DeepSpeed's TiedLayerSpec from self.layers, so each stage would train its own copy. Use"
            " HybridParallelStrategy, which keeps tied parameters exact across stages."
        )
    if isinstance(plugin, ChecksItsStrategy):
        plugin.check_strategy(strategy)
    if type(plugin) not in (Precision, MixedPrecision):
        raise ValueError(
            f"DeepSpeedPipelineStrategy runs precision '32-true', '16-mixed' or 'bf16-mixed' inside DeepSpeed's"
            f" engine; {type(plugin).__name__} ({plugin.precision}) cannot."
        )
    kind = precision_kind(plugin.precision)
    if kind == "fp16" and device.type == "cpu":
        raise ValueError("DeepSpeed has no fp16 on CPU: use precision='bf16-mixed' or '32-true' there.")
    if kind == "fp16" and zero_stage == 0:
        raise ValueError(
            "fp16 with zero_stage=0 keeps DeepSpeed's fp32 master weights where the pack's checkpoints cannot"
            " read them; use zero_stage=1 (the same memory per stage for the weights, sharded optimizer state)."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): DeepSpeed's pipeline"
            " accumulates the micro-batches of one batch itself; set num_microbatches instead (now"
            f" {num_microbatches})."
        )
    if trainer.gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(f"DeepSpeed clips gradients by their norm only, not by {trainer.gradient_clip_algorithm!r}.")


def optimizer_problem(optimizer: Optimizer | None, *, zero_stage: int, precision: str, stage: int) -> str | None:
    """Why DeepSpeed's optimizer wrappers would step ``optimizer`` differently from a single process, or None.
    Depends on this stage's parameter groups: agree on it across ranks."""
    if optimizer is None:
        return None
    problem = None
    empty = [i for i, group in enumerate(optimizer.param_groups) if not group["params"]]
    if empty:  # a group whose parameters all sit on other stages: DeepSpeed drops it, the LR scheduler not
        problem = (
            f"param group(s) {empty} of {type(optimizer).__name__} hold no parameter of stage"
            f" {stage}'s blocks; DeepSpeed drops empty groups and the LR scheduler would then set"
            " the wrong groups' LR. Group parameters so every stage has some in each group, or use"
            " HybridParallelStrategy"
        )
    flat = zero_stage >= 1 or precision_kind(precision) is not None
    if flat and problem is None:
        from lightning_hybrid.optim._shardable import is_elementwise

        name = type(optimizer).__name__
        if isinstance(optimizer, TakesTensorPartition):
            problem = (
                f"{name} takes per-tensor norms, and DeepSpeed's ZeRO-1 and mixed-precision optimizers step one"
                " flat partition of all tensors; use zero_stage=0 in fp32, or HybridParallelStrategy, which tells"
                f" {name} each tensor's bounds under every ZeRO stage"
            )
        elif not is_elementwise(optimizer):
            problem = (
                f"{name} is not known to be element-wise, and DeepSpeed's ZeRO-1 and mixed-precision optimizers"
                " step it on a flat partition that cuts across tensors; use zero_stage=0 in fp32, an element-wise"
                " optimizer (SGD, Adam, AdamW, ...), or declare it with lightning_hybrid.optim.register_elementwise"
            )
    return problem
