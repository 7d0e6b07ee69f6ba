"""FaultTolerantCheckpoint in one process against a broken or hostile checkpoint folder: it resumes from the
newest valid checkpoint, deletes nothing it did not write, and never crashes on a bad file."""

from __future__ import annotations

import json
import logging
import shutil
from collections import defaultdict, namedtuple
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_hybrid.callbacks import FaultTolerantCheckpoint
from lightning_hybrid.checkpoint import _format

pytestmark = pytest.mark.trainer

Counts = namedtuple("Counts", "seen skipped")


class OddState(Callback):
    """A callback whose checkpoint state holds containers that are not plain dicts and lists."""

    def __init__(self) -> None:
        self.per_token: defaultdict[str, int] = defaultdict(int)
        self.counts = Counts(0, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_token[f"b{batch_idx % 3}"] += 1
        self.counts = Counts(self.counts.seen + 1, self.counts.skipped)

    def state_dict(self):
        return {"per_token": self.per_token, "counts": self.counts, "weights": torch.ones(3)}

    def load_state_dict(self, state_dict) -> None:
        self.per_token, self.counts = state_dict["per_token"], state_dict["counts"]


def _fit(root: Path, steps: int, *, extra=(), **ft) -> tuple[FaultTolerantCheckpoint, dict[str, torch.Tensor]]:
    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=32, stride=16)
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2, dropout=0.1)
    callback = FaultTolerantCheckpoint(**{"dirpath": root, "every_n_train_steps": 2, "keep_last": 2, **ft})
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback, *extra],
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    assert trainer.global_step == steps
    return callback, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-") and not p.is_symlink())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    return _fit(tmp_path_factory.mktemp("ref") / "ckpt", 10)[1]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage", ["deleted", "dangling", "a user's file", "a folder"])
def test_a_lost_or_foreign_last_link_still_resumes_from_the_newest_valid_checkpoint(tmp_path, uninterrupted, damage):
    root = tmp_path / "ckpt"
    _fit(root, 6)
    link = root / "last.ckpt"
    link.unlink()
    if damage == "dangling":
        link.symlink_to("step-000000042/checkpoint.pt")
    elif damage == "a user's file":
        link.write_bytes(b"my own notes")
    elif damage == "a folder":
        link.mkdir()
        (link / "keep.txt").write_text("mine")
    callback, weights = _fit(root, 10)
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")  # not a silent fresh start
    assert _same(weights, uninterrupted)
    if damage == "a user's file":
        assert link.read_bytes() == b"my own notes" and (root / "last-v1.ckpt").is_symlink()
    if damage == "a folder":
        assert (link / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda body: body.pop("files"),
        lambda body: body.update(files=None),
        lambda body: body.update(files=["checkpoint.pt"]),
        lambda body: body.update(files={}),
        lambda body: body.update(step=None),
        lambda body: body["files"].update({"../../../etc/hostname": {"bytes": 1, "sha256": "0" * 64}}),
    ],
    ids=["key-renamed", "null", "list", "empty", "step-null", "traversal"],
)
def test_a_malformed_newest_manifest_skips_that_checkpoint_instead_of_crashing(
    tmp_path, uninterrupted, corrupt, caplog
):
    root = tmp_path / "ckpt"
    _fit(root, 8)
    manifest = root / "step-000000008" / "manifest.json"
    body = json.loads(manifest.read_text())
    corrupt(body)
    manifest.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING):
        callback, weights = _fit(root, 10)
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    assert "skipping checkpoint" in caplog.text and "step-000000008: unreadable manifest" in caplog.text
    assert _same(weights, uninterrupted)
    # the rejected step 8 was never overwritten: its rewrite went to step-8-v1, which then superseded it
    assert _steps(root) == ["step-000000008-v1", "step-000000010"]


def test_corrupt_newer_checkpoints_never_cost_the_valid_ones(tmp_path, uninterrupted):
    root = tmp_path / "ckpt"
    _fit(root, 8, keep_last=3)  # keeps 4, 6, 8
    for step in (6, 8):  # both newest are corrupt: only 4 is valid
        target = root / f"step-{step:09d}" / "checkpoint.pt"
        data = bytearray(target.read_bytes())
        data[100] ^= 0xFF
        target.write_bytes(bytes(data))
    callback, weights = _fit(root, 10, keep_last=2)
    assert callback.resumed_from.endswith("step-000000004/checkpoint.pt")
    assert _same(weights, uninterrupted)
    # rewrites of 6 and 8 went to new folders; the corrupt ones were superseded; 10 and the rewritten 8 kept
    assert _steps(root) == ["step-000000008-v1", "step-000000010"]


def test_start_up_hashes_only_until_the_first_valid_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    _fit(root, 8, keep_last=4)  # 2, 4, 6, 8
    hashed: list[str] = []
    real = _format.sha256_file
    monkeypatch.setattr(_format, "sha256_file", lambda path: hashed.append(Path(path).parent.name) or real(path))
    callback, _ = _fit(root, 8, keep_last=4)  # resume at the end: nothing to train, only the choice
    assert callback.resumed_from.endswith("step-000000008/checkpoint.pt")
    assert set(hashed) == {"step-000000008"}


def test_links_named_like_step_folders_are_neither_used_nor_deleted(tmp_path, uninterrupted):
    other = tmp_path / "other-run"
    _fit(other, 10)  # a complete, valid run elsewhere, with a newer step
    root = tmp_path / "ckpt"
    _fit(root, 4)
    (root / "step-000000010").symlink_to(other / "step-000000010")
    (root / "step-000000002-v9").symlink_to(other / "step-000000008")  # older: retention would delete it
    callback, weights = _fit(root, 10)
    assert callback.resumed_from.endswith("step-000000004/checkpoint.pt")  # not the other run's step 10
    assert _same(weights, uninterrupted)
    assert _format.verify(other / "step-000000010", _format.read_manifest(other / "step-000000010")) is None
    assert _format.verify(other / "step-000000008", _format.read_manifest(other / "step-000000008")) is None
    assert (root / "step-000000002-v9").is_symlink()


class TupleState(Callback):
    """A callback whose state is a namedtuple (a type torch loads once it is allow-listed)."""

    def __init__(self) -> None:
        self.counts = Counts(0, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts = Counts(self.counts.seen + 1, self.counts.skipped)

    def state_dict(self):
        return {"counts": self.counts}

    def load_state_dict(self, state_dict) -> None:
        self.counts = state_dict["counts"]


def test_async_saves_keep_containers_that_are_not_plain_dicts(tmp_path):
    """A namedtuple in the state crashed the background staging; sync saves always worked."""
    torch.serialization.add_safe_globals([Counts])  # the user's part: torch loads only allow-listed types
    try:
        _fit(tmp_path, 6, extra=[TupleState()], async_save=True)
        resumed = TupleState()
        callback, _ = _fit(tmp_path, 8, extra=[resumed], async_save=True)
    finally:
        torch.serialization.clear_safe_globals()
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    assert isinstance(resumed.counts, Counts) and resumed.counts == (8, 0)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_state_that_would_not_load_without_running_code_is_refused_at_the_first_save(tmp_path, async_save):
    with pytest.raises(ValueError) as excinfo:
        _fit(tmp_path, 4, extra=[OddState()], async_save=async_save)
    assert "refusing to write checkpoint step 2" in str(excinfo.value) and "defaultdict" in str(excinfo.value)
    assert not list(tmp_path.glob("step-*"))  # nothing half-written left behind


def test_a_checkpoint_folder_copied_elsewhere_resumes_there(tmp_path, uninterrupted):
    root = tmp_path / "ckpt"
    _fit(root, 6)
    moved = tmp_path / "moved"
    shutil.copytree(root, moved, symlinks=False)  # the link becomes a copy of the file: not ours any more
    assert not (moved / "last.ckpt").is_symlink()
    callback, weights = _fit(moved, 10)
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    assert _same(weights, uninterrupted)


def test_with_no_valid_checkpoint_the_run_starts_fresh_exactly_as_a_first_run(tmp_path, uninterrupted):
    root = tmp_path / "ckpt"
    _fit(root, 4)
    for folder in root.glob("step-*"):
        (folder / "checkpoint.pt").write_bytes(b"garbage")
    callback, weights = _fit(root, 10)
    assert callback.resumed_from.endswith("step-000000000/checkpoint.pt")  # the initial state, saved first
    assert _same(weights, uninterrupted)  # RNG streams and data order as in a first run


def test_a_crafted_newest_checkpoint_is_skipped_even_when_fit_allows_unsafe_loads(tmp_path, uninterrupted):
    """The folder is data: with fit(weights_only=False) Lightning would unpickle anything it is handed."""
    import hashlib
    import io

    root = tmp_path / "ckpt"
    _fit(root, 8)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    buffer = io.BytesIO()
    torch.save({"state_dict": {}, "evil": Evil()}, buffer)
    newest = root / "step-000000008"
    (newest / "checkpoint.pt").write_bytes(buffer.getvalue())
    body = json.loads((newest / "manifest.json").read_text())
    data = (newest / "checkpoint.pt").read_bytes()
    body["files"]["checkpoint.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (newest / "manifest.json").write_text(json.dumps(body))  # the attacker fixes the manifest too
    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data_module = CharDataModule(block_size=16, batch_size=32, stride=16)
    model = GPT(vocab_size=data_module.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2, dropout=0.1)
    callback = FaultTolerantCheckpoint(dirpath=root, every_n_train_steps=2, keep_last=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=10, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model, datamodule=data_module, ckpt_path="last", weights_only=False)
    assert not marker.exists()
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert _same(weights, uninterrupted)


def test_a_fresh_run_in_a_used_folder_leaves_the_other_runs_checkpoints_alone(tmp_path):
    root = tmp_path / "ckpt"
    _fit(root, 10)  # the first run: keeps steps 8 and 10
    before = {p.name: (p / "manifest.json").read_bytes() for p in root.glob("step-*")}
    from gpt import GPT, CharDataModule

    L.seed_everything(1)
    data = CharDataModule(block_size=16, batch_size=32, stride=16)
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2)
    callback = FaultTolerantCheckpoint(dirpath=root, every_n_train_steps=2, keep_last=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=12, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)  # no ckpt_path: a new run, not a resume
    assert callback.resumed_from is None
    for name, manifest in before.items():  # neither deleted nor rewritten
        assert (root / name / "manifest.json").read_bytes() == manifest
    ours = sorted(p.name for p in root.glob("step-*") if p.name not in before)
    assert len(ours) == 2 and ours[-1] == "step-000000012"  # its own two newest (retention counts its own only)


def test_a_manifest_that_is_a_folder_is_never_a_crash_loop(tmp_path, uninterrupted):
    root = tmp_path / "ckpt"
    _fit(root, 6)
    odd = root / "step-000000001"
    (odd / "manifest.json").mkdir(parents=True)
    (odd / "rank-00000.pt").write_bytes(b"x")
    callback, weights = _fit(root, 10)  # resumes, saves, prunes: the odd folder is skipped and left
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    assert _same(weights, uninterrupted)
    assert (odd / "manifest.json").is_dir()


def test_a_dirpath_through_a_link_resumes_exactly(tmp_path, uninterrupted):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    _fit(tmp_path / "link" / "ckpt", 6)
    callback, weights = _fit(tmp_path / "link" / "ckpt", 10)
    assert callback.resumed_from == str(real / "ckpt" / "step-000000006" / "checkpoint.pt")
    assert _same(weights, uninterrupted)


def test_a_checkpoint_of_another_kind_is_skipped_not_loaded(tmp_path, uninterrupted):
    """A sharded folder (another strategy's) newer than the valid one: a single-device run skips it."""
    from lightning_hybrid.checkpoint._files import atomic_write
    from lightning_hybrid.checkpoint._format import manifest_payload
    from lightning_hybrid.checkpoint._sharded import write_sharded
    from lightning_hybrid.checkpoint._store import new_step_folder

    root = tmp_path / "ckpt"
    _fit(root, 6)
    folder = new_step_folder(root, 9)
    files = write_sharded(folder.path, {"state_dict": {"w": torch.ones(3)}}, {"epoch": 0})
    rank = {"rng": {"torch": torch.zeros(2, dtype=torch.uint8)}, "data": {"epoch": 0, "consumed": 0}}
    files["rank-00000.pt"] = atomic_write(folder.path / "rank-00000.pt", lambda f: torch.save(rank, f))
    body = manifest_payload(step=9, kind="sharded", world_size=1, files=files, info={})
    atomic_write(folder.path / "manifest.json", lambda f: f.write(body))
    callback, weights = _fit(root, 10)
    assert callback.resumed_from.endswith("step-000000006/checkpoint.pt")
    assert _same(weights, uninterrupted)
