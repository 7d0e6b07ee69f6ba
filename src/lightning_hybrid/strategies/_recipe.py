"""HybridParallelStrategy's set-up recipe, applied once per module: every technique in its order.

Check the pipeline contract and the tied parameters, cut this rank's stages, materialise a meta-built
model block by block, cast and move it, shard it (ZeRO-3), read pretrained weights into what this rank
holds, build the pipeline runner, and pick the gradient synchronisation of the ZeRO stage. Every
verdict is computed from the whole module and the layout, so a refusal is the same on every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid.checkpoint.pretrained import PretrainedWeights, agreed_load, agreed_plan
from lightning_hybrid.checkpoint.tied_names import CheckpointNames
from lightning_hybrid.contract import check_pipeline_contract, find_ties
from lightning_hybrid.strategies._checks import refuse_aliased_parameters
from lightning_hybrid.strategies._layout import DP_AXIS, PP_AXIS, SCHEDULES, TP_AXIS, Layout
from lightning_hybrid.strategies._materialize import has_meta_tensors, materialize_module, tied_on_meta
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss, counted_loss
from lightning_hybrid.strategies.pipeline.partition import PipelineSplit
from lightning_hybrid.strategies.pipeline.runner import PipelineRunner, pipeline_loss_scaling
from lightning_hybrid.strategies.pipeline.split import describe_stages, split_module, stage_ranges
from lightning_hybrid.strategies.pipeline.tied import TiedGradients, check_ties
from lightning_hybrid.strategies.tensor.check import PlanCheck
from lightning_hybrid.strategies.tensor.local import tensor_slice, whole_on_every_rank
from lightning_hybrid.strategies.tensor.plan import SequenceCheck, plan_blocks
from lightning_hybrid.strategies.zero.buffers import make_replicas_identical
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import (
    ShardingPlan,
    UnitGradients,
    UnitRule,
    check_fully_shardable,
    planned_units,
    shard_fully,
)
from lightning_hybrid.strategies.zero.grad_sync import GradientSync
from lightning_hybrid.strategies.zero.stages import gradient_sync

__all__ = ["Prepared", "prepare_module"]

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What the recipe leaves the strategy."""

    module: pl.LightningModule  # split, materialised, cast, moved and (ZeRO-3) sharded in place
    runner: PipelineRunner | None  # with a pipeline only
    sync: GradientSync
    checkpoint_names: CheckpointNames  # where checkpoints store tied parameters
    pretrained_bytes_read: int
    counted: CountedLoss | None  # the loss is a mean over pipeline_loss_count elements
    plan_check: PlanCheck | None = None  # tensor parallelism: each kind of split block against itself whole
    sequences: SequenceCheck | None = None  # ... and the sequence lengths sequence parallelism scatters


def prepare_module(
    module: pl.LightningModule,
    *,
    layout: Layout,
    mesh: DeviceMesh,
    device: torch.device,
    precision_plugin: Precision,
    zero: ZeroConfig,
    split: PipelineSplit | None,
    activation_checkpointing: bool,
    init_from: PretrainedWeights | None,
    agreed_seed: Callable[[], int],
) -> Prepared:
    """Apply the recipe to ``module``. ``agreed_seed`` returns the run's seed as rank 0 has it (a collective:
    called on every rank or none)."""
    rank = torch.distributed.get_rank()
    pp_rank = mesh.get_local_rank(PP_AXIS)
    # a "-true" precision casts every floating parameter before ZeRO-3 shards it (the meta path: after)
    cast = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}
    rule = UnitRule(zero.shard_units, zero.bucket_size_mb, cast.get(str(precision_plugin.precision)))
    plan = ShardingPlan(
        mesh[DP_AXIS],
        bf16=precision_plugin.precision == "bf16-mixed",
        reshard_after_forward=zero.reshard_after_forward,
        rule=rule,
    )
    # init_from, meta tensors and ties are planned on the whole module, before the pipeline cuts it
    pretrained = agreed_plan(init_from, module, device) if init_from is not None else None
    meta_built = has_meta_tensors(module)
    tied = tied_on_meta(module) if meta_built else []
    if tied:
        raise ValueError(
            f"{type(module).__name__} ties parameters built on the meta device ({tied[:3]}): materialising it"
            " block by block would untie them. Build the model normally (the strategy keeps tied parameters"
            " tied across pipeline stages), or tie the weights after the strategy set it up."
        )
    refuse_aliased_parameters(module, layout.zero_stage)  # on the whole module: every rank refuses alike
    tensor_plans = plan_blocks(module, layout.tensor_parallel_size)  # read and checked before the cut
    zero3 = layout.zero_stage == 3
    pipelined = layout.pipeline_parallel_size > 1
    if pipelined:
        check_pipeline_contract(module)
    unit_plan = None  # ZeRO-3's units, planned on the whole module (the tie check reads them)
    if layout.zero_stage == 3:
        unit_plan = planned_units(module, rule, pipelined=pipelined, meta_built=meta_built)
        check_fully_shardable(module, rule, unit_plan, pipelined=pipelined)
    ties = find_ties(module)
    stage_ids: list[int] = []
    stages: list[nn.Module] = []
    ranges: list[range] | None = None
    loss_scaling = None
    if pipelined:
        loss_scaling = pipeline_loss_scaling(precision_plugin)
        every_stage = stage_ranges(module, layout, split)
        check_ties(ties, every_stage, layout, zero, unit_plan)  # before the module is cut
        rank_zero_info(describe_stages(module, every_stage))  # Lightning's summary sees one stage
        stage_ids, stages, ranges = split_module(
            module, layout=layout, pp_rank=pp_rank, split=split, activation_checkpointing=activation_checkpointing
        )
        blocks = ", ".join(f"{sid}:{ranges[sid].start}-{ranges[sid].stop - 1}" for sid in stage_ids)
        log.info(f"[rank {rank}] pipeline stages (stage:blocks) {blocks}")
    else:
        check_ties(ties, None, layout, zero, unit_plan)
        if activation_checkpointing:
            raise ValueError(
                "activation_checkpointing=True needs pipeline stages to wrap; with pipeline_parallel_size=1 use"
                " torch.utils.checkpoint inside the model."
            )
    tp_mesh = mesh[TP_AXIS] if tensor_plans is not None else None

    def split_and_shard(name: str, block: nn.Module) -> None:
        if tensor_plans is not None:
            tensor_plans.apply_block(name, block, tp_mesh, keep_dtensors=zero3)
        if zero3:
            plan.shard_block(block)

    if meta_built:
        # built on the meta device: this rank's blocks only, one at a time (split and sharded at once)
        materialize_module(
            module,
            device=device,
            seed=agreed_seed(),
            then=split_and_shard if zero3 or tensor_plans is not None else None,
            loaded=pretrained is not None,
            agree_on=device,
        )
    module = precision_plugin.convert_module(module)
    module.to(device)
    make_replicas_identical(module, mesh.get_group(DP_AXIS))  # as DDP does when it wraps the model
    if tensor_plans is not None:  # after the replicas agree, before ZeRO-3 shards the tensor-parallel slices
        tensor_plans.apply(module, tp_mesh, keep_dtensors=zero3)
        # what every tensor-parallel rank holds whole must be the same tensor on each (ranks seeded apart would
        # initialise it apart): the first one's, as across the replicas above
        make_replicas_identical(module, tp_mesh.get_group(), skip=lambda t: tensor_slice(t) is not None)
    units = None
    if layout.zero_stage == 3:
        shard_fully(module, stages=stages, plan=plan)
        units = UnitGradients(module, mesh.get_group(DP_AXIS), cast_for_compute=plan.casts_for_compute)
    bytes_read = 0
    if pretrained is not None:
        bytes_read = agreed_load(module, *pretrained, device)
        log.info(f"[rank {rank}] init_from: read {bytes_read / 2**20:.1f} MiB")
    counted = counted_loss(module, device)
    runner = None
    if stages:
        runner = PipelineRunner(
            module,
            layout=layout,
            stage_ids=stage_ids,
            stage_modules=stages,
            device=device,
            group=mesh.get_group(PP_AXIS),
            loss_scaling=loss_scaling,
            counted=counted,
        )
    sync = gradient_sync(
        layout.zero_stage,
        config=zero,
        device=device,
        data_parallel_group=mesh.get_group(DP_AXIS),
        pipeline_group=mesh.get_group(PP_AXIS),
        ties=TiedGradients(ties, module, ranges=ranges, layout=layout, mesh=mesh, device=device),
        units=units,
    )
    if tensor_plans is not None:  # the global norm counts a parameter every tensor-parallel rank holds once
        model_group = layout.model_parallel_group()
        sync.count_tensor_parallel(
            whole_on_every_rank(module, TP_AXIS),
            first=mesh.get_local_rank(TP_AXIS) == 0,
            model_parallel_group=model_group,
        )
    if runner is not None:  # the schedule runs the stages' backward passes
        deferred = SCHEDULES[layout.schedule].splits_weight_grad
        sync.watch_pipeline(stages, weight_gradients_deferred=deferred, inferring=lambda: runner.inferring)
    check = tensor_plans.check if tensor_plans is not None else None
    # a pipeline's stages are not agreed (see SequenceCheck); without a sequence scattered, nothing to agree on
    scatters = tensor_plans is not None and tensor_plans.scatters
    sequences = tensor_plans.sequences if scatters and runner is None else None
    return Prepared(module, runner, sync, CheckpointNames(ties), bytes_read, counted, check, sequences)
