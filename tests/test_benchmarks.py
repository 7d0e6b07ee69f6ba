"""The GPU check script on a machine without a GPU: its dry run, and its checks on 2 CPU processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, child_env

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import CHECKS


def _gpu_check(tmp_path, *args: str, timeout: float) -> tuple[int, str, str]:
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, proc.stdout


def test_gpu_check_dry_run_says_no_gpu_and_what_it_skipped(tmp_path):
    code, out, table = _gpu_check(tmp_path, timeout=120)
    assert code == 0, out[-4000:]
    assert table.startswith("# gpu_check: no CUDA GPU"), table
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == list(CHECKS)  # every check named, none run
    assert all(" | skipped | no CUDA GPU on this machine |" in r for r in rows), rows
    assert "skipped: no CUDA GPU on this machine" in table  # the memory section
    assert "overlap benchmark: skipped (no CUDA GPU on this machine" in table
    assert (tmp_path / "gpu_check_dry_run.txt").read_text() == table  # kept where it was asked to be


@pytest.mark.slow
@pytest.mark.multiproc
def test_gpu_check_cpu_self_test_runs_every_check_it_can(tmp_path):
    # the checks themselves, on 2 CPU processes: each multi-rank job against one process with the same batch
    code, out, _ = _gpu_check(tmp_path, "--cpu", timeout=660)
    assert code == 0, out[-6000:]
    table = (tmp_path / "gpu_check_cpu.txt").read_text()  # printed too, after what deepspeed logs at import
    assert table.strip() in out
    rows = {r.split(" | ")[0][2:]: r for r in table.splitlines() if r.startswith("| ") and "---" not in r}
    for name, (want, spec, precision, _) in CHECKS.items():
        # several ranks against one process in the same precision: exact; one process against fp32: close; a
        # layout of more ranks than the 2 CPU processes (pp2 x tp2): skipped, saying how many it needs
        needs = (spec or {}).get("pipeline_parallel_size", 1) * (spec or {}).get("tensor_parallel_size", 1)
        expected = " | 2 | exact | max per-step loss difference " if want == "all" else " | 1 | close | "
        if needs > 2:
            expected = f" | 2 | skipped | needs a multiple of {needs} devices"
        assert expected in rows[name], rows[name]
        if precision == "fp16-adaptive":
            assert "scaler state identical on every rank" in rows[name], rows[name]
    assert "overlap benchmark: skipped (run it alone on CPU" in table
    assert table.rstrip().splitlines()[-1].startswith("0 failed; ")
