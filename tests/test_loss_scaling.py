"""AdaptiveLossScalingPrecision on 2-rank jobs: one rank overflows, every rank skips the same step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import launch

pytestmark = pytest.mark.multiproc

PIPELINE = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "schedule": "1f1b"}}
ZERO2 = {"name": "hybrid_class", "kwargs": {"zero_stage": 2}}
TP2 = {"name": "hybrid_class", "kwargs": {"tensor_parallel_size": 2}}
PLUGIN = {"policy": "dynamic", "config": {"init_scale": 2.0**8, "growth_interval": 3}}


def _job(tmp: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "ft": {"dirpath": str(tmp / name / "ckpt"), "every_n_train_steps": 2},
        "steps": 8,
        "model": {"dropout": 0.0, "warmup_steps": 20},
        "plugin": PLUGIN,
        "out": str(tmp / name / "out"),
        **extra,
    }


@pytest.mark.parametrize("strategy", [PIPELINE, ZERO2, TP2], ids=["pipeline-pp2", "zero2-dp2", "tp2"])
def test_inf_in_one_ranks_gradients_skips_the_step_on_every_rank(tmp_path, strategy):
    # rank 1 holds the second pipeline stage / the second ZeRO shard / the second tensor-parallel slice of
    # each split matrix; its gradient overflows in step 5
    cfg = _job(tmp_path, "inf", strategy=strategy, inject={"inf": {"step": 4, "rank": 1}})
    result = launch("fault_tolerant.py", cfg, nproc=2)
    reports = [result.rank(r) for r in (0, 1)]
    for report in reports:
        steps = report["steps"]
        assert [s["skipped"] for k, s in sorted(steps.items(), key=lambda kv: int(kv[0])) if "skipped" in s] == [
            False, False, False, False, True, False, False, False
        ]  # fmt: skip
        assert steps["5"]["digest"] == steps["4"]["digest"]  # parameters unchanged by the skipped step
        assert steps["5"]["lr"] == steps["4"]["lr"] and steps["6"]["lr"] > steps["5"]["lr"]  # LR held
        # 2**8, grows after 3 clean steps, halves on the overflow, grows again 3 clean steps later
        assert [steps[str(k)]["scale"] for k in range(1, 9)] == [256, 256, 512, 512, 256, 256, 256, 512]
        assert report["plugin"]["skipped_steps"] == 1
    assert reports[0]["plugin"] == reports[1]["plugin"]  # the same state machine state on both ranks


def test_resume_mid_run_restores_the_loss_scale_exactly(tmp_path):
    ref = launch("fault_tolerant.py", _job(tmp_path, "ref", strategy=ZERO2), nproc=2)
    # rank 0 dies at the end of step 5; torchrun restarts both in place, the scale grows again at step 6
    cfg = _job(tmp_path, "kill", strategy=ZERO2, inject={"kill": {"step": 5, "rank": 0}})
    cfg["ft"]["async_save"] = True  # ZeRO-2 state (each rank's slice) staged to CPU and written in background
    killed = launch("fault_tolerant.py", cfg, nproc=2, max_restarts=1, timeout=300)
    for rank in (0, 1):
        report = killed.rank(rank)
        # step 4's write is completed by the ranks' agreement at the end of step 5, which rank 0 never reached
        assert report["attempt"] == 1 and report["resumed_from"].endswith("step-000000002")
        assert report["plugin"] == ref.rank(rank)["plugin"]  # scale, trackers and counters
        assert report["steps"]["8"]["digest"] == ref.rank(rank)["steps"]["8"]["digest"]
        assert [report["steps"][str(k)]["scale"] for k in (6, 7, 8)] == [
            ref.rank(rank)["steps"][str(k)]["scale"] for k in (6, 7, 8)
        ]
