"""User code that reads or edits gradients between backward and the step, under every ZeRO stage: each case
exact against one process trained by Lightning alone (every rank's own losses and weights, SGD, whose update
shows a wrong gradient at once), or refused on every rank with the message the conformance matrix expects.

Each launch trains several cells of the conformance catalogue (``tests/conformance``) under one layout, fresh
(the matrix in the slow tier also resumes them across layouts). The cases, and what they were before:

- ``grad-scaled``: ``on_after_backward`` scales a gradient in place and rescales one by assignment, at every
  micro-batch of a window of two. ZeRO-1 and ZeRO-2 ``once_per_step`` dropped the assignment or added it to the
  old gradient; ZeRO-2's default handed the gradient off before the hook could see it.
- ``grad-surgery``: ``p.grad = p.grad / (p.grad.norm() + 1)`` at the window's last backward: needs the replicas'
  mean there, as DDP gives it (ZeRO-1/2 showed none).
- ``grad-hand-set`` / ``grad-estimated``: a gradient set by hand (a constant; an estimate from the replica's
  own batch) on a parameter backward did not reach and in place of backward's (ZeRO-0 and ZeRO-3 discarded the
  first: its use had been recorded when its bucket started; none averaged the estimate).
- ``frozen-mid-window`` / ``manual-frozen``: a parameter frozen between two backward passes of one step (ZeRO-0
  stepped it with its local, un-averaged gradient: the replicas drifted apart).
- ``outside-optimizer``: a trainable parameter in no optimizer, updated by hand (never averaged at any stage).
- ``manual-edits``: manual optimization that edits gradients between ``manual_backward`` and the step.
- ``step-hook-params``: ``on_before_optimizer_step`` edits the model's ``.grad``, which ZeRO-1/2 do not hold
  whole at the step (``None`` before: a guarded edit did nothing, an fp16 norm logger read mixed values).
- ``saved-before-stepping``: a checkpoint written before the first step (torch's DCP created the optimizer's
  state by a step at LR 0 for it: SGD's momentum then started from weight_decay * p).
- ``reads-optimizer-state``: a callback reads ``optimizer.state[p]`` and ``optimizer.state_dict()`` (ZeRO-1/2:
  empty in silence, and a KeyError from torch).
- ``fp16-scaled``: fp16 with ``AdaptiveLossScalingPrecision`` against torch's ``GradScaler``; overflow in one
  rank's shard only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance"))

from matrix import Matrix

pytestmark = pytest.mark.multiproc

HANDED_OFF = "each gradient is handed off"  # ZeRO-2's placeholder in .grad, naming the parameter
SHARD_ONLY = "keeps only its shard of the reduced gradient"  # ZeRO-1/2's at the step
ASSIGNED_DTENSOR = "was assigned to"  # ZeRO-3: each replica holds its rows of a DTensor gradient
STATE_SHARDED = "holds the optimizer state of its shard"  # optimizer.state[p] / state_dict() under ZeRO-1/2
EXACT = "exact"

CASES: dict[str, dict[str, str]] = {
    "dp2-zero0": {
        "grad-scaled": EXACT,
        "grad-estimated": EXACT,
        "grad-surgery": EXACT,
        "grad-hand-set": EXACT,
        "manual-frozen": EXACT,
        "manual-edits": EXACT,
        "outside-optimizer": EXACT,
        "step-hook-params": EXACT,
        "saved-before-stepping": EXACT,
        "reads-optimizer-state": EXACT,
    },
    "dp2-zero1": {
        "grad-scaled": EXACT,
        "grad-estimated": EXACT,
        "grad-surgery": EXACT,
        "grad-hand-set": EXACT,
        "manual-edits": EXACT,
        "outside-optimizer": EXACT,
        "step-hook-groups": EXACT,
        "step-hook-params": SHARD_ONLY,
        "fp16-scaled": EXACT,
        "reads-optimizer-state": STATE_SHARDED,
    },
    "dp2-zero2": {
        "grad-scaled": HANDED_OFF,
        "grad-estimated": HANDED_OFF,
        "grad-surgery": HANDED_OFF,
        "grad-hand-set": HANDED_OFF,
        "manual-edits": HANDED_OFF,
        "outside-optimizer": EXACT,
        "step-hook-groups": EXACT,
        "fp16-scaled": EXACT,
        "reads-optimizer-state": STATE_SHARDED,
    },
    "dp2-zero2-once": {
        "grad-scaled": EXACT,
        "grad-estimated": EXACT,
        "grad-surgery": EXACT,
        "grad-hand-set": EXACT,
        "manual-frozen": EXACT,
        "outside-optimizer": EXACT,
        "step-hook-params": SHARD_ONLY,
    },
    "dp2-zero3": {
        "grad-hand-set": ASSIGNED_DTENSOR,
        "grad-estimated": ASSIGNED_DTENSOR,
        "step-hook-params": EXACT,
        "outside-optimizer": EXACT,
        "manual-frozen": "changed requires_grad between two backward passes",
        "tensor-hook": "tensor hooks registered on",
        "saved-before-stepping": EXACT,
    },
    "pp2xdp2-zero0": {"frozen-mid-window": EXACT, "grad-surgery": EXACT, "outside-optimizer": EXACT},
}


@pytest.mark.parametrize("layout", list(CASES))
def test_gradient_edits_are_exact_or_refused_on_every_rank(tmp_path, layout: str) -> None:
    cases = CASES[layout]
    matrix = Matrix(tmp_path)
    cells = [f"{shape}/sgd" for shape in cases]
    problems = matrix.run_layout(layout, cells)
    got = {cell.partition("/")[0]: matrix.cells[(cell, layout, "fresh")] for cell in cells}
    wrong = []
    for shape, want in cases.items():
        cell = got[shape]
        if want == EXACT and cell.verdict != "exact":
            wrong.append(f"{shape}: {cell.verdict}: {cell.detail[:400]}")
        elif want != EXACT and (cell.verdict != "refused" or want not in cell.detail):
            wrong.append(f"{shape}: expected a refusal saying {want!r}, got {cell.verdict}: {cell.detail[:400]}")
    assert not wrong, "\n".join(wrong + problems)
