"""The short soak: about 20 failures injected into the four soak jobs (``benchmarks/soak.py``), nothing lost.

The results file of the full run (500 failures) is ``benchmarks/results/soak_cpu.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_a_short_soak_ends_every_job_as_the_uninterrupted_run_with_nothing_lost(tmp_path):
    records = soak.run(20, seed=7, work=tmp_path, log=lambda *_: None)
    table = "\n".join(soak.table(records, 7))
    assert not [p for r in records.values() for p in r.problems], table
    assert sum(sum(r.failures.values()) for r in records.values()) >= 20, table
    for r in records.values():
        assert r.steps_compared == r.steps, table  # every step's samples compared, and equal
        assert r.weight_diff <= (1e-5 if len(r.worlds) > 1 else 0.0), table
        assert all(t <= soak.BOUND_S for times in r.ended_in.values() for t in times), table
    kinds = set().union(*(set(r.failures) for r in records.values()))
    assert {"sigkill", "sigterm", "sigint"} <= kinds, table


@pytest.mark.timeout(600)
def test_ctrl_c_and_sigterm_at_random_points_end_every_rank_in_bound_with_the_documented_codes(tmp_path):
    """A few trials of ``benchmarks/interrupts.py`` (its results file records 120): no SIGABRT, no rank left
    to the launcher's SIGKILL, every job ended within the bound."""
    import interrupts

    records, problems = interrupts.run(6, seed=11, work=tmp_path, log=lambda *_: None)
    table = "\n".join(interrupts.table(records, problems, 6, 11))
    assert not problems, table
    assert sum(len(t) for t in records["ended"].values()) == 6, table
