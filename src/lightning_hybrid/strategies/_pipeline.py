"""Cutting a LightningModule into pipeline stages and building the torch schedule that runs them.

Stages are made by keeping this rank's blocks of ``module.layers`` under their original names, so every
parameter keeps the fully-qualified name it has in the unsplit module and checkpoints do not depend on
the layout they were written with.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.checkpoint import checkpoint

from lightning_hybrid._torch_compat import side_effect_free_stage
from lightning_hybrid.strategies._layout import (
    SCHEDULES,
    Layout,
    PipelineSplit,
    partition_layers,
    stage_ids_on_rank,
)

__all__ = [
    "PipelineStageModule",
    "build_schedule",
    "check_pipeline_contract",
    "contract_batch",
    "split_module",
    "stage_ranges",
]


class PipelineStageModule(nn.Module):
    """Runs a consecutive run of blocks; the unit a ``PipelineStage`` (and FSDP's root) wraps."""

    def __init__(self, blocks: list[nn.Module], activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.activation_checkpointing = activation_checkpointing

    def forward(self, *args: Tensor) -> Any:
        out: Any = args if len(args) > 1 else args[0]
        for block in self.blocks:
            inputs = out if isinstance(out, tuple) else (out,)
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                # recompute this block's activations in backward instead of keeping them (memory for compute)
                out = checkpoint(block, *inputs, use_reentrant=False)
            else:
                out = block(*inputs)
        return out


def check_pipeline_contract(module: nn.Module) -> None:
    """Raise a ``TypeError`` that says what to add when ``module`` cannot be pipelined."""
    name = type(module).__name__
    layers = getattr(module, "layers", None)
    if not isinstance(layers, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"{name} cannot be pipelined: keep its pipeline-splittable blocks, in order, in `self.layers` (an"
            " nn.Sequential, nn.ModuleList or nn.ModuleDict whose blocks take and return tensors), or use"
            " pipeline_parallel_size=1."
        )
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"{name} cannot be pipelined: define `pipeline_loss(self, output, target) -> Tensor` returning the"
            " mean loss over a micro-batch, or use pipeline_parallel_size=1."
        )
    inside = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise TypeError(
            f"{name} has trainable parameters outside `self.layers` ({', '.join(outside[:3])}"
            f"{', ...' if len(outside) > 3 else ''}) that no pipeline stage would own; move them into a block"
            " of `self.layers`."
        )


def contract_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch as the contract reads it: ``pipeline_batch(batch)`` when the module
    defines it, else ``(batch[0], batch[1])``."""
    fn = getattr(module, "pipeline_batch", None)  # optional in the contract
    return fn(batch) if callable(fn) else (batch[0], batch[1])


_CUT: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules whose `layers` hold only some stages' blocks


def refuse_cut_module(module: nn.Module) -> None:
    """A module an earlier Trainer cut into this rank's stages cannot be cut again (a second cut would keep
    a stage of the stage, silently); every rank sees the same."""
    if module in _CUT:
        raise RuntimeError(
            f"This {type(module).__name__} was cut into pipeline stages by an earlier Trainer (fit, validate or test"
            " with a pipeline): its `layers` hold only this rank's blocks. Build a fresh module for a new Trainer,"
            " or run fit, validate and test on the same Trainer."
        )


def mark_cut(module: nn.Module) -> None:
    _CUT.add(module)


def stage_ranges(module: nn.Module, layout: Layout, split: PipelineSplit | None) -> list[range]:
    """The blocks of ``module.layers`` each stage runs (balanced by parameter count unless ``split`` says)."""
    costs = [float(sum(p.numel() for p in block.parameters())) or 1.0 for block in module.layers.children()]
    return partition_layers(costs, layout.num_stages, split)


def split_module(
    module: nn.Module,
    *,
    layout: Layout,
    pp_rank: int,
    split: PipelineSplit | None,
    activation_checkpointing: bool,
) -> tuple[list[int], list[PipelineStageModule], list[range]]:
    """Keep only this rank's blocks in ``module.layers`` (original names) and wrap each local stage.

    Returns the local stage indices, their stage modules, and the block ranges of all stages.
    """
    refuse_cut_module(module)
    items = list(module.layers.named_children())
    ranges = stage_ranges(module, layout, split)
    stage_ids = stage_ids_on_rank(pp_rank, layout)
    stages, kept = [], {}
    for sid in stage_ids:
        blocks = [items[i][1] for i in ranges[sid]]
        stages.append(PipelineStageModule(blocks, activation_checkpointing))
        kept.update({items[i][0]: items[i][1] for i in ranges[sid]})
    # parameter names stay `layers.<original index>.*`, as in the unsplit module
    module.layers = nn.ModuleDict(sorted(kept.items(), key=lambda kv: [n for n, _ in items].index(kv[0])))
    mark_cut(module)
    return stage_ids, stages, ranges


def build_schedule(
    *,
    layout: Layout,
    stage_ids: list[int],
    stage_modules: list[nn.Module],
    device: torch.device,
    group: dist.ProcessGroup,
    loss_fn: Callable[[Any, Tensor], Tensor],
    inference: tuple[Callable[[], None], Callable[[], None]],
) -> tuple[Any, list[PipelineStage]]:
    """Wrap the local stage modules in ``PipelineStage`` objects and build the named torch schedule.
    ``inference``: what runs before the stages' shape inference and after it (to undo its effects)."""
    spec = SCHEDULES[layout.schedule]
    stage_class = side_effect_free_stage(PipelineStage, *inference)
    stages = [
        stage_class(mod, stage_index=sid, num_stages=layout.num_stages, device=device, group=group)
        for sid, mod in zip(stage_ids, stage_modules)
    ]
    schedule_class = get_schedule_class(spec.torch_name)
    target = stages if spec.multi_stage else stages[0]
    # no scaling by the schedule: it would divide the whole .grad, including what earlier micro-batches of an
    # accumulation window left there; `loss_fn` divides each micro-batch's loss instead
    schedule = schedule_class(target, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule, stages
