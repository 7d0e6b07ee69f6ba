"""The conformance matrix: every shape of the catalogue under every layout, fresh and resumed from the
checkpoint the previous layout wrote. Each cell is exact (every batch's loss within 1e-5 of one process's,
consolidated final weights within 1e-4) or refused on every rank with the message in ``layouts.REFUSED``.

One launch per layout trains every shape; the layouts run in the order of ``layouts.LAYOUTS``, each
resuming the shapes from the newest checkpoint an earlier layout wrote, so a checkpoint crosses every
layout (and both engines). The table of cells is written to the session's folder and printed;
``python tests/conformance/run.py`` writes it to ``docs/conformance.md``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from layouts import LAYOUTS, RUN_PY_ONLY  # noqa: E402
from matrix import Matrix  # noqa: E402

pytestmark = [pytest.mark.conformance, pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("conformance"))


@pytest.mark.timeout(1800)  # a four-process layout on a slow machine: launches of 900 s at most, relaunched
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in RUN_PY_ONLY])
def test_layout(matrix: Matrix, layout: str) -> None:
    problems = matrix.run_layout(layout)
    for shape, why in matrix.crashes.get(layout, {}).items():
        # launched again and judged on that launch: shown in the run's output and its warnings summary
        message = f"{shape} x {layout}: a rank's process ended without a report; launched again once.\n{why}"
        print(message)
        warnings.warn(message, stacklevel=1)
    assert not problems, "\n".join(problems)


def test_every_cell_decided(matrix: Matrix) -> None:
    """Every cell was run and is exact or refused (a layout whose launch failed leaves cells undecided)."""
    table = matrix.table()
    print(table)
    undecided = [c for c in matrix.undecided() if c.rpartition(" x ")[2] not in RUN_PY_ONLY]
    assert not undecided, f"cells not decided: {undecided}\n{table}"
    # the routed experts really were used by some ranks only in some step of a data-parallel layout
    assert matrix.rank_dependent_experts, "no step used an expert on one replica only: the shape tests nothing"
