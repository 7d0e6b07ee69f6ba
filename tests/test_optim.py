"""LAMB and LARS against hand-written reference steps; per-tensor norms over flat chunks; the ZeRO allow-list."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_hybrid.optim import LAMB, LARS, TensorPartition, register_elementwise
from lightning_hybrid.optim._shardable import _ELEMENTWISE, check_shardable


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64)),
            nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64)),
            nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]  # fmt: skip


def _grads(step: int, params: list[nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _norm(t: torch.Tensor) -> float:
    return math.sqrt(sum(float(x) ** 2 for x in t.reshape(-1)))


def _lamb_reference(weights, grads_per_step, lr, betas, eps, wd):
    """The paper's update, one element at a time in Python floats."""
    b1, b2 = betas
    w = [[float(x) for x in t.reshape(-1)] for t in weights]
    m = [[0.0] * len(t) for t in w]
    v = [[0.0] * len(t) for t in w]
    for step, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = [float(x) for x in g.reshape(-1)]
            m[i] = [b1 * a + (1 - b1) * x for a, x in zip(m[i], g)]
            v[i] = [b2 * a + (1 - b2) * x * x for a, x in zip(v[i], g)]
            u = [(a / (1 - b1**step)) / (math.sqrt(c / (1 - b2**step)) + eps) + wd * x
                 for a, c, x in zip(m[i], v[i], w[i])]  # fmt: skip
            wn, un = math.sqrt(sum(x * x for x in w[i])), math.sqrt(sum(x * x for x in u))
            ratio = wn / un if wn > 0 and un > 0 else 1.0
            w[i] = [x - lr * ratio * y for x, y in zip(w[i], u)]
    return [torch.tensor(t, dtype=torch.float64).view(ref.shape) for t, ref in zip(w, weights)]


def _lars_reference(weights, grads_per_step, lr, momentum, wd, tc, eps):
    w = [[float(x) for x in t.reshape(-1)] for t in weights]
    buf = [[0.0] * len(t) for t in w]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            d = [float(x) + wd * y for x, y in zip(g.reshape(-1), w[i])]
            wn, dn = math.sqrt(sum(x * x for x in w[i])), math.sqrt(sum(x * x for x in d))
            ratio = tc * wn / (dn + eps) if wn > 0 and dn > 0 else 1.0
            buf[i] = [momentum * b + lr * ratio * x for b, x in zip(buf[i], d)]
            w[i] = [x - b for x, b in zip(w[i], buf[i])]
    return [torch.tensor(t, dtype=torch.float64).view(ref.shape) for t, ref in zip(w, weights)]


def _run(optimizer_cls, kwargs, steps=3, seed=0):
    params = _params(seed)
    start = [p.detach().clone() for p in params]
    opt = optimizer_cls(params, **kwargs)
    grads = []
    for step in range(steps):
        grads.append(_grads(step, params))
        for p, g in zip(params, grads[-1]):
            p.grad = g.clone()
        opt.step()
    return start, grads, [p.detach() for p in params], opt


@pytest.mark.unit
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_the_papers_update(wd):
    kwargs = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": wd}
    start, grads, got, opt = _run(LAMB, kwargs)
    want = _lamb_reference(start, grads, 0.05, (0.9, 0.99), 1e-6, wd)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert set(opt.state[opt.param_groups[0]["params"][0]]) == {"step", "exp_avg", "exp_avg_sq"}  # Adam's keys
    # the all-zero tensor moved with ratio 1 (its norm is 0), the others with their own ratio
    assert not torch.equal(got[2], start[2])


@pytest.mark.unit
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lars_matches_the_papers_update(wd):
    kwargs = {"lr": 0.5, "momentum": 0.9, "weight_decay": wd, "trust_coefficient": 0.02, "eps": 1e-8}
    start, grads, got, _ = _run(LARS, kwargs)
    want = _lars_reference(start, grads, 0.5, 0.9, wd, 0.02, 1e-8)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.unit
@pytest.mark.parametrize("cls,kwargs", [(LAMB, {"lr": 0.05, "weight_decay": 0.1}), (LARS, {"lr": 0.5})])
def test_flat_chunks_across_tensor_boundaries_step_like_whole_tensors(cls, kwargs):
    """What ZeRO-1/2 hand the optimizer: slices of one flat buffer that cut across tensors, plus padding, with
    a TensorPartition saying which tensor each element belongs to. Stepped chunk by chunk, the norms must be
    the whole tensors' (the sums over ranks are the multi-process tests' part)."""
    _, _, want, _ = _run(cls, kwargs)
    params = _params()
    numels = [p.numel() for p in params]
    offsets = [0, numels[0], numels[0] + numels[1]]
    flat = torch.zeros(sum(numels) + 1, dtype=torch.float64)  # one element of padding
    for p, off in zip(params, offsets):
        flat[off : off + p.numel()] = p.detach().reshape(-1)
    starts = list(range(0, flat.numel(), 5))  # chunks of 5: 12 | 5 | 4 elements cut at 5, 10, 15, 20
    chunks = [nn.Parameter(flat[a : a + 5]) for a in starts]
    segments = TensorPartition.of_flat_ranges(zip(chunks, starts), offsets, numels, 0)
    assert segments[chunks[2]] == [(0, 0, 2), (1, 2, 5)]  # elements 10..14: the end of one tensor, the next
    assert segments[chunks[4]] == [(2, 0, 1)]  # element 20 is the last real one, 21 is padding
    opt = cls(chunks, **kwargs)
    opt.set_tensor_partition(TensorPartition(segments, 3, group=None))
    for step in range(3):
        grad = torch.zeros_like(flat)
        for g, off in zip(_grads(step, params), offsets):
            grad[off : off + g.numel()] = g.reshape(-1)
        for c, a in zip(chunks, starts):
            c.grad = grad[a : a + c.numel()].clone()
        opt.step()
    for p, off in zip(want, offsets):
        torch.testing.assert_close(flat[off : off + p.numel()].view_as(p), p, rtol=1e-12, atol=1e-12)
    assert flat[-1] == 0  # padding untouched


@pytest.mark.unit
def test_hyperparameters_are_validated_with_their_names():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        LAMB(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr"):
        LARS(p, lr=-1)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS(p, lr=0.1, trust_coefficient=0)


class _PerTensorNormSGD(torch.optim.Optimizer):
    """A per-tensor-norm optimizer as a user would write it: normalised gradient descent."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=group["lr"])


@pytest.mark.unit
def test_sharding_refuses_every_optimizer_not_known_to_be_elementwise():
    p = [nn.Parameter(torch.zeros(4, 4))]
    for opt in (torch.optim.Adafactor(p), _PerTensorNormSGD(p), torch.optim.LBFGS(p)):
        check_shardable(opt, 0)  # replicated: anything goes
        for stage in (1, 2, 3):
            with pytest.raises(ValueError, match=f"{type(opt).__name__} is not known to be element-wise") as err:
                check_shardable(opt, stage)
            assert f"zero_stage={stage}" in str(err.value) and "register_elementwise" in str(err.value)
    assert "rows and columns" in _message(torch.optim.Adafactor(p))
    for opt in (torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1, momentum=0.9), LAMB(p), LARS(p, lr=0.1)):
        for stage in (1, 2, 3):
            check_shardable(opt, stage)


def _message(opt) -> str:
    with pytest.raises(ValueError) as err:
        check_shardable(opt, 2)
    return str(err.value)


@pytest.mark.unit
def test_subclasses_keep_their_bases_verdict_unless_they_change_step():
    class LoggingAdamW(torch.optim.AdamW):
        def describe(self) -> str:
            return "adamw"

    class ClippingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    p = [nn.Parameter(torch.zeros(3))]
    check_shardable(LoggingAdamW(p), 2)

    class FirstAdamW(torch.optim.AdamW):
        pass

    # torch wraps `step` on the first instance of a class whose step is not wrapped yet: a subclass made
    # before any AdamW gets a wrapper of its own, and keeps AdamW's step all the same
    FirstAdamW.step = torch.optim.Optimizer.profile_hook_step(torch.optim.AdamW.step)
    assert FirstAdamW.step is not torch.optim.AdamW.step
    check_shardable(FirstAdamW(p), 2)
    with pytest.raises(ValueError, match="ClippingAdamW"):
        check_shardable(ClippingAdamW(p), 2)
    try:
        register_elementwise(ClippingAdamW)
        check_shardable(ClippingAdamW(p), 2)
    finally:
        _ELEMENTWISE.discard(ClippingAdamW)
    with pytest.raises(TypeError, match="Optimizer subclass"):
        register_elementwise(object)  # type: ignore[arg-type]


@pytest.mark.multiproc
def test_an_optimizer_that_sharding_would_change_fails_on_every_rank_before_step_0(tmp_path):
    from helpers import launch

    cfg = {
        "model": {"optimizer": "sgd", "lr": 0.5, "n_layer": 2},
        "data": {"global_batch": 4},
        "steps": 1,
        "torch_optimizer": "Adafactor",
        "strategy": {"name": "hybrid_class", "kwargs": {"data_parallel_size": 2, "zero_stage": 2}},
        "devices": 2,
        "out": str(tmp_path / "job"),
    }
    failed = launch("train_gpt.py", cfg, nproc=2, timeout=120, expect_success=False)
    assert failed.returncode != 0
    errors = [failed.rank(r)["error"] for r in range(2)]
    assert errors[0] == errors[1], errors
    assert "torch.optim.Adafactor is not known to be element-wise" in errors[0], errors[0]
    assert "zero_stage=2" in errors[0] and "rows and columns" in errors[0], errors[0]


@pytest.mark.multiproc
def test_layerwise_norms_are_whole_tensor_norms_over_real_shards(tmp_path):
    """2 ranks whose parts of each tensor have very different norms: LAMB over ZeRO-1 flat chunks (two
    parameter groups) and over FSDP2 rows equals one process; without the partition's all-reduce it does
    not (the check can fail); Adagrad, whose state exists before sharding, shards exactly too."""
    from helpers import launch

    job = launch("layerwise_norms.py", {"out": str(tmp_path / "job")}, nproc=2, timeout=120)
    for r in range(2):
        rep = job.rank(r)
        assert rep["flat"] < 1e-12, rep
        assert rep["fsdp"] < 1e-12, rep
        assert rep["adagrad"] < 1e-12, rep
        assert rep["flat_without_all_reduce"] > 1e-3, rep


@pytest.mark.multiproc
def test_lbfgs_evaluations_each_step_with_the_replicas_mean_gradient(tmp_path):
    """LBFGS evaluates its closure several times per step: under ZeRO-0 at dp2 every evaluation's gradient is
    the replicas' mean, as one process computes it on the whole batch (not only the first evaluation's)."""
    from helpers import launch
    from workers.common import ExactDataModule, build_model, global_batches

    lbfgs = {"lr": 0.5, "max_iter": 4, "history_size": 3}
    cfg = {
        "model": {"optimizer": "sgd", "lr": 0.5, "n_layer": 2},
        "data": {"global_batch": 8},
        "steps": 2,
        "torch_optimizer": "LBFGS",
        "torch_optimizer_kwargs": lbfgs,
        "strategy": {"name": "hybrid_class", "kwargs": {"data_parallel_size": 2, "zero_stage": 0}},
        "devices": 2,
        "weights": str(tmp_path / "weights.pt"),
        "out": str(tmp_path / "job"),
    }
    launch("train_gpt.py", cfg, nproc=2, timeout=180)
    # one process, plain torch: the same global batches, each step LBFGS with its own closure
    model = build_model(cfg)
    data = ExactDataModule(block_size=model.hparams.block_size, **cfg["data"])
    optimizer = torch.optim.LBFGS(model.parameters(), **lbfgs)
    batches = iter(global_batches(data.train_set, data.global_batch, data.seed))
    for _ in range(cfg["steps"]):
        x, y = next(batches)

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = model.pipeline_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    got = torch.load(tmp_path / "weights.pt")
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
