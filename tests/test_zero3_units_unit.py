"""ZeRO-3's FSDP2 units: which modules each ``shard_units`` setting makes units, and the plan the set-up checks
read (dtypes, ties) agreeing with what ``fully_shard`` actually did, eager, meta-built and pipelined (one
process, a one-rank gloo group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid.strategies._materialize import materialize_module
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import (
    ShardingPlan,
    UnitRule,
    check_fully_shardable,
    planned_units,
    shard_fully,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _units(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _check(module: nn.Module, rule: UnitRule) -> None:
    check_fully_shardable(module, rule, planned_units(module, rule, pipelined=False), pipelined=False)


def _plan(mesh, rule: UnitRule) -> ShardingPlan:
    return ShardingPlan(mesh, bf16=False, reshard_after_forward=True, rule=rule)


def _gpt(d_model: int, **kwargs) -> nn.Module:
    from gpt import GPT

    return GPT(vocab_size=16, block_size=8, n_layer=2, d_model=d_model, n_head=2, **kwargs)


def _shard(mesh, zero: ZeroConfig, d_model: int) -> nn.Module:
    rule = UnitRule(zero.shard_units, zero.bucket_size_mb)
    model = _gpt(d_model)
    shard_fully(model, stages=None, plan=_plan(mesh, rule))
    # the plan the set-up checks (dtypes, ties) read, made from the unsharded model, is what fully_shard did
    assert planned_units(_gpt(d_model), rule, pipelined=False) == _units(model)
    return model


def test_auto_keeps_a_block_that_fits_the_bucket_whole_and_splits_a_larger_one(one_rank_group):
    # d_model=8: blocks of at most 3 KB; d_model=64: transformer blocks of about 200 KB, the embedding and the
    # head (16 tokens) 6 and 4 KB
    blocks = ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    split = [
        "", "layers.0", "layers.1", "layers.1.ln_1", "layers.1.attn", "layers.1.ln_2", "layers.1.mlp",
        "layers.2", "layers.2.ln_1", "layers.2.attn", "layers.2.ln_2", "layers.2.mlp", "layers.3",
    ]  # fmt: skip
    assert _units(_shard(one_rank_group, ZeroConfig(bucket_size_mb=0.1), d_model=8)) == blocks
    assert _units(_shard(one_rank_group, ZeroConfig(bucket_size_mb=0.1), d_model=64)) == split
    assert _units(_shard(one_rank_group, ZeroConfig(), d_model=64)) == blocks  # the default limit, 25 MB
    assert _units(_shard(one_rank_group, ZeroConfig(shard_units="blocks", bucket_size_mb=0.1), 64)) == blocks
    every_child = [*split[:2], "layers.0.token", "layers.0.position", *split[2:], "layers.3.ln_f", "layers.3.head"]
    assert _units(_shard(one_rank_group, ZeroConfig(shard_units="submodules"), d_model=8)) == every_child


class _HalfBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)
        self.offset = nn.Parameter(torch.zeros(16, dtype=torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + self.offset.float()


def _two_dtypes(*, frozen_offset: bool = False) -> nn.Module:
    model = nn.Module()
    model.layers = nn.Sequential(_HalfBias(), nn.Linear(16, 4))
    model.layers[0].offset.requires_grad_(not frozen_offset)
    return model


def _train_step(model: nn.Module) -> None:
    model.layers(torch.randn(3, 8)).sum().backward()


def test_a_block_of_two_dtypes_is_split_by_auto_and_refused_where_a_unit_would_hold_both(one_rank_group):
    auto = UnitRule("auto", 25.0)
    _check(_two_dtypes(), auto)
    model = _two_dtypes()
    shard_fully(model, stages=None, plan=_plan(one_rank_group, auto))
    assert _units(model) == ["", "layers.0", "layers.0.linear", "layers.1"]
    _train_step(model)  # FSDP2 takes the split block
    with pytest.raises(ValueError, match=r"the unit layers.0 holds layers.0.offset \(bfloat16\),"
                       r" layers.0.linear.weight \(float32\).*shard_units='auto'"):  # fmt: skip
        _check(_two_dtypes(), UnitRule("blocks", 25.0))
    # what the refusal spares the user: FSDP2 takes the whole block and fails at the first forward
    model = _two_dtypes()
    shard_fully(model, stages=None, plan=_plan(one_rank_group, UnitRule("blocks", 25.0)))
    with pytest.raises(AssertionError, match="uniform original parameter dtype"):
        _train_step(model)
    # two dtypes directly in one module: no setting splits it
    model = _two_dtypes()
    model.layers[0].linear.bias.data = model.layers[0].linear.bias.data.double()
    for units in ("auto", "submodules"):
        with pytest.raises(ValueError, match=r"the unit layers.0.linear holds .*float64"):
            _check(model, UnitRule(units, 25.0))


def test_a_frozen_parameter_of_another_dtype_and_a_cast_to_one_dtype_are_taken(one_rank_group):
    # FSDP2 counts trainable parameters only (a frozen bf16 base beside a trained fp32 adapter)
    for units in ("auto", "blocks", "submodules"):
        _check(_two_dtypes(frozen_offset=True), UnitRule(units, 25.0))
    model = _two_dtypes(frozen_offset=True)
    shard_fully(model, stages=None, plan=_plan(one_rank_group, UnitRule("auto", 25.0)))
    assert _units(model) == ["", "layers.0", "layers.1"]  # one trainable dtype: the block stays whole
    _train_step(model)
    # a "-true" precision casts every floating parameter to one dtype before sharding: nothing to refuse, and
    # the sizes are the cast's (a 200 KB fp32 block is 100 KB of bf16, under a limit of 0.15 MB)
    _check(_two_dtypes(), UnitRule("blocks", 25.0, torch.bfloat16))
    assert "layers.1.attn" in planned_units(_gpt(64), UnitRule("auto", 0.15), pipelined=False)
    assert "layers.1.attn" not in planned_units(_gpt(64), UnitRule("auto", 0.15, torch.bfloat16), pipelined=False)


def test_the_plan_is_what_a_meta_built_and_a_pipelined_model_get(one_rank_group):
    rule = UnitRule("auto", 0.1)  # d_model=64: transformer blocks split, the embedding and the head whole
    # meta-built: every block of self.layers is sharded as it is materialised, a frozen one too
    model = _gpt(64, build_on_meta=True)
    model.configure_model()  # the blocks, on the meta device
    model.layers[2].requires_grad_(False)
    plan = _plan(one_rank_group, rule)
    materialize_module(model, device=torch.device("cpu"), seed=0, then=lambda name, block: plan.shard_block(block))
    shard_fully(model, stages=None, plan=plan)
    reference = _gpt(64)
    reference.layers[2].requires_grad_(False)
    assert _units(model) == planned_units(reference, rule, pipelined=False, meta_built=True)
    assert "layers.2" in _units(model) and "layers.2.mlp" in _units(model)
    # eager, the same frozen block stays in the root's unit (unfreezing it later changes nothing for FSDP2)
    eager = _gpt(64)
    eager.layers[2].requires_grad_(False)
    shard_fully(eager, stages=None, plan=plan)
    assert (
        _units(eager)
        == planned_units(reference, rule, pipelined=False)
        == [u for u in _units(model) if not u.startswith("layers.2")]
    )
    # two pipeline stages of the same blocks: each stage is the root of its blocks' units
    piped, stages = _gpt(64), []
    piped.layers[2].requires_grad_(False)
    for blocks in ([0, 1], [2, 3]):
        stage = nn.Module()
        stage.blocks = nn.ModuleList(piped.layers[i] for i in blocks)
        stages.append(stage)
    shard_fully(piped, stages=stages, plan=plan)
    assert [u for u in _units(piped) if u] == [u for u in planned_units(reference, rule, pipelined=True) if u]


def test_a_frozen_unit_made_trainable_under_bf16_is_refused_before_fsdp2_fails_in_backward(one_rank_group):
    from lightning_hybrid.strategies.zero.fully_sharded import UnitGradients

    def frozen_block_unit(guard: bool) -> nn.Module:
        model = nn.Module()
        model.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        model.layers[0].requires_grad_(False)
        plan = ShardingPlan(one_rank_group, bf16=True, reshard_after_forward=True, rule=UnitRule("auto", 25.0))
        for block in model.layers:  # as the meta path and a pipeline do: the frozen block is a unit
            plan.shard_block(block)
        plan.shard(model)
        if guard:
            UnitGradients(model, dist.group.WORLD, cast_for_compute=plan.casts_for_compute)
        _train_step(model)  # FSDP2's first forward: the frozen unit's gradient dtype is fixed here
        model.layers[0].requires_grad_(True)  # BackboneFinetuning's unfreeze
        return model

    with pytest.raises(
        RuntimeError,
        match=r"layers.0 was frozen when zero_stage=3 sharded it.*now layers.0.weight, layers.0.bias trainable",
    ):
        _train_step(frozen_block_unit(guard=True))
    with pytest.raises(RuntimeError, match="dtype"):  # without the guard: FSDP2 itself, inside backward
        _train_step(frozen_block_unit(guard=False))


def test_a_block_without_forward_is_refused_by_name_before_fully_shard_or_a_stage_would_fail():
    from lightning_hybrid.contract import check_pipeline_contract

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])])
    model.pipeline_loss = lambda output, target: output.sum()
    with pytest.raises(ValueError, match=r"layers.1 has no forward \(a ModuleList or ModuleDict\)"):
        _check(model, UnitRule("auto", 25.0))
    with pytest.raises(TypeError, match=r"layers.1 in `self.layers` has no forward"):
        check_pipeline_contract(model)
    # a ModuleList inside a block is no unit: its members stay in the block's unit
    model.layers[1] = nn.Sequential(nn.Linear(4, 4))
    model.layers[1].experts = nn.ModuleList([nn.Linear(4, 4)])
    _check(model, UnitRule("submodules", 25.0))
    check_pipeline_contract(model)
