"""FaultTolerantCheckpoint's pure parts: the store, the resumable sampler, RNG capture, the watchdog."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid.callbacks import FaultTolerantCheckpoint, ResumableSampler
from lightning_hybrid.callbacks import _store as store
from lightning_hybrid.callbacks._resume import capture_rng, restore_rng
from lightning_hybrid.callbacks._watchdog import Watchdog

pytestmark = pytest.mark.unit


def _checkpoint(root, step: int, payload: bytes = b"x" * 1000) -> os.PathLike:
    path = store.step_dir(root, step)
    path.mkdir(parents=True)
    store.atomic_write(path / "checkpoint.pt", lambda f: f.write(payload))
    store.atomic_write(path / "rank-00000.pt", lambda f: f.write(payload[:10]))
    files = store.describe_files(path, ["checkpoint.pt", "rank-00000.pt"])
    store.write_manifest(path, files, {"step": step})
    return path


def test_manifest_detects_truncation_bit_flips_and_missing_files(tmp_path):
    path = _checkpoint(tmp_path, 10)
    assert store.verify(path) is None
    data = bytearray((path / "checkpoint.pt").read_bytes())
    data[500] ^= 0x01
    (path / "checkpoint.pt").write_bytes(bytes(data))
    assert "SHA-256" in store.verify(path)
    assert store.verify(path, checksums=False) is None  # same size: only the checksum can tell
    (path / "checkpoint.pt").write_bytes(bytes(data[:700]))
    assert "700 bytes" in store.verify(path, checksums=False)
    (path / "rank-00000.pt").unlink()
    assert "rank-00000.pt is missing" in store.verify(path, names=["rank-00000.pt"])
    (path / store.MANIFEST).unlink()
    assert store.verify(path) == "incomplete (no manifest)"


def test_atomic_write_never_leaves_a_partial_file_under_the_real_name(tmp_path):
    target = tmp_path / "state.pt"

    def fail_half_way(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.atomic_write(target, fail_half_way)
    assert list(tmp_path.iterdir()) == []
    entry = store.atomic_write(target, lambda f: torch.save({"w": torch.arange(1000)}, f))
    assert entry == {"bytes": target.stat().st_size, "sha256": store.sha256_file(target)}  # hashed while written
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(1000))


def test_stale_cleanup_and_retention_keep_the_newest_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    unfinished = store.step_dir(tmp_path, 10)
    unfinished.mkdir()
    (unfinished / "checkpoint.pt.tmp-1234abcd").write_bytes(b"partial")
    (store.step_dir(tmp_path, 8) / "rank-00000.pt.tmp-deadbeef").write_bytes(b"partial")
    removed = store.clean_stale(tmp_path)
    assert unfinished in removed and not unfinished.exists()
    assert not list(store.step_dir(tmp_path, 8).glob("*.tmp-*"))
    assert [e.step for e in store.checkpoints(tmp_path)] == [8, 6, 4, 2]

    # retention deletes only complete checkpoints beyond keep_last, never a protected one
    store.retain(tmp_path, 2, protect=[store.step_dir(tmp_path, 2)])
    assert [e.step for e in store.checkpoints(tmp_path)] == [8, 6, 2]

    store.point_last(tmp_path, store.step_dir(tmp_path, 6) / "checkpoint.pt")
    assert (tmp_path / store.LAST_LINK).resolve() == (store.step_dir(tmp_path, 6) / "checkpoint.pt").resolve()
    assert os.readlink(tmp_path / store.LAST_LINK) == os.path.join("step-000000006", "checkpoint.pt")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, False), (False, False), (True, True)])
def test_resumable_sampler_matches_distributed_sampler(world, shuffle, drop_last):
    n = 23
    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(
                range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            ours = ResumableSampler(n, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


def test_resumable_sampler_resumes_mid_epoch_on_the_same_and_another_world():
    n, batch = 40, 3
    full = [ResumableSampler(n, num_replicas=2, rank=r, seed=1) for r in range(2)]
    for s in full:
        s.set_epoch(5)
    per_rank = [list(s) for s in full]
    consumed_batches = 4
    consumed = consumed_batches * batch * 2
    # same world: each rank continues exactly where its uninterrupted iteration was
    for r in range(2):
        s = ResumableSampler(n, num_replicas=2, rank=r, seed=1)
        s.set_epoch(5)
        s.resume_at(5, consumed)
        assert list(s) == per_rank[r][consumed_batches * batch :]
        assert list(s) == per_rank[r]  # the resume point is used once; the next pass is the whole epoch
    # a different world: the three ranks together see exactly the samples not yet consumed
    order = full[0].global_order(5)
    seen = []
    for r in range(3):
        s = ResumableSampler(n, num_replicas=3, rank=r, seed=1)
        s.set_epoch(5)
        s.resume_at(5, consumed)
        seen += list(s)
    # every sample not yet consumed, each once, plus (as DistributedSampler does) padding to a multiple of 3
    assert set(order[consumed:]) <= set(seen)
    assert len(seen) - (n - consumed) == (-(n - consumed)) % 3
    assert sorted(seen) == sorted(ResumableSampler(n, num_replicas=3, seed=1).global_order(5)[consumed:])
    # a resume point for another epoch is ignored
    s = ResumableSampler(n, num_replicas=2, rank=0, seed=1)
    s.set_epoch(6)
    s.resume_at(5, consumed)
    assert len(list(s)) == len(s)


def test_rng_capture_restores_every_stream():
    state = capture_rng()
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]
    # the saved state loads with weights_only=True (tensors and plain values only)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    assert torch.equal(torch.rand(3), first[0])


def test_watchdog_fires_on_a_stalled_step_but_not_while_paused():
    reports: list[str] = []
    dog = Watchdog(timeout=1.5, rank=3, world_size=4, on_timeout=reports.append)
    dog.start()
    dog.beat(1)
    dog.pause()
    time.sleep(2.5)
    assert reports == []  # a long save is not a hang
    dog.resume()
    dog.beat(2)
    time.sleep(3.0)
    dog.stop()
    assert len(reports) == 1
    assert "[rank 3] watchdog: no training step finished" in reports[0]
    assert "last finished step 2" in reports[0]


def test_watchdog_derives_its_limit_from_step_times():
    dog = Watchdog(timeout=None, rank=0, world_size=1, min_timeout=10.0, factor=20.0, warmup=3)
    assert dog.limit() is None
    dog._durations.extend([0.5, 1.0, 2.0])
    assert dog.limit() == 20.0  # 20 x median 1.0
    dog._durations.extend([0.1] * 3)
    assert dog.limit() == 10.0  # never below min_timeout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 1}, "keep_last must be >= 2"),
        ({"every_n_train_steps": 0}, "every_n_train_steps must be >= 1"),
        ({"every_n_minutes": -1}, "every_n_minutes must be > 0"),
        ({"nan_policy": "ignore"}, "nan_policy must be"),
        ({"signals": ["SIGNOPE"]}, "Unknown signal name"),
    ],
)
def test_bad_arguments_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        FaultTolerantCheckpoint(dirpath=tmp_path, **kwargs)


def test_a_restarted_worker_gets_a_fresh_store(monkeypatch):
    monkeypatch.setattr("lightning_hybrid._elastic.RESTART_PAUSE_S", 0.0)
    # setenv first, so that the value the code under test writes is removed afterwards too: a marker left
    # in this process's environment would reach every job the later tests launch
    monkeypatch.setenv("LIGHTNING_HYBRID_FRESH_STORE", "1:29999")  # inherited from another process: ignored
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not prepare_elastic_restart()
    assert os.environ["MASTER_PORT"] == "29500"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert prepare_elastic_restart()
    assert os.environ["MASTER_PORT"] == "29503"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert not prepare_elastic_restart()  # once per process
    assert os.environ["MASTER_PORT"] == "29503"
    assert os.environ["LIGHTNING_HYBRID_FRESH_STORE"] == f"{os.getpid()}:29503"


def _fit_single_device(tmp_path, steps: int, *, epochs_over: bool = False) -> dict[str, torch.Tensor]:
    import lightning as L
    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=64, stride=16)  # a short epoch: resume crosses epochs
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2, dropout=0.1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[FaultTolerantCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)],
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    assert trainer.num_training_batches < steps  # the run spans several epochs
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.trainer
def test_single_device_resume_across_an_epoch_boundary_is_bitwise_exact(tmp_path):
    uninterrupted = _fit_single_device(tmp_path / "a", 25)
    _fit_single_device(tmp_path / "b", 11)  # stops at 11; its last checkpoints are steps 9 and 11
    resumed = _fit_single_device(tmp_path / "b", 25)
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_watchdog_beat_within_a_step_refreshes_the_clock_without_adding_a_step_time():
    dog = Watchdog(timeout=None, rank=0, world_size=1)
    dog.beat(1)
    dog.beat(1)  # a validation batch during fit: still step 1
    dog.beat(2)
    assert len(dog._durations) == 2
