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
    """A rank whose process died with no word in a cell (a signal, an abort in a library's thread): the cell is
    launched again once, in a checkpoint folder of its own, judged on that launch, and the first end is kept
    with the rank's log; a second such end fails the cell."""
    import matrix as matrix_module
    from helpers import JobResult

    launches: list[dict] = []

    def fake_launch(script, cfg, *, nproc, timeout, expect_success, env):
        launches.append(cfg)
        Path(cfg["out"]).mkdir(parents=True)
        (Path(cfg["out"]) / "rank0.log").write_text("Fatal Python error: Segmentation fault\n  File worker.py")
        refused = {"fresh": {"error": "ValueError: refused"}}
        died = len(launches) == 1 or "twice" in cfg["shapes"]
        ranks = [{} if died else {s: refused for s in cfg["shapes"]}, {s: refused for s in cfg["shapes"]}]
        return JobResult(-11 if died else 0, "", [{"rank": r, "results": ranks[r]} for r in range(2)])

    monkeypatch.setattr(matrix_module, "launch", fake_launch)
    monkeypatch.setattr(Matrix, "reference", lambda *args, **kwargs: None)
    m = Matrix(tmp_path)
    problems = m.run_layout("dp2-zero1", ["once"])
    assert len(launches) == 2 and launches[1]["shapes"] == ["once"]
    assert launches[0]["checkpoints"] != launches[1]["checkpoints"]  # the second never resumes the first's
    assert problems == ["once x dp2-zero1 (fresh): FAILED: ValueError: refused\n"]  # judged on launch 2
    assert "launch exit -11" in m.crashes["dp2-zero1"]["once"]
    assert "Segmentation fault" in m.crashes["dp2-zero1"]["once"]

    launches.clear()
    problems = Matrix(tmp_path / "again").run_layout("dp2-zero1", ["twice"])
    assert len(launches) == 2
    assert len(problems) == 1 and "ended without a report, twice" in problems[0], problems
