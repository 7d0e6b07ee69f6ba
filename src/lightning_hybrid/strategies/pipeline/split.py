"""Cutting a LightningModule into pipeline stages and building the torch schedule that runs them.

Stages are made by keeping this rank's blocks of ``module.layers`` under their original names, so every
parameter keeps the fully-qualified name it has in the unsplit module and checkpoints do not depend on
the layout they were written with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.checkpoint import checkpoint

from lightning_hybrid._torch_compat import side_effect_free_stage
from lightning_hybrid.contract import mark_cut, refuse_cut_module
from lightning_hybrid.strategies._layout import SCHEDULES, Layout, stage_ids_on_rank
from lightning_hybrid.strategies.pipeline.partition import PipelineSplit, partition_layers

__all__ = [
    "describe_stages",
    "PipelineStageModule",
    "build_schedule",
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


def stage_ranges(module: nn.Module, layout: Layout, split: PipelineSplit | None) -> list[range]:
    """The blocks of ``module.layers`` each stage runs (balanced by parameter count unless ``split`` says)."""
    costs = [float(sum(p.numel() for p in block.parameters())) or 1.0 for block in module.layers.children()]
    return partition_layers(costs, layout.num_stages, split)


def describe_stages(module: nn.Module, ranges: list[range]) -> str:
    """One line per stage (its blocks, their classes, its parameters) and the whole model's parameter count,
    tied parameters once: what Lightning's model summary cannot show once each rank holds one stage."""
    blocks = list(module.layers.children())
    seen: set[int] = set()

    def count(params) -> int:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return sum(p.numel() for p in fresh)

    lines = []
    for sid, r in enumerate(ranges):
        kinds = sorted({type(blocks[i]).__name__ for i in r})
        n = count(p for i in r for p in blocks[i].parameters())
        lines.append(f"  stage {sid}: blocks {r.start}-{r.stop - 1} ({', '.join(kinds)}), {_human(n)} parameters")
    outside = count(module.parameters())
    total = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    tail = f" ({_human(outside)} outside self.layers)" if outside else ""
    return "\n".join([f"pipeline stages of {type(module).__name__}: {_human(total)} parameters{tail}", *lines])


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


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
