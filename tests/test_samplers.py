"""The sampler a user chose is the one that trains, with FaultTolerantCheckpoint as without it.

The callback positions the data order of a resumed epoch by owning the loader's sampler, which it can only do
for the samplers whose order it reproduces (Lightning's ``DistributedSampler``, an unseeded ``RandomSampler``
without replacement, ``SequentialSampler``). Any other sampler (weighted, with replacement, seeded by the user,
inside Lightning's ``DistributedSamplerWrapper``) trains as it would without the callback: each step's sample
indices are compared with the same run under plain Lightning. Before, a ``WeightedRandomSampler`` under two
ranks was replaced by a uniform shuffle over the dataset (samples of weight 0 trained), and a ``RandomSampler``
with replacement by a permutation.
"""

from __future__ import annotations

import pytest
from helpers import launch

pytestmark = pytest.mark.multiproc


def _run(tmp_path, name: str, **cfg) -> list[dict]:
    job = launch("samplers.py", {"out": str(tmp_path / name), **cfg}, nproc=cfg.get("devices", 1), timeout=120)
    return [job.rank(r) for r in range(cfg.get("devices", 1))], job.output


@pytest.mark.parametrize(
    ("sampler", "devices", "hybrid"),
    [("weighted", 2, True), ("weighted", 2, False), ("replacement", 1, False)],
    ids=["weighted-hybrid-dp2", "weighted-ddp2", "replacement-one-process"],
)
def test_the_users_sampler_is_the_one_that_trains(tmp_path, sampler, devices, hybrid):
    common = {"sampler": sampler, "devices": devices, "hybrid": hybrid, "steps": 6}
    plain, _ = _run(tmp_path, "plain", **common)
    kept, _ = _run(tmp_path, "ft", ft=str(tmp_path / "ckpt"), **common)
    for r in range(devices):
        assert kept[r]["seen"] == plain[r]["seen"], f"rank {r}: {kept[r]['seen']} vs Lightning's {plain[r]['seen']}"
        assert kept[r]["weights"] == plain[r]["weights"]
    if sampler == "weighted":  # weight 0: never drawn
        assert not [i for r in range(devices) for step in kept[r]["seen"].values() for i in step if i % 2]
    else:  # drawn with replacement: some sample twice in the 24 of the epoch
        drawn = [i for step in kept[0]["seen"].values() for i in step]
        assert len(set(drawn)) < len(drawn)


def test_a_mid_epoch_resume_with_a_sampler_that_cannot_be_positioned_says_so_on_every_rank(tmp_path):
    """Stopped after step 3 of an epoch of 4 (a checkpoint every step), resumed: the user's sampler cannot be
    started part-way, so each rank says what will not be exact (Lightning's own warning stays on)."""
    common = {"sampler": "weighted", "devices": 2, "hybrid": True, "ft": str(tmp_path / "ckpt")}
    _run(tmp_path, "first", steps=8, stop_at=3, **common)
    _, output = _run(tmp_path, "second", steps=5, **common)
    note = "keeps its own order and cannot start part-way through an epoch"
    assert output.count(note) == 2, output[-3000:]
    assert "[rank 0]" in output and "[rank 1]" in output


def _steps(ranks: list[dict]) -> dict[int, list[int]]:
    """Each optimizer step's samples over every rank and micro-batch."""
    steps: dict[int, list[int]] = {}
    for report in ranks:
        for step, seen in report["seen"].items():
            steps.setdefault(int(step), []).extend(seen)
    return {s: sorted(v) for s, v in sorted(steps.items())}


@pytest.mark.parametrize("stop", ["max_epochs", "last_step"])
def test_a_world_change_at_an_epochs_last_step_trains_the_whole_next_epoch(tmp_path, stop):
    """Two ranks train epoch 0 (4 steps of 8 samples) and end there: by max_epochs=1 (the natural "one more
    epoch on fewer nodes" flow) or stopped after its last step. One process goes on for epoch 1 with the global
    batch kept (K 1 -> 2): every step of epoch 1 has the uninterrupted run's samples, and the weights match.
    Before, epoch 1 started at batch 8 of 16 while the sampler started at its first sample: half the epoch was
    never trained."""
    common = {"sampler": "shuffle", "hybrid": True, "ft": str(tmp_path / "ckpt")}
    ref, _ = _run(tmp_path, "ref", sampler="shuffle", hybrid=True, devices=2, steps=-1, epochs=2,
                  ft=str(tmp_path / "ref-ckpt"))  # fmt: skip
    if stop == "max_epochs":
        first, _ = _run(tmp_path, "first", devices=2, steps=-1, epochs=1, **common)
    else:
        first, _ = _run(tmp_path, "first", devices=2, steps=-1, epochs=2, stop_at=4, **common)
    second, output = _run(tmp_path, "second", devices=1, steps=-1, epochs=2, **common)
    assert "world 2 -> 1" in output, output[-3000:]
    want = _steps(ref)
    got = {**_steps(first), **_steps(second)}
    assert got == want
    assert max(abs(a - b) for a, b in zip(second[0]["weights"], ref[0]["weights"])) < 1e-5
