"""Losing a node without losing the run: resumes on another number of data-parallel replicas, against the
uninterrupted run (fp32 or the agreed fp16 scaler, CPU gloo, no dropout).

Each run is a chain of jobs on different world sizes sharing one checkpoint folder. The uninterrupted run and
the chain see the same samples in every optimizer step: the accumulation is rescaled (K' = K x dp / dp'),
the data continues at the checkpoint's global sample and Lightning's batch counter is converted. What differs
is the order of floating-point sums (another split of the same samples into micro-batches and replicas).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, WORKERS, child_env, free_port, launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-4


def _corpus(tmp: Path) -> str:
    """535 characters: 52 training windows of 16 (stride 8). Not a whole number of global batches of 8: an epoch
    of the 2-replica run takes 48 (each rank drops its last, partial batch), of a one-process run 52 unless
    the epoch is ended where the uninterrupted run ends it."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "corpus.txt"
    rng = random.Random(0)
    path.write_text("".join(rng.choice("abcdefghij klmnop") for _ in range(535)))
    return str(path)


def _job(tmp: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "ft": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": 2},
        "model": {"dropout": 0.0},
        "data": {"data_path": _corpus(tmp), "batch_size": 4, **extra.pop("data", {})},
        "window_loss": True,
        "weights": str(tmp / f"{name}.pt"),
        "out": str(tmp / name),
        **extra,
    }


def _chain(tmp: Path, common: dict[str, Any], worlds: list[tuple[int, int]]) -> tuple[Any, list[Any]]:
    """The uninterrupted run on the first world, and the chain ``[(nproc, steps), ...]`` on one folder."""
    ref = launch("fault_tolerant.py", {**_job(tmp / "ref", "ref", **common), "steps": worlds[-1][1]},
                 nproc=worlds[0][0], timeout=300)  # fmt: skip
    runs = []
    for i, (nproc, steps) in enumerate(worlds):
        cfg = {**_job(tmp / "chain", f"run{i}", **common), "steps": steps}
        runs.append(launch("fault_tolerant.py", cfg, nproc=nproc, timeout=300))
    return ref, runs


def _compare(
    tmp: Path,
    ref: Any,
    runs: list[Any],
    first: int,
    last: int,
    loss_tol: float = LOSS_TOL,
    weight_tol: float = WEIGHT_TOL,
) -> None:
    steps = {}
    for run in runs:
        steps.update({int(k): v for k, v in run.rank(0)["steps"].items() if "window_loss" in v})
    expected = {int(k): v["window_loss"] for k, v in ref.rank(0)["steps"].items() if "window_loss" in v}
    assert sorted(steps) == list(range(first, last + 1)) == sorted(expected)
    worst = max(abs(steps[s]["window_loss"] - expected[s]) for s in steps)
    assert worst < loss_tol, {s: (steps[s]["window_loss"], expected[s]) for s in steps}
    # the same samples in every step (the token ids summed over the step's window and replicas)
    tokens = {int(k): v["window_tokens"] for k, v in ref.rank(0)["steps"].items() if "window_tokens" in v}
    assert {s: steps[s]["window_tokens"] for s in steps} == tokens
    ref_w = torch.load(tmp / "ref" / "ref.pt")
    got = torch.load(tmp / "chain" / f"run{len(runs) - 1}.pt")
    assert ref_w.keys() == got.keys()
    assert max((ref_w[k] - got[k]).abs().max().item() for k in ref_w) < weight_tol


def test_dp2_zero2_to_one_process_and_back_keeps_the_global_batch_and_the_data_order(tmp_path):
    """pp1 x dp2 ZeRO-2: 2 ranks to step 4 (mid-epoch), 1 process to step 9 (across the epoch's end, K=2),
    2 ranks to step 14; every step's loss and the final weights are the uninterrupted run's."""
    common = {"strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 2}}}
    ref, runs = _chain(tmp_path, common, [(2, 4), (1, 9), (2, 14)])
    _compare(tmp_path, ref, runs, 1, 14)
    assert (
        "world 2 -> 1 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept, resuming at sample 32 of epoch 0"
    ) in runs[1].output
    # step 9 is 3 steps of 8 samples into epoch 1 (an epoch is 48 samples, 6 steps)
    assert "world 1 -> 2 (dp 1 -> 2): accumulation 2 -> 1, global batch 8 kept, resuming at sample 24 of epoch 1" in (
        runs[2].output
    )
    assert runs[1].rank(0)["accumulate_grad_batches"] == 2 and runs[2].rank(1)["accumulate_grad_batches"] == 1


def test_pp2_dp2_zero1_to_pp2_dp1_and_back_with_a_sample_schedule(tmp_path):
    """pp2 x dp2 ZeRO-1 (4 ranks) to step 4, pp2 x dp1 (2 ranks) to step 8, 4 ranks to step 10, with an
    AccumulationScheduler keyed by samples (K 1 -> 2 at 40 samples, applied in the 2-rank run: K 2 -> 4 there):
    every step's loss and samples are the uninterrupted run's, and the schedule's state ends as its."""
    common = {
        "strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "zero_stage": 1}},
        "accumulation": {"schedule": {0: 1, 40: 2}, "unit": "samples"},
    }
    ref, runs = _chain(tmp_path, common, [(4, 4), (2, 8), (4, 10)])
    _compare(tmp_path, ref, runs, 1, 10)
    assert "world 4 -> 2 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept, resuming at sample 32 of epoch 0" in (
        runs[1].output
    )
    assert "world 2 -> 4 (dp 1 -> 2): accumulation 4 -> 2, global batch 16 kept, resuming at sample 32 of epoch 1" in (
        runs[2].output
    )
    assert runs[1].rank(0)["accumulation"]["scale"] == [2, 1]  # the schedule's K doubled on one replica
    for rank in range(4):  # K, samples, the noise state, and the scale back to 1
        assert runs[2].rank(rank)["accumulation"] == ref.rank(rank)["accumulation"]


def test_the_fp16_scalers_state_travels_to_another_world(tmp_path):
    """pp1 x dp2 ZeRO-1 with AdaptiveLossScalingPrecision (fp16, the adaptive policy) to step 4, one process to
    step 8: the scale, its counters and statistics end as the uninterrupted run's; the losses agree to fp16's
    rounding of sums in another order (1e-4), the weights to 1e-3 (Adam's update divides by the gradient's
    root mean square: a gradient rounded otherwise in fp16 moves a weight by a fraction of the LR, 3e-3)."""
    common = {
        "strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 1}},
        "plugin": {"policy": "adaptive", "config": {"init_scale": 2.0**12, "adapt_interval": 2}},
    }
    ref, runs = _chain(tmp_path, common, [(2, 4), (1, 8)])
    _compare(tmp_path, ref, runs, 1, 8, loss_tol=1e-4, weight_tol=1e-3)
    assert "world 2 -> 1 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept" in runs[1].output
    got, expected = runs[1].rank(0)["plugin"], ref.rank(0)["plugin"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():  # the scale and counters exactly, gradient statistics to fp16 rounding
        assert got[key] == (pytest.approx(value, rel=1e-3) if isinstance(value, float) else value), key
    assert got["scale"] == expected["scale"]


def test_one_process_to_two_ranks_halves_the_per_rank_batch_where_the_accumulation_cannot_halve(tmp_path):
    """1 process (batch 4, K=1) to step 4, then 2 ranks to step 14 (across the epoch's end at step 13): K would be
    1/2, so each rank takes batches of 2; every step is the one-process run's 4 samples. The loader has a worker
    process (it draws its indices when its iterator is made, and the resize makes the iterator again)."""
    common = {
        "strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 2}},
        "data": {"num_workers": 1},
    }
    ref, runs = _chain(tmp_path, common, [(1, 4), (2, 14)])
    _compare(tmp_path, ref, runs, 1, 14)
    assert "world 1 -> 2 (dp 1 -> 2): per-rank batch 4 -> 2, global batch 4 kept, resuming at sample 16 of epoch 0" in (
        runs[1].output
    )


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_worlds_that_cannot_continue_the_run_are_refused_on_every_rank_before_step_0(tmp_path):
    """From a 2-rank pp1 x dp2 checkpoint (global batch 8): 3 ranks cannot keep it (K 2/3, batch 8/3); a job that
    says on_world_size_change='refuse' stops on 1 rank; pp2 on 3 ranks names the usable world sizes. Each error
    is raised by every rank before any step, and the checkpoint folder is left as it was."""
    pp1 = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 1}}
    base = {**_job(tmp_path, "base", strategy=pp1), "steps": 2}
    launch("fault_tolerant.py", base, nproc=2)
    before = _files(tmp_path / "ckpt")
    cases = [
        (3, {"strategy": pp1}, "cannot keep the global batch on this world"),
        (1, {"strategy": pp1, "ft": {**base["ft"], "on_world_size_change": "refuse"}}, "on_world_size_change='refuse'"),
        (3, {"strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2}}},
         "pipeline_parallel_size (2) must divide the world size (3): this layout runs on 2, 4, 6, 8"),
    ]  # fmt: skip
    for i, (nproc, extra, message) in enumerate(cases):
        cfg = {**base, **extra, "steps": 6, "out": str(tmp_path / f"refused{i}")}
        result = launch("fault_tolerant.py", cfg, nproc=nproc, expect_success=False, timeout=120)
        assert result.returncode != 0
        for rank in range(nproc):
            report = result.rank(rank)
            assert message in report["error"], report["error"]
            assert "steps" not in report or not report["steps"]
        if i < 2:
            assert "Nothing was deleted" in result.rank(0)["error"]
            assert "Resume on" in result.rank(0)["error"]
        assert _files(tmp_path / "ckpt") == before


def test_torchrun_nnodes_1_to_2_goes_on_without_a_node_that_is_gone_for_good(tmp_path):
    """Two torchrun agents with ``--nnodes=1:2`` stand for two nodes (one rank each, pp1 x dp2 ZeRO-1). After step
    4's checkpoint the second node's rank hangs and the node is then killed outright (agent and worker, SIGKILL).
    The survivor's worker fails on the broken collective, its agent restarts it with a world of 1, and it
    resumes from step 4 with K doubled: the run ends at max_steps with the uninterrupted 2-rank run's losses,
    samples and weights."""
    common = {"strategy": {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 1}}}
    ref = launch("fault_tolerant.py", {**_job(tmp_path / "ref", "ref", **common), "steps": 8}, nproc=2)
    marker = tmp_path / "stuck"
    cfg = {**_job(tmp_path / "chain", "run0", **common), "steps": 8}
    out = Path(cfg["out"])
    out.mkdir(parents=True)
    port = free_port()
    agents = []
    for node, inject in (("a", {}), ("b", {"hang": {"step": 4, "rank": -1, "marker": str(marker)}})):
        path = out / f"config-{node}.json"
        path.write_text(json.dumps({**cfg, "inject": inject}))
        agents.append(
            subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=lh-elastic-{port}",
                 f"--rdzv-conf=is_host={int(node == 'a')},last_call_timeout=2,join_timeout=120",
                 "--max-restarts=2", "--monitor-interval=0.5", str(WORKERS / "fault_tolerant.py"), str(path)],
                cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )
        )  # fmt: skip
        if node == "a":
            time.sleep(1.0)  # the first agent hosts the rendezvous store
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert time.monotonic() < deadline, "the second node never reached step 4"
            assert agents[0].poll() is None and agents[1].poll() is None, "an agent ended early"
            time.sleep(0.2)
        # the node is gone: its worker (in a session of its own) and its agent, which never says goodbye
        os.kill(int(marker.read_text()), signal.SIGKILL)
        os.killpg(agents[1].pid, signal.SIGKILL)
        output, _ = agents[0].communicate(timeout=300)
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
        if marker.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(marker.read_text()), signal.SIGKILL)
    assert agents[0].returncode == 0, output[-6000:]
    report = json.loads((out / "rank0.json").read_text())
    assert report["attempt"] >= 1 and report["global_step"] == 8
    assert report["resumed_from"].endswith("step-000000004")
    assert "world 2 -> 1 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept, resuming at sample 32" in output
    expected = ref.rank(0)["steps"]
    for step in range(5, 9):
        got = report["steps"][str(step)]
        assert abs(got["window_loss"] - expected[str(step)]["window_loss"]) < LOSS_TOL, step
        assert got["window_tokens"] == expected[str(step)]["window_tokens"], step
    ref_w, got_w = torch.load(tmp_path / "ref" / "ref.pt"), torch.load(cfg["weights"])
    assert max((ref_w[k] - got_w[k]).abs().max().item() for k in ref_w) < WEIGHT_TOL


def test_dp2_tp2_to_dp1_tp2_and_back_keeps_the_tensor_parallel_degree(tmp_path):
    """dp2 x tp2 ZeRO-1 (4 ranks) to step 4, dp1 x tp2 (2 ranks) to step 8, 4 ranks to step 10: the tensor-
    parallel degree is kept and the data-parallel one re-derived from the world (the global batch kept by
    the accumulation); every step's loss and the final weights are the uninterrupted run's."""
    common = {"strategy": {"name": "hybrid_class", "kwargs": {"tensor_parallel_size": 2, "zero_stage": 1}}}
    ref, runs = _chain(tmp_path, common, [(4, 4), (2, 8), (4, 10)])
    _compare(tmp_path, ref, runs, 1, 10)
    assert "world 4 -> 2 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept, resuming at sample 32 of epoch 0" in (
        runs[1].output
    )
    assert runs[1].rank(0)["accumulate_grad_batches"] == 2 and runs[2].rank(3)["accumulate_grad_batches"] == 1
