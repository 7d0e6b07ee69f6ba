"""FaultTolerantCheckpoint on real multi-process jobs (gloo): kills, signals, corruption, NaN, hangs, async.

Every resumed run is compared with an uninterrupted run of the same job (model with dropout, shuffled
data, 2 DDP ranks): on CPU with deterministic ops the final weights must be bitwise equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import launch

from lightning_hybrid.callbacks import HANG_EXIT_CODE, PREEMPTION_EXIT_CODE, PREEMPTION_SAVE_FAILED_EXIT_CODE

pytestmark = pytest.mark.multiproc

STEPS = 12


def _job(tmp: Path, name: str, **extra: Any) -> dict[str, Any]:
    ft = {"dirpath": str(tmp / name / "ckpt"), "every_n_train_steps": 2, **extra.pop("ft", {})}
    return {
        "ft": ft,
        "steps": STEPS,
        "model": {"dropout": 0.1},
        "weights": str(tmp / name / "weights.pt"),
        "out": str(tmp / name / "out"),
        **extra,
    }


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _launch_until_writing(cfg: dict[str, Any], marker: Path, timeout: float) -> tuple[threading.Thread, dict]:
    """Launch a 2-rank job in the background; return once a rank began writing a checkpoint (``marker``)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["r"] = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, timeout=timeout)

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 90
    while not marker.exists():
        assert time.monotonic() < deadline and job.is_alive(), "the save never started"
        time.sleep(0.05)
    return job, outcome


def _pids(cfg: dict[str, Any]) -> list[int]:
    """Each rank's process, from the report it writes when it starts."""
    return [json.loads((Path(cfg["out"]) / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Any]:
    """The uninterrupted 2-rank DDP run every interrupted run must reproduce."""
    tmp = tmp_path_factory.mktemp("ft-ref")
    cfg = _job(tmp, "ref")
    result = launch("fault_tolerant.py", cfg, nproc=2)
    return {"weights": Path(cfg["weights"]), "steps": result.rank(0)["steps"]}


@pytest.mark.parametrize("seed", [11, 23, 37])
def test_kill9_one_rank_restart_in_place_ends_with_the_uninterrupted_weights(tmp_path, reference, seed):
    step = random.Random(seed).randint(1, STEPS - 1)
    victim = random.Random(seed).randint(0, 1)
    cfg = _job(tmp_path, "kill", inject={"kill": {"step": step, "rank": victim}})
    result = launch("fault_tolerant.py", cfg, nproc=2, max_restarts=1, timeout=300)
    for rank in (0, 1):
        report = result.rank(rank)
        assert report["attempt"] == 1, f"rank {rank} was not restarted (killed at step {step})"
        saved = ((step - 1) // 2) * 2  # killed before the save of its own step
        if saved:
            assert report["resumed_from"].endswith(f"step-{saved:09d}/checkpoint.pt")
        assert report["global_step"] == STEPS
    assert _max_diff(reference["weights"], Path(cfg["weights"])) == 0.0, f"killed rank {victim} at step {step}"


def test_sigterm_to_one_rank_saves_on_all_ranks_and_the_relaunch_resumes_exactly(tmp_path, reference):
    cfg = _job(tmp_path, "term", inject={"signal": {"step": 5, "rank": 1}}, ft={"every_n_train_steps": 100})
    start = time.monotonic()
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    for rank in (0, 1):
        report = result.rank(rank)
        assert report.get("exit_code") == PREEMPTION_EXIT_CODE, report
        assert report["global_step"] == 6  # signalled during step 6: saved at its end
    step_dir = Path(cfg["ft"]["dirpath"]) / "step-000000006"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert {"checkpoint.pt", "rank-00000.pt", "rank-00001.pt"} <= set(manifest["files"])
    assert elapsed < 60, f"preemption took {elapsed:.0f}s"

    relaunch = launch("fault_tolerant.py", {**cfg, "inject": {}}, nproc=2)
    assert relaunch.rank(0)["resumed_from"].endswith("step-000000006/checkpoint.pt")
    assert _max_diff(reference["weights"], Path(cfg["weights"])) == 0.0
    # the resumed run logs the same losses as the uninterrupted one from step 7 on
    for step in range(7, STEPS + 1):
        assert relaunch.rank(0)["steps"][str(step)]["loss"] == reference["steps"][str(step)]["loss"]


def test_kill_during_a_write_and_corrupted_checkpoints_fall_back_to_the_previous_valid_one(tmp_path, reference):
    # a rank dies half-way through writing step 6's file: the restart must resume from step 4
    cfg = _job(tmp_path, "corrupt", inject={"kill_in_write": {"step": 6, "rank": 0}}, ft={"keep_last": 3})
    result = launch("fault_tolerant.py", cfg, nproc=2, max_restarts=1, timeout=300)
    assert result.rank(0)["attempt"] == 1
    assert result.rank(0)["resumed_from"].endswith("step-000000004/checkpoint.pt")
    assert _max_diff(reference["weights"], Path(cfg["weights"])) == 0.0

    # now damage the newest two: flip one byte of step 12, truncate a rank file of step 10
    root = Path(cfg["ft"]["dirpath"])
    newest = root / "step-000000012" / "checkpoint.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    rank_file = root / "step-000000010" / "rank-00001.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])

    # asking for the corrupted one explicitly is refused on every rank, with the reason
    refused = launch("fault_tolerant.py", {**cfg, "inject": {}, "resume": str(newest)}, nproc=2, expect_success=False)
    assert refused.returncode != 0
    for rank in (0, 1):
        assert "Refusing to resume from" in refused.rank(rank)["error"]
        assert "SHA-256" in refused.rank(rank)["error"]

    # "last" resumes from the newest checkpoint that validates on every rank, naming the ones it skips
    again = launch("fault_tolerant.py", {**cfg, "inject": {}, "steps": STEPS + 2}, nproc=2)
    for rank in (0, 1):
        assert again.rank(rank)["resumed_from"].endswith("step-000000008/checkpoint.pt")
    assert "skipping checkpoint" in again.output and "step-000000012: checkpoint.pt does not match" in again.output
    assert "step-000000010: rank-00001.pt has 100 bytes" in again.output

    # with no valid checkpoint left, "last" starts fresh (from the initial weights, saved as step 0)
    for step_dir in root.glob("step-*"):
        (step_dir / "manifest.json").write_text("{")
    fresh = launch("fault_tolerant.py", {**cfg, "inject": {}, "steps": 4}, nproc=2)
    assert "no valid checkpoint under" in fresh.output and "starting fresh" in fresh.output
    for rank in (0, 1):
        assert fresh.rank(rank)["resumed_from"].endswith("step-000000000/checkpoint.pt")
        assert fresh.rank(rank)["global_step"] == 4
    # exactly a first run: the initial weights, RNG streams and data order of the uninterrupted one
    for step in range(1, 5):
        assert fresh.rank(0)["steps"][str(step)]["loss"] == reference["steps"][str(step)]["loss"]


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_nan_on_one_rank_triggers_the_same_policy_on_every_rank(tmp_path, policy):
    # the loss of the batch that starts at step 5 is NaN on rank 1 only
    cfg = _job(tmp_path, policy, inject={"nan": {"step": 5, "rank": 1}}, ft={"nan_policy": policy}, steps=8)
    cfg["model"].update({"warmup_steps": 20, "max_steps": 20})  # the LR changes at every step
    result = launch("fault_tolerant.py", cfg, nproc=2)
    for rank in (0, 1):
        report = result.rank(rank)
        steps = report["steps"]
        assert report["nonfinite_steps"] == 1
        assert report["global_step"] == 8
        if policy == "skip":
            assert steps["6"]["digest"] == steps["5"]["digest"]  # the update of step 6 did not happen
            assert steps["6"]["lr"] == steps["5"]["lr"]  # nor did the LR schedule advance
            assert report["rollbacks"] == 0
        else:
            assert steps["6"]["digest"] == steps["4"]["digest"]  # back to the checkpoint of step 4
            assert report["rollbacks"] == 1
        assert steps["7"]["digest"] != steps["6"]["digest"]  # and training goes on
        assert steps["7"]["lr"] > steps["6"]["lr"] > steps["4"]["lr"]
        assert steps["7"]["lr_used"] == steps["6"]["lr"]  # a rollback restores the optimizer state, not its LR
    # both ranks hold the same weights afterwards
    assert result.rank(0)["steps"]["8"]["digest"] == result.rank(1)["steps"]["8"]["digest"]


def test_watchdog_exits_a_hung_job_and_names_the_stuck_rank(tmp_path):
    cfg = _job(tmp_path, "hang", inject={"hang": {"step": 3, "rank": 1}}, ft={"hang_timeout": 4})
    start = time.monotonic()
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, timeout=120, torchrun=True)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "watchdog: no training step finished" in result.output
    assert "1: 'finished step 3'" in result.output and "stuck: rank(s) [1]" in result.output
    assert f"exitcode  : {HANG_EXIT_CODE}" in result.output


def test_no_valid_checkpoint_left_under_a_sharded_strategy_starts_fresh_instead_of_a_crash_loop(tmp_path):
    """Every checkpoint invalid under HybridParallelStrategy: the initial state is saved as step 0 for Lightning to
    load; it was saved in setup, before the strategy could hand over its state ("The gradient synchronisation is
    chosen in setup()"), and every relaunch failed the same way. Now it is saved from on_fit_start."""
    strategy = {"name": "hybrid_class", "kwargs": {"zero_stage": 2}}
    first = _job(tmp_path, "first", strategy=strategy, steps=4)
    launch("fault_tolerant.py", first, nproc=2)
    root = Path(first["ft"]["dirpath"])
    for step_dir in root.glob("step-*"):
        (step_dir / "manifest.json").write_text("{")
    again = _job(tmp_path, "first", strategy=strategy, steps=4)
    fresh = launch("fault_tolerant.py", again, nproc=2)
    assert "no valid checkpoint under" in fresh.output and "starting fresh" in fresh.output
    for rank in (0, 1):
        assert fresh.rank(rank)["resumed_from"].endswith("step-000000000")
        assert fresh.rank(rank)["global_step"] == 4
    reference = _job(tmp_path, "reference", strategy=strategy, steps=4)
    launch("fault_tolerant.py", reference, nproc=2)
    assert _max_diff(Path(reference["weights"]), Path(again["weights"])) == 0.0


@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_full_disk_on_one_rank_of_a_sharded_save_fails_that_checkpoint_on_every_rank_and_training_goes_on(
    tmp_path, save
):
    """HybridParallelStrategy: a rank whose own file (its rank file; on rank 0 also meta.pt) cannot be written
    used to skip DCP's collective write the other ranks were already in: both waited forever (found by the
    soak, with the disk filled between two ranks' writes). Now every rank takes part, the checkpoint fails on
    every rank alike and is removed, and training goes on to the uninterrupted weights."""
    strategy = {"name": "hybrid_class", "kwargs": {"zero_stage": 2}}
    ft = {"async_save": save == "async", "hang_timeout": 20}
    reference = _job(tmp_path, "reference", strategy=strategy, steps=6, ft=ft)
    launch("fault_tolerant.py", reference, nproc=2)
    # the rank's own file, on each rank; then DCP's data file on one rank, inside DCP's collective save (raised
    # on every rank as DCP's CheckpointException, a BaseException)
    for name, inject in (("rank1", "fail_write"), ("rank0", "fail_write"), ("dcp", "fail_dcp_write")):
        cfg = _job(tmp_path, name, strategy=strategy, steps=6, ft=ft)
        cfg["inject"] = {inject: {"step": 4, "rank": 0 if name == "rank0" else 1}}
        result = launch("fault_tolerant.py", cfg, nproc=2, timeout=120)
        assert "step-000000004 failed and is not marked complete" in result.output, result.output[-3000:]
        assert "No space left on device (injected" in result.output
        root = Path(cfg["ft"]["dirpath"])
        assert not (root / "step-000000004").exists()
        assert (root / "step-000000006" / "manifest.json").exists()
        assert _max_diff(Path(reference["weights"]), Path(cfg["weights"])) == 0.0


def test_a_rank_stopped_during_a_save_does_not_keep_its_peer_waiting(tmp_path):
    """SIGSTOP (a hung node) of rank 1 while it writes checkpoint 4: rank 0 waits in the save's commit, which the
    watchdog does not count as a hung step; it used to wait there until the process-group timeout (30 min).
    Now the waiting rank sees rank 1's heartbeat stop and exits with HANG_EXIT_CODE, naming it."""
    marker = tmp_path / "writing"
    inject = {"slow_write": {"step": 4, "seconds": 6, "rank": 1, "marker": str(marker)}}
    cfg = _job(tmp_path, "stopped", inject=inject, ft={"every_n_train_steps": 4, "hang_timeout": 3})
    job, outcome = _launch_until_writing(cfg, marker, timeout=150)
    os.kill(_pids(cfg)[1], signal.SIGSTOP)
    stopped = time.monotonic()
    job.join(timeout=160)
    result = outcome["r"]
    # rank 0 exits on its own (about 1.5 x hang_timeout after its wait began); the launcher then SIGKILLs the
    # stopped rank after its 30 s grace, as torchrun's agent does
    assert time.monotonic() - stopped < 50
    assert result.returncode != 0
    assert "[rank 0] watchdog: no training step finished" in result.output, result.output[-4000:]
    assert "waits in checkpoint I/O and rank(s) [1] sent no heartbeat" in result.output


def test_async_save_resumes_exactly_and_a_failed_background_write_is_never_marked_complete(tmp_path, reference):
    cfg = _job(
        tmp_path,
        "async",
        ft={"async_save": True},
        inject={"kill": {"step": 9, "rank": 0}, "fail_write": {"step": 4, "rank": 1}},
    )
    result = launch("fault_tolerant.py", cfg, nproc=2, max_restarts=1, timeout=300)
    assert result.rank(0)["attempt"] == 1
    assert "step-000000004 failed and is not marked complete" in result.output
    assert "No space left on device (injected)" in result.output
    assert not (Path(cfg["ft"]["dirpath"]) / "step-000000004").exists()  # removed at once, not at the next start
    # step 8 was still being completed (one batch after its write starts) when rank 0 died at step 9
    assert result.rank(0)["resumed_from"].endswith("step-000000006/checkpoint.pt")
    assert _max_diff(reference["weights"], Path(cfg["weights"])) == 0.0


HYBRID = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "zero_stage": 1, "schedule": "1f1b"}}


def test_all_together_pp2_dp2_killed_mid_window_resumes_exactly_and_on_another_layout(tmp_path):
    """HybridParallelStrategy (pp2 x dp2, ZeRO-1) + AdaptiveLossScalingPrecision (fp16) + an AccumulationScheduler
    that changes K from 1 to 2 mid-run + FaultTolerantCheckpoint, one rank killed mid-window."""
    plugin = {"policy": "adaptive", "config": {"init_scale": 2.0**12, "adapt_interval": 2}}
    # K=1 for steps 1-3 (batches 0-2); K=2 from batch 4 (the change waits for an even batch): step 7 = batches 10-11
    accumulation = {"schedule": {0: 1, 3: 2}, "unit": "step"}
    common = {"strategy": HYBRID, "steps": 8, "plugin": plugin, "accumulation": accumulation}
    ref_cfg = _job(tmp_path, "hybrid-ref", **common)
    ref = launch("fault_tolerant.py", ref_cfg, nproc=4, timeout=300)
    # batch 10 opens the window of step 7: rank 2 dies with half a window of gradients accumulated
    cfg = _job(tmp_path, "hybrid-kill", inject={"kill_batch": {"batch": 10, "rank": 2}}, **common)
    killed = launch("fault_tolerant.py", cfg, nproc=4, max_restarts=1, timeout=400)
    for rank in range(4):
        assert killed.rank(rank)["attempt"] == 1
        assert killed.rank(rank)["resumed_from"].endswith("step-000000006")  # a sharded (DCP) checkpoint
        assert killed.rank(rank)["accumulation"] == ref.rank(rank)["accumulation"]  # K, samples, noise state
    assert _max_diff(Path(ref_cfg["weights"]), Path(cfg["weights"])) == 0.0
    for step in range(7, 9):
        assert killed.rank(0)["steps"][str(step)]["loss"] == ref.rank(0)["steps"][str(step)]["loss"]
        assert killed.rank(0)["steps"][str(step)]["scale"] == ref.rank(0)["steps"][str(step)]["scale"]
    assert killed.rank(3)["plugin"] == ref.rank(3)["plugin"]  # the loss scaler's state resumed exactly
    manifest = json.loads((Path(cfg["ft"]["dirpath"]) / "step-000000008" / "manifest.json").read_text())
    assert manifest["layout"]["pipeline_parallel_size"] == 2 and manifest["world_size"] == 4

    # the same checkpoint directory resumes on 2 processes without a pipeline (pp1 x dp2, ZeRO-0)
    other = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 1, "zero_stage": 0}}
    moved_cfg = {**cfg, "inject": {}, "strategy": other, "steps": 10, "out": str(tmp_path / "moved"), "weights": None}
    del moved_cfg["plugin"]  # fp32 now: the checkpoint's loss-scaler state is simply not used
    moved = launch("fault_tolerant.py", moved_cfg, nproc=2)
    weights = torch.load(cfg["weights"])
    digest = sum(v.double().abs().sum().item() for k, v in weights.items() if not k.startswith("val_"))
    for rank in (0, 1):
        report = moved.rank(rank)
        assert report["resumed_from"].endswith("step-000000008")
        assert report["steps"]["8"]["digest"] == pytest.approx(digest, rel=1e-12)  # the pp2 x dp2 weights
        assert report["global_step"] == 10
    assert "FaultTolerantCheckpoint: resumed on" not in moved.output  # dp 2 -> 2: the same samples per step


def test_a_resume_on_fewer_replicas_that_keeps_the_per_rank_batch_says_so_and_records_true_positions(tmp_path):
    """2 ranks checkpoint, 1 rank resumes with on_world_size_change='keep_per_rank_batch': the global batch
    halves, and the job says so in one line (nothing changes silently)."""
    cfg = _job(tmp_path, "shrink", steps=4)
    launch("fault_tolerant.py", cfg, nproc=2)
    ft = {**cfg["ft"], "on_world_size_change": "keep_per_rank_batch"}
    resumed = launch(
        "fault_tolerant.py", {**cfg, "ft": ft, "steps": 6, "out": str(tmp_path / "shrink" / "one")}, nproc=1
    )
    assert resumed.rank(0)["resumed_from"].endswith("step-000000004/checkpoint.pt")
    assert resumed.rank(0)["global_step"] == 6
    assert (
        "FaultTolerantCheckpoint: world 2 -> 1 (dp 2 -> 1): per-rank batch 4 and accumulation 1 kept"
        " (on_world_size_change='keep_per_rank_batch'), global batch 8 -> 4: the loss curve departs from the"
        " uninterrupted run's; resuming at sample 32 of epoch 0"
    ) in resumed.output

    # the positions it records are global samples of this world's batches (Lightning's restored batch counter
    # is in the 2-rank world's batches): step 6 is 2 one-rank batches of 4 after step 4, in the same epoch
    def position(step: int) -> dict[str, int]:
        payload = torch.load(Path(cfg["ft"]["dirpath"]) / f"step-{step:09d}" / "checkpoint.pt", weights_only=True)
        return next(v for k, v in payload["callbacks"].items() if "FaultTolerantCheckpoint" in k)["data_position"]

    before, after = position(4), position(6)
    assert before["epoch"] == after["epoch"] and (before["replicas"], after["replicas"]) == (2, 1)
    assert after["consumed"] == before["consumed"] + 2 * 4


# ------------------------------------------------------------------------------ signals and failures


def _fake_scontrol(tmp: Path) -> tuple[dict[str, str], Path]:
    """An `scontrol` on PATH that records its arguments (the job's requeue requests) instead of acting."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    calls = tmp / "scontrol-calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}, calls


VALIDATING = {"limit_val_batches": 6, "val_check_interval": 4, "num_sanity_val_steps": 2}


def test_sigterm_during_the_sanity_check_exits_75_and_requeues(tmp_path):
    env, calls = _fake_scontrol(tmp_path)
    inject = {"signal_in_validation": {"batch": 0, "step": 0, "rank": 1}}
    cfg = _job(tmp_path, "sanity", inject=inject, trainer=VALIDATING, ft={"requeue": True})
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, env=env)
    for rank in (0, 1):
        report = result.rank(rank)
        # Lightning's own handler would end this with SIGTERMException: exit status 0, a "success"
        assert report.get("exit_code") == PREEMPTION_EXIT_CODE, report
        assert report["global_step"] == 0 and report["validation_batches"] == 1  # at the next batch boundary
    assert calls.read_text() == "requeue 4242\n"
    assert not list(Path(cfg["ft"]["dirpath"]).glob("step-*"))  # nothing trained yet: nothing to save


def test_sigterm_during_validation_saves_at_the_next_validation_batch_and_resumes_exactly(tmp_path):
    trainer = {**VALIDATING, "num_sanity_val_steps": 0}
    ref_cfg = _job(tmp_path, "val-ref", trainer=trainer, ft={"every_n_train_steps": 100})
    ref = launch("fault_tolerant.py", ref_cfg, nproc=2)
    assert ref.rank(0)["validation_batches"] == 18  # 6 batches after steps 4, 8, 12
    inject = {"signal_in_validation": {"batch": 1, "step": 4, "rank": 1}}
    cfg = _job(tmp_path, "val", trainer=trainer, inject=inject, ft={"every_n_train_steps": 100})
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False)
    for rank in (0, 1):
        report = result.rank(rank)
        assert report.get("exit_code") == PREEMPTION_EXIT_CODE, report
        assert report["validation_batches"] == 2, "waited for the rest of the validation loop"
    assert (Path(cfg["ft"]["dirpath"]) / "step-000000004" / "manifest.json").is_file()
    relaunch = launch("fault_tolerant.py", {**cfg, "inject": {}}, nproc=2)
    assert relaunch.rank(0)["resumed_from"].endswith("step-000000004/checkpoint.pt")
    assert _max_diff(Path(ref_cfg["weights"]), Path(cfg["weights"])) == 0.0
    for step in range(5, STEPS + 1):
        assert relaunch.rank(0)["steps"][str(step)]["loss"] == ref.rank(0)["steps"][str(step)]["loss"]


def test_a_preemption_during_a_validation_inside_an_accumulation_window_takes_the_window_again(tmp_path):
    """K=3 and validation every 4 batches: the validation after batch 3 falls inside step 2's window. A preemption
    there saves a checkpoint that holds none of that window's gradient; the resume takes the window again from
    its start (batch 3), so the run ends with the uninterrupted weights (going on mid-window would make step 2
    miss batch 3)."""
    trainer = {**VALIDATING, "num_sanity_val_steps": 0, "accumulate_grad_batches": 3}
    common = {"trainer": trainer, "model": {"dropout": 0.0}, "steps": 4, "ft": {"every_n_train_steps": 100}}
    ref_cfg = _job(tmp_path, "window-ref", **common)
    launch("fault_tolerant.py", ref_cfg, nproc=2)
    inject = {"signal_in_validation": {"batch": 1, "step": 1, "rank": 1}}
    cfg = _job(tmp_path, "window", inject=inject, **common)
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False)
    assert result.rank(0).get("exit_code") == PREEMPTION_EXIT_CODE, result.rank(0)
    relaunch = launch("fault_tolerant.py", {**cfg, "inject": {}}, nproc=2)
    assert relaunch.rank(0)["resumed_from"].endswith("step-000000001/checkpoint.pt")
    assert _max_diff(Path(ref_cfg["weights"]), Path(cfg["weights"])) == 0.0
    assert (
        "the checkpoint was written at sample 32 of epoch 0, inside an accumulation window whose gradient it does"
        " not hold: resuming at the window's start, sample 24"
    ) in relaunch.output


def test_a_preemption_whose_save_fails_exits_74_and_is_not_requeued(tmp_path):
    env, calls = _fake_scontrol(tmp_path)
    inject = {"signal": {"step": 5, "rank": 1}, "fail_write": {"step": 6, "rank": 0}}
    cfg = _job(tmp_path, "nospace", inject=inject, ft={"every_n_train_steps": 4, "requeue": True})
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, env=env)
    for rank in (0, 1):
        assert result.rank(rank).get("exit_code") == PREEMPTION_SAVE_FAILED_EXIT_CODE, result.rank(rank)
    assert "No space left on device (injected)" in result.output
    assert "preemption at step 6: the save FAILED" in result.output and "step-000000004" in result.output
    assert "exiting with code 75" not in result.output
    assert not calls.exists(), "a job whose newest work is lost must not be requeued"
    root = Path(cfg["ft"]["dirpath"])
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000000004"]  # the failed folder is gone at once


def test_a_checkpoint_folder_gone_during_a_preemption_save_exits_74_on_every_rank(tmp_path):
    """Only rank 0 creates the folder: its failure must reach every rank, not leave them in a collective."""
    env, calls = _fake_scontrol(tmp_path)
    cfg = _job(tmp_path, "gone", ft={"every_n_train_steps": 4, "requeue": True})
    cfg["inject"] = {
        "signal": {"step": 5, "rank": 1},
        "vanish": {"step": 5, "rank": 0, "dirpath": cfg["ft"]["dirpath"]},
    }
    start = time.monotonic()
    result = launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, env=env, timeout=120)
    assert time.monotonic() - start < 60
    for rank in (0, 1):
        assert result.rank(rank).get("exit_code") == PREEMPTION_SAVE_FAILED_EXIT_CODE, result.rank(rank)
    assert "cannot create a folder under" in result.output and not calls.exists()


def test_a_checkpoint_write_longer_than_hang_timeout_is_not_a_hang(tmp_path, reference):
    inject = {"slow_write": {"step": 4, "seconds": 8, "rank": 1}}
    cfg = _job(tmp_path, "slow", inject=inject, ft={"async_save": True, "hang_timeout": 3})
    result = launch("fault_tolerant.py", cfg, nproc=2, timeout=180)
    assert "watchdog" not in result.output
    assert result.rank(0)["global_step"] == STEPS
    assert _max_diff(reference["weights"], Path(cfg["weights"])) == 0.0


def test_ctrl_c_during_a_synchronous_save_stops_the_run(tmp_path):
    marker = tmp_path / "writing"
    inject = {"slow_write": {"step": 4, "seconds": 120, "rank": -1, "marker": str(marker)}}
    cfg = _job(tmp_path, "ctrlc", inject=inject)
    job, outcome = _launch_until_writing(cfg, marker, timeout=120)
    started = time.monotonic()
    pids = _pids(cfg)
    for pid in pids:  # what a terminal's Ctrl-C does: SIGINT to every process of the job
        os.kill(pid, signal.SIGINT)
    job.join(timeout=100)
    if job.is_alive():  # where each rank is: every thread's stack, into its log
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
        time.sleep(3)
        logs = "\n".join(p.read_text(errors="replace")[-6000:] for p in sorted(Path(cfg["out"]).glob("rank*.log")))
        raise AssertionError(f"the job did not end 100 s after Ctrl-C; the ranks' stacks:\n{logs}")
    assert time.monotonic() - started < 30, "the interrupted save was swallowed and the run went on"
    result = outcome["r"]
    assert result.returncode != 0
    for rank in (0, 1):
        report = result.rank(rank)
        assert report.get("exit_code") == 1 and report["global_step"] == 4, report
    assert not (Path(cfg["ft"]["dirpath"]) / "step-000000004" / "manifest.json").exists()
