"""Real Slurm tier: the example's sbatch script, preempted by a signal, requeues itself and resumes exactly.

The cluster (two emulated nodes on this host) is started by ``tests/slurm/cluster.sh``, which installs
Debian's Slurm when it is missing; the tier is skipped, with the reason, only where that is impossible.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, child_env

from lightning_hybrid.utilities import consolidate_checkpoint

pytestmark = pytest.mark.slurm

STEPS = 40


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "tests/slurm/cluster.sh"), "start"], capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _job_state(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


# a pending job with one of these reasons will never start on its own
HOPELESS = {"PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit", "ReqNodeNotAvail"}


def _fail(job: str, why: str, log: Path) -> None:
    subprocess.run(["scancel", job], check=False)
    text = log.read_text() if log.exists() else "(no log yet)"
    nodes = subprocess.run(["sinfo", "-N", "-o", "%N %t %c %E"], capture_output=True, text=True).stdout
    pytest.fail(f"job {job}: {why}\nstate: {_job_state(job)}\nnodes:\n{nodes}\njob log:\n{text[-6000:]}")


def _wait(job: str, predicate, what: str, timeout: float, log: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _job_state(job)
        if predicate(state):
            return state
        if state.get("JobState") == "PENDING" and state.get("Reason") in HOPELESS:
            _fail(job, f"pending for a reason that cannot clear ({state['Reason']}) while waiting for {what}", log)
        time.sleep(1.0)
    _fail(job, f"timed out after {timeout:.0f} s waiting for {what}", log)


def _submit(tmp: Path, name: str) -> tuple[str, Path, Path]:
    config = yaml.safe_load((ROOT / "examples/configs/main.yaml").read_text())
    (ft,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("FaultTolerantCheckpoint")]
    ckpt = tmp / name / "checkpoints"
    ft["init_args"].update({"dirpath": str(ckpt), "every_n_train_steps": 10})
    config["trainer"].update({"max_steps": STEPS, "limit_val_batches": 0, "default_root_dir": str(tmp / name)})
    config["model"]["max_steps"] = STEPS
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / f"{name}.out"
    env = child_env(PYTHON=sys.executable, CONFIG=str(path), ACCELERATOR="cpu", LIGHTNING_HYBRID_ROOT=str(ROOT))
    cmd = [
        "sbatch", "--parsable", f"--job-name=lh-{name}", "--nodes=2", "--ntasks-per-node=2",
        "--cpus-per-task=1", "--gpus-per-node=0",
        "--requeue", "--signal=B:USR1@60", "--time=30", f"--output={log}", "--open-mode=append",
        str(ROOT / "examples/slurm/train.sbatch"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], ckpt, log


@pytest.mark.timeout(1800)  # the waits below fail first, with the job's state and log
def test_sbatch_preempted_by_usr1_requeues_and_ends_with_the_uninterrupted_weights(tmp_path, slurm_cluster):
    ref_job, ref_ckpt, ref_log = _submit(tmp_path, "reference")
    _wait(ref_job, lambda s: s.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), "the end", 480, ref_log)
    assert _job_state(ref_job)["JobState"] == "COMPLETED", ref_log.read_text()[-4000:]

    job, ckpt, log = _submit(tmp_path, "preempted")
    first = ckpt / "step-000000010" / "manifest.json"
    deadline = time.monotonic() + 300
    while not first.exists():
        assert time.monotonic() < deadline, f"no checkpoint at step 10\n{log.read_text()[-4000:]}"
        assert _job_state(job).get("JobState") in ("PENDING", "RUNNING"), log.read_text()[-4000:]
        time.sleep(0.5)
    # the preemption warning Slurm would send before the time limit, to the batch shell (B:)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    _wait(job, lambda s: s.get("Restarts") == "1", "the requeue", 300, log)

    def started_again(state: dict[str, str]) -> bool:
        # a requeued job waits for its BeginTime (about two minutes): start it now, once it is pending
        if state.get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=False, capture_output=True)
        return state.get("JobState") in ("RUNNING", "COMPLETED", "FAILED", "CANCELLED")

    _wait(job, started_again, "the requeued job to start", 300, log)
    _wait(job, lambda s: s.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), "the end", 480, log)
    text = log.read_text()
    assert _job_state(job)["JobState"] == "COMPLETED", text[-4000:]
    saved = re.search(r"saved step (\d+) after a preemption signal; exiting with code 75 \(job requeued\)", text)
    assert saved, text[-4000:]
    step = int(saved.group(1))
    assert 10 <= step < STEPS
    assert f"resuming from {ckpt / f'step-{step:09d}'}" in text
    assert "(restart 1)" in text

    final = f"step-{STEPS:09d}"
    ours, reference = consolidate_checkpoint(ckpt / final), consolidate_checkpoint(ref_ckpt / final)
    assert ours.keys() == reference.keys()
    diff = max((ours[k] - reference[k]).abs().max().item() for k in reference if torch.is_tensor(reference[k]))
    assert diff == 0.0, f"preempted at step {step}: weights differ by {diff}"
