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


def test_async_saves_keep_containers_that_are_not_plain_dicts(tmp_path):
    """A defaultdict or a namedtuple in the state crashed the background staging; sync saves always worked."""
    saved = {}
    for mode in ("sync", "async"):
        state = OddState()
        _fit(tmp_path / mode, 6, extra=[state], async_save=mode == "async")
        # the test trusts its own file; torch's weights_only loader refuses a defaultdict (a resume with one in
        # the state needs `weights_only=False` in fit(), the user's call)
        checkpoint = torch.load(tmp_path / mode / "step-000000006" / "checkpoint.pt", weights_only=False)
        saved[mode] = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("OddState"))
    for mode in saved:
        assert isinstance(saved[mode]["per_token"], defaultdict) and isinstance(saved[mode]["counts"], Counts)
    assert saved["async"]["per_token"] == saved["sync"]["per_token"] and saved["async"]["counts"] == (6, 0)


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
