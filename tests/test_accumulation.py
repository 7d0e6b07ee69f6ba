"""AccumulationScheduler: exact windows against a hand-computed SGD reference on 2 DDP ranks; resume."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import WORKERS, launch

sys.path.insert(0, str(WORKERS))
from accumulate import toy_data

pytestmark = pytest.mark.multiproc

N, BATCH, WORLD, EPOCHS, LR = 44, 2, 2, 2, 0.05  # 11 batches per epoch on each rank


def reference(schedule: dict[int, int]) -> dict[int, list[float]]:
    """Plain PyTorch: each step averages exactly the samples of its window (step-keyed schedule)."""
    x, y = toy_data(N).tensors
    w = torch.full((4,), 0.1, dtype=torch.float64)
    c = torch.zeros((), dtype=torch.float64)
    global_batch = BATCH * WORLD  # global batch j = samples [4j, 4j + 4) with DistributedSampler(shuffle=False)
    batches = N // global_batch
    out: dict[int, list[float]] = {}
    step, k = 0, schedule[0]
    for _ in range(EPOCHS):
        b = 0
        while b < batches:
            wanted = schedule[max(key for key in schedule if key <= step)]
            if wanted != k and b % k == 0 and b % wanted == 0:  # windows start at multiples of their size
                k = wanted
            window = range(b, min(b + k, batches))
            idx = torch.cat([torch.arange(j * global_batch, (j + 1) * global_batch) for j in window])
            w_, c_ = w.clone().requires_grad_(), c.clone().requires_grad_()
            loss = ((x[idx] @ w_ + c_ - y[idx]) ** 2).mean()
            gw, gc = torch.autograd.grad(loss, (w_, c_))
            w, c = w - LR * gw, c - LR * gc
            step += 1
            out[step] = [*w.tolist(), float(c)]
            b += len(window)
    return out


@pytest.mark.parametrize(
    "schedule",
    [{0: 4, 2: 3}, {0: 2, 3: 4}],  # 4 -> 3 requested at batch 8; 2 -> 4 requested at batch 6
    ids=["4to3-at-batch8", "2to4-at-batch6"],
)
def test_every_step_is_the_exact_mean_of_its_window_on_2_ddp_ranks(tmp_path, schedule):
    cfg = {"schedule": schedule, "unit": "step", "epochs": EPOCHS, "n": N, "batch": BATCH, "out": str(tmp_path)}
    result = launch("accumulate.py", cfg, nproc=WORLD)
    expected = reference(schedule)
    for r in (0, 1):
        got = {int(s): w for s, w in result.rank(r)["weights"].items() if int(s) > 0}
        assert sorted(got) == sorted(expected), f"steps {sorted(got)} vs reference {sorted(expected)}"
        for step, weights in expected.items():
            assert got[step] == pytest.approx(weights, rel=1e-12, abs=1e-12), f"step {step}"
    ks = {int(s): k for s, k in result.rank(0)["ks"].items()}
    assert sorted(set(ks.values())) == sorted(set(schedule.values()))  # the change did happen


def test_killed_mid_window_resumes_the_schedule_exactly(tmp_path):
    schedule = {0: 2, 3: 4}
    base = {"schedule": schedule, "unit": "step", "epochs": EPOCHS, "n": N, "batch": BATCH}
    ft = {"every_n_train_steps": 1}
    ref = launch(
        "accumulate.py", {**base, "out": str(tmp_path / "ref"), "ft": {**ft, "dirpath": str(tmp_path / "a")}}, nproc=2
    )
    # batch 9 is the second batch of the window 8-10 (K = 4): half a window is lost with the process
    cfg = {
        **base,
        "out": str(tmp_path / "kill"),
        "ft": {**ft, "dirpath": str(tmp_path / "b")},
        "kill": {"batch": 9, "rank": 1},
    }
    killed = launch("accumulate.py", cfg, nproc=2, max_restarts=1, timeout=300)
    for r in (0, 1):
        assert killed.rank(r)["attempt"] == 1
        assert killed.rank(r)["state"] == ref.rank(r)["state"]  # K, samples counter, noise scale state
        last = str(max(int(s) for s in ref.rank(r)["weights"]))
        assert killed.rank(r)["weights"][last] == ref.rank(r)["weights"][last]


def _noise_scale(tmp_path, name: str, strategy: dict, nproc: int, batch: int) -> dict:
    """The adaptive unit's noise-scale state after 6 steps at K=2 (the same on every rank)."""
    cfg = {
        "ft": {"dirpath": str(tmp_path / name / "ckpt"), "every_n_train_steps": 100, "nan_policy": None},
        "steps": 6,
        "model": {"dropout": 0.0},
        "data": {"batch_size": batch},
        "strategy": strategy,
        "accumulation": {"unit": "adaptive", "schedule": {"0": 2}, "min_k": 2, "max_k": 2, "noise_ema": None},
        "out": str(tmp_path / name / "out"),
    }
    result = launch("fault_tolerant.py", cfg, nproc=nproc)
    states = [result.rank(r)["accumulation"]["noise"] for r in range(nproc)]
    assert all(state == states[0] for state in states), f"{name}: ranks disagree on the noise scale"
    assert states[0]["count"] == 6
    return states[0]


def test_noise_scale_is_the_same_whether_gradients_are_replicated_or_zero_sharded(tmp_path):
    """The adaptive unit measures the same noise scale under DDP and under HybridParallelStrategy dp2 with
    ZeRO-1 / 2 reducing once per step (the big-batch norm is summed over disjoint shards, not divided by
    the replicas). Under ZeRO-3, and ZeRO-2 reducing every micro-batch, every backward already averages over
    the replicas, so the small batch is the global micro-batch: it must match one process that takes that
    global micro-batch (the same samples: the sampler's order is strided over the ranks) with the same K."""

    def run(name: str, strategy: dict, nproc: int, batch: int) -> dict:
        return _noise_scale(tmp_path, name, strategy, nproc, batch)

    def hybrid(zero_stage: int, **zero: str) -> dict:
        kwargs = {"pipeline_parallel_size": 1, "zero_stage": zero_stage, "zero": zero}
        return {"name": "hybrid_class", "kwargs": kwargs}

    ddp = run("ddp", {"name": "ddp"}, 2, 4)
    # (ZeRO-0 takes DDP's path: gradients replicated until the window closes, as ZeRO-1 keeps them)
    for z, zero in ((1, {}), (2, {"reduce_gradients": "once_per_step"})):
        measured = run(f"zero{z}", hybrid(z, **zero), 2, 4)
        for key in ("g2", "trace"):
            assert measured[key] == pytest.approx(ddp[key], rel=1e-4), (z, key, measured, ddp)
    # ZeRO-3, and ZeRO-2 reducing every micro-batch: the first micro-batch's gradient is the replicas' mean
    single = run("single", {"name": "ddp"}, 1, 8)
    for name, strategy in (("zero3", hybrid(3)), ("zero2-every-microbatch", hybrid(2))):
        measured = run(name, strategy, 2, 4)
        for key in ("g2", "trace"):
            assert measured[key] == pytest.approx(single[key], rel=1e-4), (name, key, measured, single)


@pytest.mark.slow
def test_noise_scale_counts_each_element_once_under_tensor_parallelism(tmp_path):
    """dp2 x tp2: a gradient every tensor-parallel rank holds whole (norms, row-wise biases) is counted by one
    of them, split ones by each for its slice: the same noise scale as DDP on the same two replicas (ZeRO-0/1
    keep the window's gradients per replica) or as one process on the global micro-batch (ZeRO-2 reducing
    every micro-batch, ZeRO-3)."""
    ddp = _noise_scale(tmp_path, "ddp", {"name": "ddp"}, 2, 4)
    single = _noise_scale(tmp_path, "single", {"name": "ddp"}, 1, 8)
    for zero_stage, want in ((0, ddp), (1, ddp), (2, single), (3, single)):
        kwargs = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": zero_stage}
        measured = _noise_scale(tmp_path, f"tp2-zero{zero_stage}", {"name": "hybrid_class", "kwargs": kwargs}, 4, 4)
        for key in ("g2", "trace"):
            assert measured[key] == pytest.approx(want[key], rel=1e-4), (zero_stage, key, measured, want)
