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


def _run(tmp_path, name: str, expect_success: bool = True, **cfg) -> tuple[list[dict], str]:
    devices = cfg.get("devices", 1)
    config = {"out": str(tmp_path / name), **cfg}
    job = launch("samplers.py", config, nproc=devices, timeout=120, expect_success=expect_success)
    return [job.rank(r) for r in range(devices)], job.output


def _refused(ranks: list[dict], *needles: str) -> str:
    """Every rank stopped with the same message, which names what it must."""
    messages = {report.get("error") for report in ranks}
    assert len(messages) == 1 and None not in messages, messages
    message = messages.pop()
    for needle in needles:
        assert needle in message, message
    return message


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
    started part-way, so each rank says so and the epoch starts again from its first batch: 4 more steps of the
    user's sampler (before, the epoch went on at batch 3 with a new draw from its start)."""
    common = {"sampler": "weighted", "devices": 2, "hybrid": True, "ft": str(tmp_path / "ckpt")}
    _run(tmp_path, "first", steps=8, stop_at=3, **common)
    second, output = _run(tmp_path, "second", steps=7, **common)
    note = "keeps its own order and cannot start part-way through an epoch: epoch 0 starts again from its first"
    assert output.count(note) == 2, output[-3000:]
    assert "[rank 0]" in output and "[rank 1]" in output
    assert sorted(_steps(second)) == [4, 5, 6, 7]  # epoch 0 again (steps 4-7), no step of epoch 1 yet
    assert not [i for step in _steps(second).values() for i in step if i % 2]  # the user's weights


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


@pytest.mark.parametrize("data", ["iterable", "batch_sampler"])
def test_a_world_change_with_data_the_callback_cannot_position(tmp_path, data):
    """Two ranks stop mid-epoch (after 2 of 4 steps); one process resumes. The data comes from an
    IterableDataset or a batch sampler of the user's, which the callback cannot start part-way: "refuse"
    refuses (before, it trained on), and "keep_global_batch" still keeps the global batch (K 1 -> 2: it needs
    no sampler), says that the epoch starts again from its first batch, and trains the whole epoch (before,
    the epoch restarted from sample 0 but ended at the old count: samples repeated, others never seen)."""
    common = {"sampler": data, "hybrid": True, "ft": str(tmp_path / "ckpt")}
    _run(tmp_path, "first", devices=2, steps=8, stop_at=2, **common)
    refused, _ = _run(tmp_path, "refuse", expect_success=False, devices=1, steps=8, policy="refuse", **common)
    _refused(refused, "on_world_size_change='refuse'", "world", "2 rank(s)")
    kept, output = _run(tmp_path, "keep", devices=1, steps=-1, epochs=1, **common)
    assert "accumulation 1 -> 2" in output, output[-3000:]
    assert "[rank 0]" in output and "starts again from its first batch" in output, output[-3000:]
    steps = _steps(kept)
    assert all(len(samples) == 8 for samples in steps.values()), steps  # the global batch of 2 x 4 kept
    assert sorted(i for samples in steps.values() for i in samples) == list(range(32))


def test_a_checkpoint_without_a_data_position_is_refused_or_its_epoch_restarts(tmp_path):
    """A checkpoint of Lightning's ModelCheckpoint from a run without this callback, written mid-epoch on two
    ranks: the world it was written on and its data position are unknown. "refuse" refuses; otherwise every
    rank says so and the epoch is trained again from its first batch, none of its samples skipped (before,
    the data restarted at sample 0 and the epoch ended at the old batch count, with no word)."""
    _run(tmp_path, "first", devices=2, steps=8, stop_at=2, sampler="shuffle", hybrid=True, mc=str(tmp_path / "mc"))
    ckpt = str(tmp_path / "mc" / "epoch=0-step=2.ckpt")
    common = {"sampler": "shuffle", "hybrid": True, "ft": str(tmp_path / "ckpt"), "ckpt": ckpt, "devices": 1}
    refused, _ = _run(tmp_path, "refuse", expect_success=False, steps=8, policy="refuse", **common)
    _refused(refused, "no data position", "on_world_size_change='refuse'")
    kept, output = _run(tmp_path, "keep", steps=-1, epochs=1, **common)
    assert "[rank 0]" in output and "no data position" in output, output[-3000:]
    assert sorted(i for samples in _steps(kept).values() for i in samples) == list(range(32))


def test_a_refusal_reaches_the_rank_that_has_no_counterpart_in_the_checkpoint(tmp_path):
    """Two ranks -> three: the global batch of 8 cannot be kept (8/3 per rank), so every rank refuses with the
    same message, the third (no rank file in the checkpoint) included; before, it trained a batch and died on
    a closed connection."""
    common = {"sampler": "shuffle", "hybrid": True, "ft": str(tmp_path / "ckpt")}
    _run(tmp_path, "first", devices=2, steps=8, stop_at=2, **common)
    refused, _ = _run(tmp_path, "second", expect_success=False, devices=3, steps=8, **common)
    _refused(refused, "cannot keep the global batch", "3 replica(s)")


def test_the_epochs_short_last_window_weighs_as_in_the_uninterrupted_run(tmp_path):
    """60 samples on two ranks with batches of 4 (drop_last=False): each epoch's last step takes 4 samples.
    Stopped at step 3 and resumed on one process with the global batch kept (K 1 -> 2), each epoch's last
    window holds one batch: it is weighted as the uninterrupted run's last step (before, Lightning divided it
    by K = 2), and the resume line counts the 60 samples an epoch takes (it said 64)."""
    common = {"sampler": "padded", "hybrid": True, "steps": -1, "epochs": 2}
    ref, _ = _run(tmp_path, "ref", devices=2, ft=str(tmp_path / "ref-ckpt"), **common)
    first, _ = _run(tmp_path, "first", devices=2, stop_at=3, ft=str(tmp_path / "ckpt"), **common)
    second, output = _run(tmp_path, "second", devices=1, ft=str(tmp_path / "ckpt"), **common)
    assert "world 2 -> 1" in output and "64" not in output.split("world 2 -> 1")[1].split("\n")[0], output[-3000:]
    assert {**_steps(first), **_steps(second)} == _steps(ref)
    assert max(abs(a - b) for a, b in zip(second[0]["weights"], ref[0]["weights"])) < 1e-6
