"""The matrix can fail: every planted bug of ``mutations.py`` (a small patch to a temporary copy of the package)
makes at least one of the cells it names DIFFERENT or FAILED. The table of what caught each is printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mutations import MUTATIONS, PACKAGE, apply, run  # noqa: E402

pytestmark = [pytest.mark.conformance, pytest.mark.multiproc, pytest.mark.slow]


def test_every_mutation_applies_to_the_current_package(tmp_path):
    """A patch whose text is gone (the code moved) would test nothing: each applies exactly once."""
    for mutation in MUTATIONS:
        src = apply(mutation, tmp_path / mutation.name)
        patched = (src / "lightning_hybrid" / mutation.file).read_text()
        assert patched != (PACKAGE / mutation.file).read_text()


@pytest.fixture(scope="module")
def references() -> dict:
    return {}  # the one-process references, shared by every mutation's cells


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_planted_bug_is_caught(tmp_path, references, mutation):
    caught = run(mutation, tmp_path, references)
    print(f"{mutation.name}: caught by {caught}")
    assert caught, f"{mutation.name} ({mutation.what}) survived: every cell of {mutation.layouts} stayed exact"
