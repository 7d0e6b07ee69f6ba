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


class _Branchy(nn.Module):
    """``skip`` gets a gradient only from inputs with ``use_skip``; ``never`` gets none. In buckets of 16
    elements: [skip.weight, skip.bias, body.weight] and [body.bias, never.weight, never.bias] (a segment
    without a gradient before one with, and after)."""

    def __init__(self) -> None:
        super().__init__()
        self.skip, self.body, self.never = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_skip: bool) -> torch.Tensor:
        return self.body(x).tanh() + (self.skip(x) if use_skip else 0)


@pytest.fixture
def nan_for_empty(monkeypatch):
    """Every fresh ``torch.empty`` is NaN, and so is every bucket buffer ZeRO-2 takes from its pool (which
    holds an earlier bucket's numbers): a part read before it was written poisons what it reaches."""
    from lightning_hybrid.strategies.zero.bucket_gradients import BucketGradients

    real_empty, real_new_buffer = torch.empty, BucketGradients._new_buffer
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(BucketGradients, "_new_buffer", lambda self, b: real_new_buffer(self, b).fill_(float("nan")))


def _branchy_zero2(group: dist.ProcessGroup) -> tuple[nn.Module, nn.Module, FlatShardedOptimizer]:
    torch.manual_seed(0)
    model, reference = _Branchy(), _Branchy()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {p: n for n, p in model.named_parameters()}
    sharded = FlatShardedOptimizer(
        optimizer, names=names, group=group, zero_stage=2, reduce_gradients="every_microbatch", bucket_numel=16
    )
    assert [b.members for b in sharded.groups[0].grads.buckets] == [[0, 1, 2], [3, 4, 5]]
    return model, reference, sharded


def _flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat(
        [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in module.parameters()]
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_zero2_buffers_are_written_before_they_are_read(one_rank_group, nan_for_empty, overlap):
    """ZeRO-2's bucket buffers and shard gradient are allocated without zeroing (each part's first gradient is
    copied in). A bucket part of which has no gradient in a micro-batch, a parameter that never gets one, and a
    gradient in two parts in one backward (without overlap: several backwards before one boundary, as
    reentrant checkpointing hands them off) all match plain autograd."""
    model, reference, sharded = _branchy_zero2(one_rank_group)
    sharded.queue.launch_in_backward = overlap
    micro_batches = [[(torch.randn(5, 4), False)], [(torch.randn(5, 4), True), (torch.randn(5, 4), False)]]
    if overlap:  # a second part would arrive after its bucket's reduction started: one part per backward
        micro_batches = [[b] for parts in micro_batches for b in parts]
    for parts in micro_batches:
        for x, use_skip in parts:
            model(x, use_skip).square().sum().backward()
            reference(x, use_skip).square().sum().backward()
        sharded.queue.end_backward()
        sharded.after_backward()
    sharded.reduce_gradients()
    got = torch.cat([g.shard.grad.reshape(-1)[: sum(p.numel() for p in g.params)] for g in sharded.groups])
    torch.testing.assert_close(got, _flat_grads(reference), rtol=0, atol=1e-6)


def test_zero2_gradient_read_between_reductions_is_zero_where_unreduced(one_rank_group, nan_for_empty):
    """The gradient so far (the noise scale's) read when one bucket is reduced and the other not yet: the
    reduced part is its gradient, the rest zeros, and the window's gradient is still exact."""
    _, _, untouched = _branchy_zero2(one_rank_group)
    assert torch.equal(untouched.local_gradients()[0], torch.zeros(45))  # nothing reduced in the window yet
    model, reference, sharded = _branchy_zero2(one_rank_group)
    grads = sharded.groups[0].grads
    sharded.queue.launch_in_backward = False
    x = torch.randn(5, 4)
    model(x, True).square().sum().backward()
    reference(x, True).square().sum().backward()
    grads.start_reduction(grads.buckets[1])()  # as the queue does: backward's first bucket first
    want = _flat_grads(reference)
    torch.testing.assert_close(sharded.local_gradients()[0], torch.cat([torch.zeros(27), want[27:]]), rtol=0, atol=0)
    grads.start_reduction(grads.buckets[0])()
    sharded.after_backward()
    sharded.reduce_gradients()
    torch.testing.assert_close(sharded.groups[0].shard.grad, want, rtol=0, atol=1e-6)


def _bucket_gradients(params: list[nn.Parameter], padded: int, group: dist.ProcessGroup, **queue_kwargs: bool):
    """ZeRO-2's gradients of ``params`` packed in one flat buffer of ``padded`` elements, buckets of 12+
    elements (the one backward completes first: at most 12 too), and their queue."""
    from lightning_hybrid.strategies.zero.bucket_gradients import BucketGradients
    from lightning_hybrid.strategies.zero.buckets import BucketQueue

    offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
    queue = BucketQueue(**queue_kwargs)
    grads = BucketGradients(
        params, offsets, padded, group=group, dtype=torch.float32, device=torch.device("cpu"),
        names=[f"p{i}" for i in range(len(params))], bucket_numel=12, queue=queue,
    )  # fmt: skip
    return grads, queue


def test_zero2_padding_is_reduced_as_zeros(one_rank_group, nan_for_empty):
    """The flat buffer's padding (to a multiple of the group size) lies in the last bucket and gets no gradient:
    it is reduced as zeros, so a norm over the shard (clipping) is the gradient's."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    grads, queue = _bucket_gradients(list(layer.parameters()), 20, one_rank_group)
    assert [(b.lo, b.hi) for b in grads.buckets] == [(0, 20)]
    reference = nn.Linear(4, 3)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(5, 4)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    want = torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad.reshape(-1), torch.zeros(5)])
    queue.end_backward()
    shard = nn.Parameter(torch.zeros(20))
    grads.reduce(shard)
    torch.testing.assert_close(shard.grad, want, rtol=0, atol=0)


def test_zero2_empty_leading_parameter_does_not_hide_a_bucket(one_rank_group, nan_for_empty):
    """A zero-element parameter first in the group makes a bucket of its own at the same offset as the next one:
    read between reductions, the gradient is still zero where nothing was reduced, and exact at the end."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.empty(0)), nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3, 4))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    grads, _ = _bucket_gradients(params, 24, one_rank_group, launch_in_backward=False)
    assert [(b.lo, b.hi) for b in grads.buckets] == [(0, 0), (0, 12), (12, 24)]
    x = torch.randn(5, 4)
    for e, a, b in (params, reference):
        ((x @ a.T).square().sum() + (x @ b.T).tanh().sum() + e.sum()).backward()
    want = torch.cat([reference[1].grad.reshape(-1), reference[2].grad.reshape(-1)])
    grads.start_reduction(grads.buckets[2])()  # backward's first bucket
    torch.testing.assert_close(grads.local_gradients()[0], torch.cat([torch.zeros(12), want[12:]]), rtol=0, atol=0)
    grads.start_reduction(grads.buckets[1])()
    grads.start_reduction(grads.buckets[0])()
    shard = nn.Parameter(torch.zeros(24))
    grads.reduce(shard)
    torch.testing.assert_close(shard.grad, want, rtol=0, atol=1e-6)


def test_zero2_reduced_then_another_backward_then_cleared(one_rank_group, nan_for_empty):
    """Manual optimization: the window reduced (and read), then another backward before the step: the second
    reduction adds to the first exactly. Then ``zero_grad`` mid-window: what follows starts from nothing."""
    model, reference, sharded = _branchy_zero2(one_rank_group)
    xs = [torch.randn(5, 4) for _ in range(3)]

    def backward(x: torch.Tensor) -> None:  # as the strategy runs one (a gradient outside it would come late)
        sharded.before_backward()
        model(x, True).square().sum().backward()
        sharded.queue.end_backward()
        sharded.after_backward()

    def shard_grad() -> torch.Tensor:
        return sharded.groups[0].shard.grad.clone()

    backward(xs[0])
    sharded.reduce_gradients()
    first = shard_grad()
    backward(xs[1])
    sharded.reduce_gradients()
    for x in xs[:2]:
        reference(x, True).square().sum().backward()
    torch.testing.assert_close(shard_grad(), _flat_grads(reference), rtol=0, atol=1e-6)
    assert not torch.equal(first, shard_grad())
    sharded.zero_grad()
    reference.zero_grad()
    backward(xs[2])
    sharded.reduce_gradients()
    reference(xs[2], True).square().sum().backward()
    torch.testing.assert_close(shard_grad(), _flat_grads(reference), rtol=0, atol=1e-6)


def test_zero2_buffers_are_reused_from_micro_batch_to_micro_batch_and_step_to_step(one_rank_group, monkeypatch):
    """ZeRO-2's micro-batches reduce their buckets in buffers of earlier reductions, at most as many as can be
    live at once, and the next window reuses them and the last window's shard gradient: no fresh allocation
    per bucket, micro-batch or step (on the host, fresh memory costs a page fault per 4 KiB: a cost that grows
    with the model). The gradient stays exact, with a parameter that has a gradient in some micro-batches
    only, although no buffer is zeroed."""
    from lightning_hybrid.strategies.zero.bucket_gradients import BucketGradients

    model, reference, sharded = _branchy_zero2(one_rank_group)
    grads = sharded.groups[0].grads
    assert isinstance(grads, BucketGradients)
    taken: list[list[int]] = []  # per micro-batch: how many buffers the pool held as each bucket took one
    real_new_buffer = BucketGradients._new_buffer
    monkeypatch.setattr(
        BucketGradients, "_new_buffer", lambda self, b: taken[-1].append(len(self._pool)) or real_new_buffer(self, b)
    )
    storages = []
    for use_skips in ((True, False, True), (False, False, True), (False, False, False)):
        for use_skip in use_skips:
            taken.append([])
            x = torch.randn(5, 4)
            model(x, use_skip).square().sum().backward()
            reference(x, use_skip).square().sum().backward()
            sharded.queue.end_backward()
            sharded.after_backward()
            assert 0 < len(grads._pool) <= sharded.queue.max_in_flight + 1
        sharded.reduce_gradients()
        storages.append(grads.shard_grad.data_ptr())
        got = grads.shard_grad[: sum(p.numel() for p in grads.params)]
        torch.testing.assert_close(got, _flat_grads(reference), rtol=0, atol=1e-6)
        sharded.step()
        sharded.zero_grad()
        reference.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.data.copy_(p.data)
        assert 0 < len(grads._pool) <= sharded.queue.max_in_flight + 1  # kept for the next window
    assert len(set(storages)) == 1  # every window's shard gradient in the same storage
    # only the very first micro-batch found the pool empty
    assert len(taken) == 9 and all(t for t in taken)
    assert taken[0][0] == 0 and all(n > 0 for sizes in taken[1:] for n in sizes), taken


@pytest.mark.parametrize(("stage", "mode"), [(1, "every_microbatch"), (2, "once_per_step")])
def test_gradients_user_code_reads_after_backward_are_exact_window_after_window(one_rank_group, stage, mode):
    """With user code reading ``.grad`` after backward (on_after_backward: ZeRO-1 and once_per_step hold the
    whole gradient: "full"), three windows of two micro-batches, a branch taken in some only: the model's ``.grad``
    and the shard gradient match autograd in every window (no window's numbers reach the next, none is lost
    where backward accumulated into the buffer's views)."""
    from lightning_hybrid.strategies._user_code import UserGradientCode

    torch.manual_seed(0)
    model, reference = _Branchy(), _Branchy()
    reference.load_state_dict(model.state_dict())
    names = {p: n for n, p in model.named_parameters()}
    sharded = FlatShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), names=names, group=one_rank_group, zero_stage=stage,
        reduce_gradients=mode, bucket_numel=16, user=UserGradientCode(after_backward=True),
    )  # fmt: skip
    for window in ((True, True), (False, False), (False, True)):
        for k, use_skip in enumerate(window):
            sharded.queue.armed = stage == 2 or k == len(window) - 1
            x = torch.randn(5, 4)
            sharded.before_backward()  # as the strategy's backward: the placeholders user code saw go
            model(x, use_skip).square().sum().backward()
            reference(x, use_skip).square().sum().backward()
            sharded.queue.end_backward()
            sharded.after_backward()
        sharded.reduce_gradients()
        want = _flat_grads(reference)
        torch.testing.assert_close(sharded.groups[0].shard.grad[:45], want, rtol=0, atol=1e-6)
        assert sharded.groups[0].grads.full  # the replicas' mean in .grad, as under DDP
        torch.testing.assert_close(_flat_grads(model), want, rtol=0, atol=1e-6)
        sharded.step()
        sharded.zero_grad()
        reference.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.data.copy_(p.data)


def test_zero1_buffer_is_not_zeroed_per_step_and_a_gradient_a_window_lacks_is_zero(one_rank_group):
    """ZeRO-1's persistent buffer is not zeroed at the step (a memset of the model's gradient bytes per step):
    each window's first gradient is copied in, and a parameter with no gradient in a window (a branch not
    taken) is zeroed as its bucket is reduced, so it does not carry the last window's. Exact against autograd
    over three windows, with the buffer still holding the last window's numbers after each step."""
    torch.manual_seed(0)
    model, reference = _Branchy(), _Branchy()
    reference.load_state_dict(model.state_dict())
    names = {p: n for n, p in model.named_parameters()}
    sharded = FlatShardedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), names=names, group=one_rank_group, zero_stage=1,
        reduce_gradients="every_microbatch", bucket_numel=16,
    )  # fmt: skip
    grads = sharded.groups[0].grads
    for window in ((True, True), (False, False), (False, True)):
        for k, use_skip in enumerate(window):
            sharded.queue.armed = k == len(window) - 1  # as the strategy arms it: the window's last backward
            x = torch.randn(5, 4)
            model(x, use_skip).square().sum().backward()
            reference(x, use_skip).square().sum().backward()
            sharded.queue.end_backward()
            sharded.after_backward()
        sharded.reduce_gradients()
        torch.testing.assert_close(sharded.groups[0].shard.grad[:45], _flat_grads(reference), rtol=0, atol=1e-6)
        sharded.step()
        sharded.zero_grad()
        reference.zero_grad()
        assert torch.count_nonzero(grads.flat) > 0  # not zeroed: the next window overwrites it
        for p, q in zip(model.parameters(), reference.parameters()):
            q.data.copy_(p.data)


def test_an_lr_scheduler_made_before_the_sharded_step_sees_its_steps_without_a_warning(one_rank_group):
    """Lightning makes the LR schedulers before the strategy shards the optimizer: ZeRO-1/2's step, which
    replaces the scheduler's wrapper of the optimizer's step and calls it, keeps the wrapper's mark, so the
    scheduler's first step does not warn that the optimizer's step was overridden (nor that it ran first)."""
    import warnings

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    names = {p: n for n, p in model.named_parameters()}
    sharded = FlatShardedOptimizer(
        optimizer, names=names, group=one_rank_group, zero_stage=1, reduce_gradients="every_microbatch", bucket_numel=4
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # either of the scheduler's warnings fails the test
        model(torch.randn(2, 4)).sum().backward()
        sharded.queue.end_backward()
        sharded.after_backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
