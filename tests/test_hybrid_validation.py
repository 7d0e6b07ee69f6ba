"""Bad input fails before step 0 on every rank with the same message (values + fix), never a hang."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
import torch.distributed as dist
from helpers import launch

from lightning_hybrid.checkpoint._flat_shards import flat_boxes
from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy
from lightning_hybrid.strategies._layout import LayoutRequest, resolve_layout
from lightning_hybrid.strategies.pipeline.partition import PipelineSplit, partition_layers

EXPECTED = {
    "sizes": "pipeline_parallel_size (3) must divide the world size (2)",
    "dp_sizes": "pipeline_parallel_size (2) x data_parallel_size (2) = 4 must equal the world size (2)",
    "too_few_blocks": "The model has 3 blocks in `self.layers` but the pipeline needs 4 stages",
    "empty_stage": "layers_per_stage=[6, 0] must have 2 entries, each >= 1",
    "batch_not_divisible": "per-replica batch size (8) must be divisible by num_microbatches (3)",
    "too_few_microbatches": "needs at least 2 micro-batches, got num_microbatches=1",
    "zero3_zero_bubble": "gives wrong gradients when parameters are resharded after forward (zero_stage=3)",
    "unknown_schedule": "Unknown schedule '2f2b'. Choose one of: gpipe, 1f1b,",
    "no_contract": "NoContract cannot be pipelined: keep its pipeline-splittable blocks, in order, in `self.layers`",
    "tied_zero2_buckets": "reduce_gradients='every_microbatch' hands its gradient off during backward",
    "tied_groups_differ": "is tied across pipeline stages, and the stages that hold it step it with different",
    "ds_tied": "are one parameter in two places; DeepSpeedPipelineStrategy does not build DeepSpeed's TiedLayerSpec",
    "ds_accumulation_scheduler": "AccumulationScheduler cannot change DeepSpeed's accumulation",
    "ds_adaptive_loss_scaling": "AdaptiveLossScalingPrecision cannot drive DeepSpeed's engine",
    "ds_config_conflicts": (
        "gradient_accumulation_steps: the config says 3, the strategy's num_microbatches says 2\n"
        "  - gradient_clipping: the config says 1.0, Trainer(gradient_clip_val=...) says 0.5"
    ),
    "ds_batch_not_divisible": "a batch of 8 samples cannot be cut into num_microbatches=3 equal micro-batches",
    "ds_meta_device": "layers.0.token.weight is on the meta device: DeepSpeedPipelineStrategy builds its stages",
    "ds_predict": "DeepSpeedPipelineStrategy does not predict (DeepSpeed's eval_batch hands back only the last",
    "ds_nan_policy_skip": "FaultTolerantCheckpoint(nan_policy='skip') (its default) cannot skip a step under",
    "hybrid_cut_twice": "was cut into pipeline stages by an earlier Trainer (fit, validate or test with a pipeline)",
    "ds_cut_twice": "was cut into pipeline stages by an earlier Trainer (fit, validate or test with a pipeline)",
    # raised where the head lives (rank 1), agreed: rank 0 raises it too instead of waiting in a collective
    "group_moved_on_one_stage": "optimizer.add_param_group(...) instead, or use zero_stage=0 or 3. (rank 1)",
    "group_moved_on_one_replica": "optimizer.add_param_group(...) instead, or use zero_stage=0 or 3. (rank 1)",
    # found on rank 1 only, named on both
    **{
        f"zero{z}_late_gradient_on_one_rank": "training_step (return the loss, or self.manual_backward). (rank 1)"
        for z in ("0", "1", "2", "2_once")
    },
    "group_moved_on_every_replica": "optimizer.add_param_group(...) instead, or use zero_stage=0 or 3. (ranks 0, 1)",
    **{
        name: "training_step returned no loss on some data-parallel replicas only"
        for name in [f"zero{z}_skip_on_one_rank" for z in range(4)]
        + ["zero2_once_skip_on_one_rank", "zero0_skip_accumulating", "zero1_skip_closing", "zero2_skip_accumulating"]
        + ["zero0_skip_gather_with_grads", "zero1_skip_counted"]
    },
    "tp_no_plan": "tensor_parallel_size=2: NoContract does not say how its blocks split. Define"
    " `tensor_parallel_plan(self, name, block)`",
    "tp_plan_names_no_module": "GPT.tensor_parallel_plan('layers.1') names 'attn.query', which is no submodule of"
    " that block (its submodules: ln_1, attn, attn.q,",
    "tp_block_without_plan": "GPT.tensor_parallel_plan returned None for layers.1, which holds parameters. Return"
    " its plan, or {}",
    "tp_heads": "tensor_parallel_size=2 must divide n_head (1)",
    "tp_vocabulary": "tensor_parallel_size=2 does not divide layers.0.token.num_embeddings (63) that RowwiseParallel"
    " splits",
    "tp_tie_split_differently": "layers.0.token.weight and layers.5.head.weight are one tied parameter, and the"
    " tensor-parallel plan splits them differently",
    "tp_optimizer_not_elementwise": "torch.optim.Adafactor is not known to be element-wise (it factors the"
    " second moment over each matrix's rows and columns), so tensor parallelism would step it on a slice",
    "ds_tensor_parallel": "tensor_parallel_size=2: DeepSpeed's pipeline engine has no tensor parallelism. Use"
    " HybridParallelStrategy(tensor_parallel_size=",
    # Lightning refuses a None from training_step in distributed training: on every rank alike, none waits
    "zero1_skip_on_every_rank": "Skipping the `training_step` by returning None in distributed training is not",
}


@pytest.mark.multiproc
def test_every_bad_input_fails_on_every_rank_with_the_same_message():
    job = launch("bad_inputs.py", {}, nproc=2, timeout=300)
    errors = [job.rank(r)["errors"] for r in (0, 1)]
    assert errors[0] == errors[1], "ranks disagree on the error"
    for case, fragment in EXPECTED.items():
        assert fragment in errors[0][case], f"{case}: {errors[0][case]}"
    # after some forty Trainers, the same layouts again: same outcome, and no process group (three threads) added
    assert errors[0]["tp2_trains"] == errors[0]["pp2_tied_trains"] == "no error"
    for r in (0, 1):
        report = job.rank(r)
        assert report["again"] == {name: errors[0][name] for name in report["again"]}
        before, after = report["threads"]
        assert after - before < 3, f"rank {r}: {after - before} threads more after the same layouts again"


CONTRACT = {
    # the stage that does not hold the failing block raises the same message, not "Connection closed by peer"
    "block_returns_dict_on_one_stage": "Stage args must be a tensor, tuple, or list of tensors, got dict. (raised on"
    " rank 1, pipeline stage [1])",
    "first_stage_block_returns_dict": "got dict. (raised on rank 0, pipeline stage [0])",
    "block_raises_on_one_stage": "ValueError: a bug in the user's block (raised on rank 1, pipeline stage [1])",
    "first_stage_block_changes_shape": "Failed to run stage backward: Stage output: ('Tensor(torch.Size([4, 15, 32])",
    # at the third forward, inside torch's stage: the user's error is named first, torch's wrapper after it
    "block_raises_at_step_2": "ValueError: a bug in the user's block (inside torch's RuntimeError: [Stage 1] failed"
    " to run forward",
}


@pytest.mark.multiproc
def test_a_block_that_breaks_the_contract_on_one_stage_fails_every_rank_with_its_message():
    for case, fragment in CONTRACT.items():  # a job each: the failure ends the process group
        job = launch("bad_inputs.py", {"only": [case]}, nproc=2, timeout=120)
        errors = [job.rank(r)["errors"][case] for r in (0, 1)]
        assert errors[0] == errors[1], f"{case}: ranks disagree: {errors}"
        assert fragment in " ".join(errors[0].split()), f"{case}: {errors[0]}"


@pytest.mark.unit
def test_layout_rules():
    lay = resolve_layout(
        world_size=8, num_nodes=2, pipeline_parallel_size="auto", data_parallel_size="auto", zero_stage=1,
        schedule="1f1b", stages_per_rank=None, num_microbatches=None,
    )  # fmt: skip
    assert (lay.pipeline_parallel_size, lay.data_parallel_size, lay.num_microbatches) == (2, 4, 2)
    lay = resolve_layout(
        world_size=8, num_nodes=1, pipeline_parallel_size=4, data_parallel_size="auto", zero_stage=0,
        schedule="zbv_zero_bubble", stages_per_rank=None, num_microbatches=None,
    )  # fmt: skip
    assert (lay.data_parallel_size, lay.num_stages, lay.num_microbatches) == (2, 8, 8)
    with pytest.raises(ValueError, match="exactly 2 stage"):
        resolve_layout(
            world_size=4, num_nodes=1, pipeline_parallel_size=2, data_parallel_size="auto", zero_stage=0,
            schedule="dualpipev", stages_per_rank=3, num_microbatches=None,
        )  # fmt: skip
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        HybridParallelStrategy(zero_stage=4)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # the process's threads, gloo's native ones included


@pytest.mark.unit
def test_a_layout_makes_its_groups_once_per_default_group():
    """Every Trainer of a layout in one process uses the same mesh and groups (each gloo group holds three
    threads for the life of the process: a sweep of Trainers used to pile them up), until the default group is
    destroyed: then they are made afresh."""
    assert not dist.is_initialized()
    lay = resolve_layout(
        world_size=1, num_nodes=1, pipeline_parallel_size=1, data_parallel_size=1, zero_stage=1,
        schedule="1f1b", stages_per_rank=None, num_microbatches=None,
    )  # fmt: skip
    made = []
    for _ in range(2):  # two default groups, one after the other
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            before = _threads()
            first = (lay.build_mesh("cpu"), lay.host_data_parallel_group(), lay.model_parallel_group())
            after_first = _threads()
            again = (lay.build_mesh("cpu"), lay.host_data_parallel_group(), lay.model_parallel_group())
            assert all(a is b for a, b in zip(first, again))
            assert before < after_first == _threads(), "the second Trainer's groups were made again"
            made.append(first)
        finally:
            dist.destroy_process_group()
    assert all(a is not b for a, b in zip(*made)), "a group of a destroyed default group was handed out"


@pytest.mark.unit
def test_one_layout_request_for_both_engines():
    """One set of spellings and defaults; the rules that differ by engine are named by the request."""
    assert HybridParallelStrategy(data_parallel_size=None).layout_request == LayoutRequest()  # None means "auto"
    assert DeepSpeedPipelineStrategy().layout_request == LayoutRequest(engine="deepspeed")
    for bad, message in [
        ({"pipeline_parallel_size": None}, "pipeline_parallel_size must be an integer >= 1, got None; pass 'auto'"),
        ({"data_parallel_size": True}, "data_parallel_size must be an integer >= 1, got True"),
        ({"num_microbatches": 0}, "num_microbatches must be an integer >= 1 or None, got 0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"tensor_parallel_size": 2, "engine": "deepspeed"}, "DeepSpeed's pipeline engine has no tensor parallelism"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            LayoutRequest(**bad)
    # torch's schedules need a micro-batch per pipeline rank; DeepSpeed's 1F1B runs fewer
    with pytest.raises(ValueError, match="needs at least 2 micro-batches"):
        LayoutRequest(pipeline_parallel_size=2, num_microbatches=1).resolve(world_size=4, num_nodes=1)
    lay = LayoutRequest(pipeline_parallel_size=2, num_microbatches=1, engine="deepspeed").resolve(
        world_size=4, num_nodes=1
    )
    assert (lay.data_parallel_size, lay.num_microbatches) == (2, 1)
    # the tensor-parallel slot: innermost in the mesh, TP peers adjacent; pp x dp share what it leaves
    lay = resolve_layout(
        world_size=8, num_nodes=1, pipeline_parallel_size=2, data_parallel_size="auto", zero_stage=0,
        schedule="1f1b", stages_per_rank=None, num_microbatches=None, tensor_parallel_size=2,
    )  # fmt: skip
    assert lay.data_parallel_size == 2 and lay.world_size == 8
    assert [lay.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert lay.mesh_shape() == ((2, 2, 2), ("pipeline_parallel", "data_parallel", "tensor_parallel"))
    assert LayoutRequest(pipeline_parallel_size=2).resolve(world_size=4, num_nodes=1).mesh_shape()[1] == (
        "pipeline_parallel",
        "data_parallel",
    )
    record = lay.record(engine="torch", tied_parameters=[])
    assert record["tensor_parallel_size"] == 2 and record["engine"] == "torch"


@pytest.mark.unit
def test_partition_balances_by_cost_and_honours_explicit_splits():
    # a brute-force optimum over all cut points is the reference for the dynamic programme
    import itertools

    costs = [5.0, 1.0, 1.0, 1.0, 4.0, 2.0, 2.0, 6.0]
    for stages in (2, 3, 4):
        best = min(
            max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        ranges = partition_layers(costs, stages)
        assert ranges[0].start == 0 and ranges[-1].stop == len(costs)
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
        assert max(sum(costs[i] for i in r) for r in ranges) == best
    assert partition_layers([1.0] * 6, 3, PipelineSplit(layers_per_stage=[1, 2, 3])) == [
        range(0, 1),
        range(1, 3),
        range(3, 6),
    ]
    assert partition_layers([1.0] * 6, 2, PipelineSplit(split_points=[4])) == [range(0, 4), range(4, 6)]
    # extra cost on the last stage (e.g. a large vocabulary's loss) moves blocks away from it
    plain = partition_layers([1.0] * 8, 2)
    weighted = partition_layers([1.0] * 8, 2, PipelineSplit(last_stage_extra=2.0))
    assert len(weighted[-1]) < len(plain[-1])
    with pytest.raises(ValueError, match="strictly increasing"):
        partition_layers([1.0] * 6, 2, PipelineSplit(split_points=[0]))


@pytest.mark.unit
def test_a_0_dim_tensor_is_one_box_of_no_dimensions():
    """A 0-dim parameter (CLIP's logit_scale) is stored as DCP stores a 0-dim tensor, not as a [1] box whose
    size mismatches on resume."""
    from lightning_hybrid.checkpoint._flat_shards import view_boxes

    assert flat_boxes((), 0, 1) == [([], [])]
    assert flat_boxes((), 0, 0) == []
    (offsets, box), *rest = view_boxes(torch.Size([]), 0, torch.tensor([2.5]))
    assert not rest and offsets == () and box.shape == torch.Size([]) and float(box) == 2.5


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 5), (2, 3, 2, 3), (1, 6), (6, 1)])
def test_flat_boxes_tile_every_flat_range_in_order(shape):
    """ZeRO slices are flat ranges; DCP stores boxes. Brute force: every range [a, b) of the tensor is covered
    exactly once, box after box in flat order (so each box is a view of the slice), in at most 2 * ndim - 1."""
    positions = torch.arange(math.prod(shape)).reshape(shape)
    n = positions.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            covered = []
            boxes = flat_boxes(shape, a, b)
            assert len(boxes) <= 2 * len(shape) - 1
            for offsets, sizes in boxes:
                covered += positions[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].reshape(-1).tolist()
            assert covered == list(range(a, b)), (a, b, boxes)
