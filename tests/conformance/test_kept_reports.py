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
