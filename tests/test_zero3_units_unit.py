"""ZeRO-3's FSDP2 units: which modules each ``shard_units`` setting makes units, and the tie check's view of them
agreeing with what ``fully_shard`` actually did (one process, a one-rank gloo group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import (
    ShardingPlan,
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


def _shard(mesh, zero: ZeroConfig, d_model: int) -> nn.Module:
    from gpt import GPT

    model = GPT(vocab_size=16, block_size=8, n_layer=2, d_model=d_model, n_head=2)
    plan = ShardingPlan(
        mesh, bf16=False, reshard_after_forward=True, units=zero.shard_units, unit_limit_mb=zero.bucket_size_mb
    )
    shard_fully(model, stages=None, plan=plan)
    # the plan the set-up checks (dtypes, ties) read, made from the unsharded model, is what fully_shard did
    reference = GPT(vocab_size=16, block_size=8, n_layer=2, d_model=d_model, n_head=2)
    assert planned_units(reference, zero.shard_units, zero.bucket_size_mb, pipelined=False) == _units(model)
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


def test_a_block_of_two_dtypes_is_split_by_auto_and_refused_where_a_unit_would_hold_both(one_rank_group):
    def build() -> nn.Module:
        model = nn.Module()
        model.layers = nn.Sequential(_HalfBias(), nn.Linear(16, 4))
        return model

    model = build()
    plan = ShardingPlan(one_rank_group, bf16=False, reshard_after_forward=True, units="auto", unit_limit_mb=25.0)
    check_fully_shardable(model, "auto", 25.0, pipelined=False)
    shard_fully(model, stages=None, plan=plan)  # fully_shard itself asserts one dtype per unit
    assert _units(model) == ["", "layers.0", "layers.0.linear", "layers.1"]
    model = build()
    with pytest.raises(ValueError, match=r"the unit layers.0 holds layers.0.offset \(bfloat16\),"
                       r" layers.0.linear.weight \(float32\).*shard_units='auto'"):  # fmt: skip
        check_fully_shardable(model, "blocks", 25.0, pipelined=False)
    # two dtypes directly in one module: no setting splits it
    model.layers[0].linear.bias.data = model.layers[0].linear.bias.data.double()
    for units in ("auto", "submodules"):
        with pytest.raises(ValueError, match=r"the unit layers.0.linear holds .*float64"):
            check_fully_shardable(model, units, 25.0, pipelined=False)
