"""ZeRO-1/2 flat gradients in one process (a one-rank gloo group): a backward with ``create_graph=True`` is
refused by name under every ZeRO-1/2 setting (the flat buffers keep no graph, and its out-of-place
accumulation would count an earlier micro-batch twice), while a plain backward accumulates exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer

SETTINGS = [(1, "every_microbatch"), (2, "every_microbatch"), (2, "once_per_step")]


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _sharded(stage: int, mode: str, group: dist.ProcessGroup) -> tuple[nn.Module, FlatShardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {p: n for n, p in model.named_parameters()}
    sharded = FlatShardedOptimizer(
        optimizer, names=names, group=group, zero_stage=stage, reduce_gradients=mode, bucket_numel=4
    )
    return model, sharded


@pytest.mark.parametrize(("stage", "mode"), SETTINGS)
def test_backward_with_create_graph_is_refused_by_name(one_rank_group, stage, mode):
    model, _ = _sharded(stage, mode, one_rank_group)
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match=r"create_graph=True\) reached 2\.(weight|bias).*zero_stage=0 or 3"):
        model(x).square().sum().backward(create_graph=True)


@pytest.mark.parametrize(("stage", "mode"), SETTINGS)
def test_two_micro_batches_accumulate_exactly(one_rank_group, stage, mode):
    """The window's gradient is the sum of its micro-batches' (against plain autograd on a copy)."""
    model, sharded = _sharded(stage, mode, one_rank_group)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    batches = [torch.randn(5, 4), torch.randn(5, 4)]
    for i, x in enumerate(batches):
        # as the strategy arms it: ZeRO-1 reduces during the window's last backward, ZeRO-2 during every one
        sharded.queue.armed = stage == 2 or i == len(batches) - 1
        model(x).square().sum().backward()
        sharded.queue.end_backward()
        sharded.after_backward()
        reference(x).square().sum().backward()
    sharded.reduce_gradients()
    got = torch.cat([g.shard.grad.reshape(-1)[: sum(p.numel() for p in g.params)] for g in sharded.groups])
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
