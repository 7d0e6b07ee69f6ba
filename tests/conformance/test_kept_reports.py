"""``run.py --keep``: a run of the matrix continued after it ended early judges the cells an earlier launch
reported (same strategy, same starting checkpoint, every rank) and launches only the others."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from matrix import Matrix  # noqa: E402

pytestmark = pytest.mark.unit

STRATEGY = {"name": "hybrid", "kwargs": {"data_parallel_size": 2}}
ONCE = "scalar-params/sgd"  # a shape of the catalogue: the table lists those


def _launch(folder: Path, strategy: dict, resume: dict, ranks: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"strategy": strategy, "resume": resume}))
    for rank, results in enumerate(ranks):
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "results": results}))


def test_only_cells_every_rank_reported_from_the_same_start_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "dp2"
    done = {"fresh": {"losses": [1.0]}}
    # launch 1 ran a, b, c and d; rank 1 never reported c (the launch ended there)
    _launch(out / "reports-1", STRATEGY, {"b": "/ckpt/b", "d": "/old/d"}, [
        {"a": done, "b": done, "c": done, "d": done},
        {"a": done, "b": done, "d": done},
    ])  # fmt: skip
    # launch 2 ran another strategy (a changed layouts.py): nothing of it counts
    _launch(out / "reports-2", {"name": "hybrid", "kwargs": {}}, {}, [{"e": done}, {"e": done}])
    # launch 10 sorts after launch 2 by number, not by name: its cell replaces launch 1's
    newer = {"fresh": {"losses": [2.0]}}
    _launch(out / "reports-10", STRATEGY, {}, [{"a": newer}, {"a": newer}])
    results: dict[int, dict] = {0: {}, 1: {}}
    resume = {"b": "/ckpt/b", "d": "/new/d"}  # d now starts from another checkpoint: run again
    launches = Matrix._kept(out, STRATEGY, 2, ["a", "b", "c", "d", "e"], resume, results)
    assert launches == 10  # the next launch writes reports-11: no earlier report is overwritten
    assert set(results[0]) == set(results[1]) == {"a", "b"}
    assert results[1]["a"] == newer and results[0]["b"] == done


def test_nothing_kept_in_a_new_folder(tmp_path: Path) -> None:
    results: dict[int, dict] = {0: {}}
    assert Matrix._kept(tmp_path / "single", STRATEGY, 1, ["a"], {}, results) == 0
    assert results == {0: {}}


def test_a_process_that_ended_without_a_report_is_launched_again_once(tmp_path: Path, monkeypatch) -> None:
    """A rank whose process died with no word in a cell (a signal, an abort in a library's thread) while its peer
    trained or lost its connection to it: the cell is launched again once, the fresh run in a checkpoint folder
    of its own, judged on that launch only, and the first end is kept with the rank's log and marked in the
    table; a second such end fails the cell, and so does a real error on the peer (never launched again)."""
    import matrix as matrix_module
    from helpers import JobResult

    launches: list[dict] = []

    def fake_launch(script, cfg, *, nproc, timeout, expect_success, env):
        launches.append(cfg)
        Path(cfg["out"]).mkdir(parents=True)
        (Path(cfg["out"]) / "rank0.log").write_text("Fatal Python error: Aborted\n  File worker.py")
        shape = cfg["shapes"][0]
        died = len(launches) == 1 or shape == "twice"
        peer = {
            ONCE: "RuntimeError: [pair.cc:537] Read error: Connection reset by peer" if died else "ValueError: 2nd",
            "twice": "RuntimeError: Connection closed by peer",
            "real": "ValueError: a bug on rank 1",
        }[shape]
        ranks = [{} if died else {shape: {"fresh": {"error": "ValueError: 2nd"}}}, {shape: {"fresh": {"error": peer}}}]
        codes = [-6, 3] if died else [0, 0]  # rank 0 aborted; its own code is shown, not the launch's (here 99)
        return JobResult(99 if died else 0, "", [{"rank": r, "results": ranks[r]} for r in range(2)], codes)

    monkeypatch.setattr(matrix_module, "launch", fake_launch)
    monkeypatch.setattr(Matrix, "reference", lambda *args, **kwargs: None)
    m = Matrix(tmp_path / "once")
    problems = m.run_layout("dp2-zero1", [ONCE])
    assert len(launches) == 2 and launches[1]["shapes"] == [ONCE]
    assert launches[0]["checkpoints"] != launches[1]["checkpoints"]  # the second never resumes the first's
    # judged on launch 2 alone: both ranks' errors are its own (rank 1's first report was dropped)
    assert problems == [f"{ONCE} x dp2-zero1 (fresh): FAILED: ValueError: 2nd\n"]
    assert "exit code -6" in m.crashes["dp2-zero1"][ONCE] and "Aborted" in m.crashes["dp2-zero1"][ONCE]
    assert "(launched twice: a process ended without a report)" in m.table()

    launches.clear()
    problems = Matrix(tmp_path / "twice").run_layout("dp2-zero1", ["twice"])
    assert len(launches) == 2
    assert len(problems) == 1 and "ended without a report, twice" in problems[0], problems

    launches.clear()
    m = Matrix(tmp_path / "real")
    problems = m.run_layout("dp2-zero1", ["real"])
    assert len(launches) == 1 and not m.crashes  # the peer's own error: nothing to launch again
    assert len(problems) == 1 and "failed differently" in problems[0] and "exit code -6" in problems[0], problems
