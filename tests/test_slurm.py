"""Real Slurm tier: the example's sbatch script, preempted by a signal, requeues itself and resumes exactly.

The cluster (two emulated nodes on this host) is a private one that ``tests/slurm/cluster.sh`` starts in a
temporary folder of its own (configuration, munge key, state, spool, logs, ports) and stops afterwards; it
installs Debian's Slurm when it is missing and never touches the host's Slurm or system files. Where it
cannot start, the tier is skipped with the reason, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, child_env

from lightning_hybrid.utilities import consolidate_checkpoint

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 40


CLUSTER = ROOT / "tests/slurm/cluster.sh"
_ENV: dict[str, str] = {}  # SLURM_CONF of the private cluster, for every Slurm command below


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> Generator[Path, None, None]:
    folder = tmp_path_factory.mktemp("slurm")
    proc = subprocess.run(["bash", str(CLUSTER), "start", str(folder)], capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        reason = proc.stdout.strip().splitlines()[-1]
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the Slurm tier must run in CI: {reason}")
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _ENV["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield folder
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=60)
        _ENV.clear()


def _slurm(*cmd: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, env={**os.environ, **_ENV}, check=check)


def _job_state(job: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", _slurm("scontrol", "show", "job", "-o", job).stdout))


# a pending job with one of these reasons will never start on its own
HOPELESS = {"PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit", "ReqNodeNotAvail"}


def _controller_lines(job: str) -> str:
    """What slurmctld logged about the job (why it failed, was killed or requeued)."""
    log = Path(_ENV["SLURM_CONF"]).parent / "log" / "slurmctld.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return "\n".join(line for line in lines if re.search(rf"JobId={job}\b|job_id={job}\b|\b{job}\b", line))[-4000:]


def _fail(job: str, why: str, log: Path) -> None:
    _slurm("scancel", job)
    text = log.read_text() if log.exists() else "(no log yet)"
    nodes = _slurm("sinfo", "-N", "-o", "%N %t %c %E").stdout
    pytest.fail(
        f"job {job}: {why}\nstate: {_job_state(job)}\nnodes:\n{nodes}\nslurmctld on this job:\n"
        f"{_controller_lines(job)}\njob log:\n{text[-6000:]}"
    )


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


def _wait_for_checkpoint(job: str, folder: Path, log: Path) -> None:
    deadline = time.monotonic() + 300
    while not (folder / "manifest.json").exists():
        assert time.monotonic() < deadline, f"no checkpoint {folder.name}\n{log.read_text()[-4000:]}"
        assert _job_state(job).get("JobState") in ("PENDING", "RUNNING"), log.read_text()[-4000:]
        time.sleep(0.5)


def _submit(tmp: Path, name: str, *, nodes: str = "2", fp32: bool = False) -> tuple[str, Path, Path]:
    config = yaml.safe_load((ROOT / "examples/configs/main.yaml").read_text())
    if fp32:  # no loss scaling and no dropout: the same samples give the same steps on any world
        config["trainer"].pop("plugins", None)
        config["model"]["dropout"] = 0.0
    (ft,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("FaultTolerantCheckpoint")]
    ckpt = tmp / name / "checkpoints"
    ft["init_args"].update({"dirpath": str(ckpt), "every_n_train_steps": 10})
    config["trainer"].update({"max_steps": STEPS, "limit_val_batches": 0, "default_root_dir": str(tmp / name)})
    config["model"]["max_steps"] = STEPS
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / f"{name}.out"
    # the nodes' names (n1, n2) do not resolve on this host: the processes meet on the loopback address
    env = child_env(
        PYTHON=sys.executable, CONFIG=str(path), ACCELERATOR="cpu", LIGHTNING_HYBRID_ROOT=str(ROOT),
        MASTER_ADDR="127.0.0.1", **_ENV,
    )  # fmt: skip
    cmd = [
        "sbatch", "--parsable", f"--job-name=lh-{name}", f"--nodes={nodes}", "--ntasks-per-node=2",
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
    if _job_state(ref_job)["JobState"] != "COMPLETED":
        _fail(ref_job, "the reference job did not complete", ref_log)

    job, ckpt, log = _submit(tmp_path, "preempted")
    _wait_for_checkpoint(job, ckpt / "step-000000010", log)
    # the preemption warning Slurm would send before the time limit, to the batch shell (B:)
    _slurm("scancel", "--signal=USR1", "--batch", job, check=True)
    _wait(job, lambda s: s.get("Restarts") == "1", "the requeue", 300, log)
    # A requeued job waits for its BeginTime (about two minutes). Forcing the start while Slurm still cleans
    # up the old instance races it ("Job credential revoked": the new instance is killed and the job FAILS),
    # so let the old instance go first: pending, both nodes idle again, and a few quiet seconds.
    _wait(job, lambda s: s.get("JobState") == "PENDING", "the requeued job to pend", 300, log)
    _wait(job, lambda s: _nodes_idle(), "the old instance to be cleaned up", 300, log)
    time.sleep(5)
    _slurm("scontrol", "update", f"jobid={job}", "StartTime=now", check=True)
    _wait(job, lambda s: s.get("JobState") in ("RUNNING", "COMPLETED", "FAILED", "CANCELLED"), "the restart", 300, log)
    _wait(job, lambda s: s.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), "the end", 480, log)
    text = log.read_text()
    if _job_state(job)["JobState"] != "COMPLETED":
        _fail(job, "the requeued job did not complete", log)
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


def _nodes_idle() -> bool:
    states = _slurm("sinfo", "-h", "-N", "-o", "%t").stdout.split()
    return len(states) == 2 and all(state == "idle" for state in states)


@pytest.mark.timeout(1800)
def test_a_job_preempted_on_two_nodes_continues_on_one_with_the_global_batch(tmp_path, slurm_cluster):
    """Preempted on two nodes (pp2 x dp2), the job is requeued; the second node is then lost (drained). Slurm
    22.05 keeps a requeued job's node count (``scontrol update NumNodes`` cannot lower its minimum), so the run
    continues as the operator would: the requeued job is cancelled and the same script is submitted on the one
    node left, on the same checkpoint folder (pp2 x dp1): K doubles, and it ends with the uninterrupted run's
    weights (fp32, no dropout; sums in another order: 1e-4)."""
    ref_job, ref_ckpt, ref_log = _submit(tmp_path, "reference-fp32", fp32=True)
    _wait(ref_job, lambda s: s.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), "the end", 480, ref_log)
    if _job_state(ref_job)["JobState"] != "COMPLETED":
        _fail(ref_job, "the reference job did not complete", ref_log)

    job, ckpt, log = _submit(tmp_path, "shrunk", nodes="1-2", fp32=True)
    _wait_for_checkpoint(job, ckpt / "step-000000010", log)
    assert _job_state(job).get("NumNodes") == "2"
    _slurm("scancel", "--signal=USR1", "--batch", job, check=True)
    _wait(job, lambda s: s.get("Restarts") == "1", "the requeue", 300, log)
    _wait(job, lambda s: s.get("JobState") == "PENDING", "the requeued job to pend", 300, log)
    _slurm("scancel", job, check=True)
    _wait(job, lambda s: _nodes_idle(), "the old instance to be cleaned up", 300, log)
    _slurm("scontrol", "update", "nodename=n2", "state=drain", "reason=lost", check=True)
    try:
        again, _, log2 = _submit(tmp_path, "shrunk", nodes="1", fp32=True)
        _wait(again, lambda s: s.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), "the end", 480, log2)
        if _job_state(again)["JobState"] != "COMPLETED":
            _fail(again, "the job did not complete on one node", log2)
    finally:
        _slurm("scontrol", "update", "nodename=n2", "state=resume")
    text = log2.read_text()
    saved = re.search(r"saved step (\d+) after a preemption signal", text)
    assert saved, text[-4000:]
    assert f"resuming from {ckpt / f'step-{int(saved.group(1)):09d}'}" in text
    line = r"world 4 -> 2 \(dp 2 -> 1\): accumulation (\d+) -> (\d+), global batch \d+ kept"
    found = re.search(line, text)
    assert found and int(found.group(2)) == 2 * int(found.group(1)), text[-4000:]
    final = f"step-{STEPS:09d}"
    ours, reference = consolidate_checkpoint(ckpt / final), consolidate_checkpoint(ref_ckpt / final)
    assert ours.keys() == reference.keys()
    diff = max((ours[k] - reference[k]).abs().max().item() for k in reference if torch.is_tensor(reference[k]))
    assert diff < 1e-4, f"continued on one node after step {saved.group(1)}: weights differ by {diff}"
