"""The on-disk checkpoint format against hostile and broken folders: nothing runs, nothing valid is lost.

Each test builds the bad input itself (a crafted pickle that would create a marker file, manifests with
traversal paths, links to folders outside the checkpoint folder, truncated files) and checks both that
the pack refuses it and, where it matters, that the plain torch path would have done the harm.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections import defaultdict, namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_hybrid.callbacks._writer import snapshot
from lightning_hybrid.checkpoint import _files, _store
from lightning_hybrid.checkpoint._files import AtomicFileSystem, atomic_write, dcp_writer, sha256_file
from lightning_hybrid.checkpoint._format import ManifestError, manifest_payload, parse_manifest, read_manifest, verify
from lightning_hybrid.checkpoint._safe_load import UnsafeCheckpointError, read_dcp_metadata
from lightning_hybrid.checkpoint._sharded import read_sharded, write_sharded
from lightning_hybrid.checkpoint._store import StepFolder, new_step_folder, retention, step_folders
from lightning_hybrid.utilities import consolidate_checkpoint
from lightning_hybrid.utilities.consolidate import consolidated_lightning_checkpoint

pytestmark = pytest.mark.unit


class _Marker:
    """Unpickling this creates a file: the stand-in for arbitrary code in a checkpoint."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


RANK_STATE = {"rng": {"torch": torch.zeros(3, dtype=torch.uint8)}, "data": {"epoch": 0, "consumed": 0}, "rank": 0}


def _file_checkpoint(root: Path, step: int) -> StepFolder:
    """A complete single-file checkpoint folder of one rank, as the callback writes it."""
    folder = new_step_folder(root, step)
    payload = {"state_dict": {"w": torch.arange(250.0)}, "global_step": step}
    files = {
        "checkpoint.pt": atomic_write(folder.path / "checkpoint.pt", lambda f: torch.save(payload, f)),
        "rank-00000.pt": atomic_write(folder.path / "rank-00000.pt", lambda f: torch.save(RANK_STATE, f)),
    }
    body = manifest_payload(step=step, kind="file", world_size=1, files=files, info={})
    atomic_write(folder.path / "manifest.json", lambda f: f.write(body))
    return folder


def _sharded_checkpoint(root: Path, step: int, state: dict | None = None) -> StepFolder:
    folder = new_step_folder(root, step)
    tensors = state or {"state_dict": {"w": torch.arange(12.0).view(3, 4)}, "optimizer_0": {"param_groups.w.lr": 0.1}}
    files = write_sharded(folder.path, tensors, {"epoch": 0, "loops": {}})
    files["rank-00000.pt"] = atomic_write(folder.path / "rank-00000.pt", lambda f: torch.save(RANK_STATE, f))
    body = manifest_payload(step=step, kind="sharded", world_size=1, files=files, info={"layout": None})
    atomic_write(folder.path / "manifest.json", lambda f: f.write(body))
    return folder


def test_init_from_a_pack_checkpoint_hashes_its_files_on_one_rank_only(tmp_path, monkeypatch):
    """Every rank checks the files are there with their sizes; the SHA-256 of every file is read by one rank
    (agreed_plan then agrees its verdict), not once per rank of a large job."""
    from lightning_hybrid.checkpoint import _format
    from lightning_hybrid.checkpoint.pretrained import open_weights

    folder = _sharded_checkpoint(tmp_path, 3).path
    hashed: list[str] = []
    real = _format.sha256_file
    monkeypatch.setattr(_format, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    open_weights(folder, verify=False).index()
    assert hashed == []
    open_weights(folder, verify=True).index()
    assert ".metadata" in hashed
    (folder / "rank-00000.pt").write_bytes(b"x")  # a truncated file fails the size check without hashing
    with pytest.raises(ValueError, match="bytes"):
        open_weights(folder, verify=False)


def _rewrite_manifest(folder: Path, **changes) -> None:
    body = json.loads((folder / "manifest.json").read_text())
    body.update(changes)
    (folder / "manifest.json").write_text(json.dumps(body))


def _rehash(folder: Path, name: str) -> None:
    """What an attacker who can write the folder does after changing a file: fix the manifest to match."""
    body = json.loads((folder / "manifest.json").read_text())
    body["files"][name] = {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
    (folder / "manifest.json").write_text(json.dumps(body))


# ------------------------------------------------------------------------------- no code from a file


def test_a_crafted_dcp_index_is_refused_and_runs_nothing(tmp_path):
    folder = _sharded_checkpoint(tmp_path, 4).path
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    _rehash(folder, ".metadata")  # the manifest cannot help: whoever writes the files rewrites it too

    # the danger is real: torch's own reader runs it (and then fails on what it built)
    with pytest.raises(AttributeError):
        dcp.FileSystemReader(folder).read_metadata()
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load pathlib\.Path\.touch"):
        read_dcp_metadata(folder)
    problem = verify(folder, read_manifest(folder))
    assert problem is not None and "not a valid torch DCP index" in problem and "Path.touch" in problem
    with pytest.raises(ValueError, match="fails verification"):
        consolidate_checkpoint(folder)
    (folder / "manifest.json").unlink()  # without a manifest, the reader itself still refuses
    with pytest.raises(UnsafeCheckpointError):
        consolidate_checkpoint(folder)
    assert not marker.exists()


def test_a_crafted_non_tensor_value_in_a_dcp_data_file_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    state = {"state_dict": {"w": torch.ones(2)}, "optimizer_0": {"param_groups.w.lr": _Marker(marker)}}
    folder = _sharded_checkpoint(tmp_path, 2, state).path
    assert not marker.exists()  # saving pickles it; nothing ran yet

    # the danger is real: DCP's default planner unpickles byte items with weights_only=False
    dcp.load({"state_dict": {"w": torch.zeros(2)}, "optimizer_0": {"param_groups.w.lr": None}}, checkpoint_id=folder)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match=r"optimizer_0\.param_groups\.w\.lr"):
        read_sharded(folder, {"state_dict": {"w": torch.zeros(2)}, "optimizer_0": {"param_groups.w.lr": None}})
    problem = verify(folder, read_manifest(folder))
    assert problem is not None and "param_groups.w.lr is not plain data" in problem
    assert not marker.exists()


def test_consolidate_reads_meta_without_running_code(tmp_path):
    folder = _sharded_checkpoint(tmp_path, 2).path
    marker = tmp_path / "pwned"
    (folder / "meta.pt").write_bytes(_torch_bytes({"epoch": 0, "evil": _Marker(marker)}))
    _rehash(folder, "meta.pt")
    with pytest.raises(pickle.UnpicklingError):
        consolidated_lightning_checkpoint(folder)
    assert not marker.exists()


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_the_allow_list_reads_every_index_the_pack_writes(tmp_path):
    state = {
        "state_dict": {"a": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16), "c": torch.tensor(3)},
        "optimizer_0": {
            "state.a.step": torch.tensor(3.0),
            "state.a.exp_avg": torch.randn(3, 4, dtype=torch.float16),
            "param_groups.a.lr": 0.1,
            "param_groups.a.betas": (0.9, 0.99),
            "param_groups.a.name": "x",
            "param_groups.a.foreach": None,
            "param_groups.a.maximize": False,
        },
    }
    folder = _sharded_checkpoint(tmp_path, 1, state).path
    assert verify(folder, read_manifest(folder)) is None
    assert (
        read_dcp_metadata(folder).state_dict_metadata.keys()
        == dcp.FileSystemReader(folder).read_metadata().state_dict_metadata.keys()
    )
    target = {
        "state_dict": {k: torch.zeros_like(v) for k, v in state["state_dict"].items()},
        "optimizer_0": {
            k: torch.zeros_like(v) if torch.is_tensor(v) else None for k, v in state["optimizer_0"].items()
        },
    }
    read_sharded(folder, target)
    for section in state:
        for key, value in state[section].items():
            got = target[section][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value


@pytest.mark.parametrize("where", ["../../elsewhere.distcp", "/etc/passwd", "meta.pt", ".metadata", "rank-00000.pt"])
def test_an_index_pointing_outside_the_data_files_is_refused(tmp_path, where):
    """A value "stored" in meta.pt, .metadata or a rank file would dodge the checks made on data files."""
    folder = _sharded_checkpoint(tmp_path, 3).path
    metadata = dcp.FileSystemReader(folder).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = where
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(folder, ".metadata")
    with pytest.raises(UnsafeCheckpointError, match="not a DCP data file of the checkpoint directory"):
        read_dcp_metadata(folder)
    assert "not a DCP data file" in verify(folder, read_manifest(folder))


def test_an_index_asking_for_stream_transforms_is_refused(tmp_path):
    folder = _sharded_checkpoint(tmp_path, 3).path
    metadata = dcp.FileSystemReader(folder).read_metadata()
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(folder, ".metadata")
    with pytest.raises(UnsafeCheckpointError, match="stream transforms"):
        read_dcp_metadata(folder)


def test_a_crafted_checkpoint_file_fails_verification_before_anything_loads_it(tmp_path):
    folder = _file_checkpoint(tmp_path, 4).path
    marker = tmp_path / "pwned"
    (folder / "checkpoint.pt").write_bytes(_torch_bytes({"state_dict": {}, "evil": _Marker(marker)}))
    _rehash(folder, "checkpoint.pt")
    assert "checkpoint.pt does not load as plain data" in verify(folder, read_manifest(folder))
    (folder / "rank-00000.pt").write_bytes(_torch_bytes({"rng": 1}))
    _rehash(folder, "rank-00000.pt")
    assert "rank-00000.pt is not a rank state" in verify(folder, read_manifest(folder), hash_names=["rank-00000.pt"])
    assert not marker.exists()


def test_unsafe_payloads_are_recognised_before_they_are_written():
    from collections import OrderedDict

    from lightning_hybrid.checkpoint._safe_load import unsafe_payload

    assert unsafe_payload({"a": torch.ones(3), "b": [1, 2.0, "x", None, (1, 2)], "c": OrderedDict(x=1)}) is None
    # a defaultdict cannot be allow-listed: the advice names the key and says to return a dict instead
    message = unsafe_payload({"callbacks": {"Counter": {"counts": defaultdict(int)}}})
    assert "callbacks.Counter.counts" in message and "dict(...)" in message and "add_safe_globals" not in message
    message = unsafe_payload({"x": [_Marker(Path("/nonexistent"))]})
    assert "Unsupported global" in message and "add_safe_globals" in message


# ------------------------------------------------------------------------------------ the manifest


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"files": {"../../etc/passwd": {"bytes": 1, "sha256": "0" * 64}}}, "not a checkpoint file name"),
        ({"files": {"/etc/passwd": {"bytes": 1, "sha256": "0" * 64}}}, "not a checkpoint file name"),
        ({"files": {}}, "'files' must be a non-empty object"),
        ({"files": ["checkpoint.pt"]}, "'files' must be a non-empty object"),
        ({"files": None}, "'files' must be a non-empty object"),
        ({"files": {"checkpoint.pt": {"bytes": 1000, "sha256": "0" * 64}}}, "does not list ['rank-00000.pt']"),
        ({"files": {"rank-00000.pt": {"bytes": True, "sha256": "0" * 64}}}, "must be {'bytes': int >= 0"),
        ({"step": None}, "'step' must be an integer >= 0"),
        ({"step": 5}, "its step (5) is not the folder's (4)"),
        ({"world_size": 0}, "'world_size' must be an integer >= 1"),
        ({"format": 7}, "unknown format 7"),
        ({"kind": "zip"}, "'kind' must be 'file' or 'sharded'"),
    ],
)
def test_a_malformed_manifest_is_an_invalid_checkpoint_not_a_crash(tmp_path, change, why):
    folder = _file_checkpoint(tmp_path, 4).path
    _rewrite_manifest(folder, **change)
    with pytest.raises(ManifestError) as excinfo:
        read_manifest(folder, step=4)
    assert why in str(excinfo.value)


@pytest.mark.parametrize("text", ["", "{", "null", "[]", '"x"', "\xff\xfe", "[" * 200_000])
def test_unparseable_manifests_raise_manifest_errors(text):
    with pytest.raises(ManifestError):
        parse_manifest(text.encode("latin-1"))


def test_a_huge_world_size_is_refused_without_building_anything(tmp_path):
    import time

    folder = _file_checkpoint(tmp_path, 4).path
    _rewrite_manifest(folder, world_size=10**9)
    start = time.monotonic()
    with pytest.raises(ManifestError, match="larger than the number of files"):
        read_manifest(folder)
    assert time.monotonic() - start < 1.0


def test_renamed_key_in_the_manifest_is_an_invalid_checkpoint(tmp_path):
    folder = _file_checkpoint(tmp_path, 4).path
    body = json.loads((folder / "manifest.json").read_text())
    body["filez"] = body.pop("files")
    (folder / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(ManifestError, match="'files' must be"):
        read_manifest(folder)


def test_verification_detects_truncation_bit_flips_missing_files_and_links(tmp_path):
    folder = _file_checkpoint(tmp_path, 10).path
    manifest = read_manifest(folder)
    assert verify(folder, manifest) is None
    original = (folder / "checkpoint.pt").read_bytes()
    data = bytearray(original)
    data[500] ^= 0x01
    (folder / "checkpoint.pt").write_bytes(bytes(data))
    assert "SHA-256" in verify(folder, manifest)
    assert verify(folder, manifest, hash_names=()) is None  # same size: only the checksum can tell
    (folder / "checkpoint.pt").write_bytes(bytes(data[:700]))
    assert "700 bytes" in verify(folder, manifest, hash_names=())
    # a listed file replaced by a link to a file elsewhere (same size, same contents) is not accepted
    outside = tmp_path / "outside.pt"
    outside.write_bytes(original)
    (folder / "checkpoint.pt").unlink()
    (folder / "checkpoint.pt").symlink_to(outside)
    assert "not a regular file" in verify(folder, manifest)
    (folder / "checkpoint.pt").unlink()
    outside.rename(folder / "checkpoint.pt")
    (folder / "rank-00000.pt").unlink()
    assert "rank-00000.pt is missing" in verify(folder, manifest)


# ---------------------------------------------------------------------------------- durable writes


def test_every_file_is_on_disk_with_its_final_size_before_it_gets_its_real_name(tmp_path, monkeypatch):
    """A rename is durable only after the final bytes were fsynced (DCP fsyncs before Python's buffer is
    flushed), and the directory is fsynced after the rename."""
    fsynced: dict[int, int] = {}  # inode -> size at its last fsync
    synced_dirs: list[str] = []
    renamed: list[tuple[str, int, int]] = []  # (final name, size, size at last fsync)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        info = os.fstat(fd)
        if os.path.stat.S_ISDIR(info.st_mode):
            synced_dirs.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsynced[info.st_ino] = info.st_size
        return real_fsync(fd)

    def record(src, dst):
        info = os.stat(src)
        if not os.path.stat.S_ISDIR(info.st_mode):
            renamed.append((Path(dst).name, info.st_size, fsynced.get(info.st_ino, -1)))

    def replace(src, dst):
        record(src, dst)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    state = {"state_dict": {"w": torch.randn(64, 64)}, "optimizer_0": {"param_groups.w.lr": 0.1}}
    folder = new_step_folder(tmp_path, 1)
    synced_dirs.clear()
    write_sharded(folder.path, state, {"epoch": 0})
    atomic_write(folder.path / "rank-00000.pt", lambda f: torch.save({"x": torch.ones(1000)}, f))
    names = {name for name, _, _ in renamed}
    assert {".metadata", "__0_0.distcp", "meta.pt", "rank-00000.pt"} <= names, names
    for name, size, synced in renamed:
        assert synced == size, f"{name} renamed with {size} bytes but only {synced} were fsynced"
    assert str(folder.path) in synced_dirs  # the renames themselves were made durable


def test_a_write_that_fails_or_is_interrupted_leaves_nothing_under_the_real_name(tmp_path):
    target = tmp_path / "state.pt"

    def fail_half_way(f):
        f.write(b"half")
        raise OSError("disk full")

    def interrupted(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail_half_way)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C propagates; it is not a failed write to swallow
        atomic_write(target, interrupted)
    assert list(tmp_path.iterdir()) == []
    entry = atomic_write(target, lambda f: torch.save({"w": torch.arange(1000)}, f))
    assert entry == {"bytes": target.stat().st_size, "sha256": sha256_file(target)}  # hashed while written
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(1000))


def test_dcp_writes_through_the_atomic_filesystem(tmp_path):
    writer, fs = dcp_writer(tmp_path)
    assert isinstance(writer.fs, AtomicFileSystem)
    dcp.save({"w": torch.ones(3)}, storage_writer=writer, no_dist=True)
    assert set(fs.written) == {".metadata", "__0_0.distcp"}
    assert all(fs.written[n]["sha256"] == sha256_file(tmp_path / n) for n in fs.written)
    assert not [p for p in tmp_path.iterdir() if _files.is_temp_name(p.name)]


# ------------------------------------------------------------------------------ the folder and links


def test_a_step_is_never_rewritten_in_place(tmp_path):
    first = _file_checkpoint(tmp_path, 6)
    again = new_step_folder(tmp_path, 6)
    assert again.name == "step-000000006-v1" and again > first
    assert [f.name for f in step_folders(tmp_path)] == ["step-000000006-v1", "step-000000006"]
    assert verify(first.path, read_manifest(first.path)) is None


def test_clean_up_removes_only_what_the_pack_wrote_and_never_follows_links(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    elsewhere = tmp_path / "another-run" / "step-000000099"
    elsewhere.mkdir(parents=True)
    (elsewhere / "checkpoint.pt").write_bytes(b"their work")
    (root / "step-000000100").symlink_to(elsewhere)  # a link named like a step folder, without a manifest
    (root / "notes.tmp-1234").write_text("a user's file")  # a name like an old temporary name
    (root / "data.lhtmp-0123456789abcdef").mkdir()  # a folder with our temporary pattern
    unfinished = root / "step-000000010"
    unfinished.mkdir()
    (unfinished / "checkpoint.pt.lhtmp-0123456789abcdef").write_bytes(b"partial")
    mixed = root / "step-000000012"
    mixed.mkdir()
    (mixed / "rank-00000.pt").write_bytes(b"partial")
    (mixed / "README.txt").write_text("a user put this here")
    removed, kept = _store.clean_stale(root)
    assert not unfinished.exists() and unfinished in removed
    assert mixed.exists() and (mixed / "README.txt").exists() and mixed in kept
    assert (elsewhere / "checkpoint.pt").read_bytes() == b"their work" and (root / "step-000000100").is_symlink()
    assert (root / "notes.tmp-1234").exists() and (root / "data.lhtmp-0123456789abcdef").is_dir()
    assert [f.name for f in step_folders(root)] == ["step-000000012"]  # the link is not a step folder
    assert _store.foreign_step_entries(root) == ["step-000000100"]
    assert not _store.remove_step_folder(StepFolder(100, 0, root / "step-000000100"))
    assert (elsewhere / "checkpoint.pt").exists()


def test_the_pointer_never_replaces_what_it_did_not_make(tmp_path):
    _file_checkpoint(tmp_path, 2)
    (tmp_path / "last.ckpt").write_bytes(b"a user's own checkpoint")
    pointer, taken = _store.pointer_path(tmp_path)
    assert pointer.name == "last-v1.ckpt" and taken == [tmp_path / "last.ckpt"]
    _store.point_last(pointer, tmp_path / "step-000000002" / "checkpoint.pt")
    assert (tmp_path / "last.ckpt").read_bytes() == b"a user's own checkpoint"
    assert _store.pointer_target(pointer) == tmp_path / "step-000000002"
    (tmp_path / "last.ckpt").unlink()
    (tmp_path / "last.ckpt").mkdir()  # a folder of that name: also left alone
    assert _store.pointer_path(tmp_path)[0].name == "last-v1.ckpt"
    (tmp_path / "last.ckpt").rmdir()
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "elsewhere")  # a link of someone else's
    assert _store.pointer_path(tmp_path)[0].name == "last-v1.ckpt"
    (tmp_path / "last.ckpt").unlink()
    (tmp_path / "last.ckpt").symlink_to("step-000000002/checkpoint.pt")  # ours (relative, into a step folder)
    assert _store.pointer_path(tmp_path)[0].name == "last.ckpt"


def test_answer_to_last_survives_a_lost_or_dangling_link(tmp_path):
    from lightning_hybrid.callbacks._resume_choice import answer_last

    assert answer_last(tmp_path) == set()  # nothing to resume: a fresh start
    _file_checkpoint(tmp_path, 2)
    newest = _file_checkpoint(tmp_path, 4)
    broken = _file_checkpoint(tmp_path, 6)
    (broken.path / "checkpoint.pt").write_bytes(b"short")  # wrong size: not even plausible
    pointer = tmp_path / "last.ckpt"
    assert not pointer.exists()  # an rsync dropped the link
    assert answer_last(tmp_path) == {str(pointer)}
    assert pointer.resolve() == (newest.path / "checkpoint.pt").resolve()
    pointer.unlink()
    pointer.symlink_to("step-000000009/checkpoint.pt")  # dangling
    assert answer_last(tmp_path) == {str(pointer)}
    assert pointer.resolve() == (newest.path / "checkpoint.pt").resolve()


def test_retention_keeps_verified_checkpoints_when_newer_ones_are_corrupt(tmp_path):
    """The scenario that deleted every valid checkpoint but one: corrupt newer folders do not count."""

    def folder(step, version=0):
        made = StepFolder(step, version, tmp_path / _store.step_name(step, version))
        made.path.mkdir()
        (made.path / "manifest.json").write_text("{}")  # complete (what is in it does not matter here)
        return made

    s4, s6, s8, s10, s12 = (folder(s) for s in (4, 6, 8, 10, 12))
    rejected = {s12.path, s10.path}
    # at start: 12 and 10 corrupt, 8 verified; nothing new written yet -> nothing may go
    assert retention(step_folders(tmp_path), verified={s8.path}, rejected=rejected, keep_last=2) == []
    # this run rewrites step 10 (as step-10-v1): two verified now; the corrupt 10 and the unchecked older go
    s10b = folder(10, 1)
    doomed = retention(step_folders(tmp_path), verified={s8.path, s10b.path}, rejected=rejected, keep_last=2)
    assert set(doomed) == {s10, s6, s4}  # 8 and 10-v1 kept; 12 (newer, maybe a node's fault) kept
    # with keep_last=3 and only two verified, unchecked older ones stay (they may be the fallback)
    doomed = retention(step_folders(tmp_path), verified={s8.path, s10b.path}, rejected=rejected, keep_last=3)
    assert set(doomed) == {s10}
    # an unfinished folder older than the newest kept one is a leftover: it goes too
    (s6.path / "manifest.json").unlink()
    doomed = retention(step_folders(tmp_path), verified={s8.path, s10b.path}, rejected=rejected, keep_last=3)
    assert set(doomed) == {s10, s6}
    # step 12 rewritten too: the corrupt 12 is superseded and goes
    s12b = folder(12, 1)
    verified = {s8.path, s10b.path, s12b.path}
    doomed = retention(step_folders(tmp_path), verified=verified, rejected=rejected, keep_last=2)
    assert set(doomed) == {s12, s10, s8, s6, s4}


# ------------------------------------------------------------------------------------ async staging


def test_async_staging_copies_tensors_and_keeps_every_container_type():
    Pair = namedtuple("Pair", "a b")
    counts = defaultdict(int, {"x": 3})
    t = torch.arange(4.0)
    state = {"counts": counts, "pair": Pair(t, [t, {"k": t}]), "set": {1, 2}, "same": t}
    copy = snapshot(state)
    t.add_(100)  # training changes the original right after staging
    assert isinstance(copy["counts"], defaultdict) and copy["counts"]["y"] == 0
    assert isinstance(copy["pair"], Pair) and torch.equal(copy["pair"].a, torch.arange(4.0))
    assert copy["pair"].b[1]["k"] is copy["pair"].a is copy["same"]  # shared tensors stay shared
    assert copy["set"] == {1, 2}


# ------------------------------------------------------------------------------ flat-range shards (ZeRO)


def _flat_shard(t: torch.Tensor, lo: int, hi: int):
    import math

    from lightning_hybrid.checkpoint._flat_shards import FlatShard, flat_boxes, flat_index

    flat = t.reshape(-1)
    boxes = []
    for offsets, sizes in flat_boxes(t.shape, lo, hi):
        begin = flat_index(t.shape, offsets)
        boxes.append((tuple(offsets), flat[begin : begin + math.prod(sizes)].view(sizes)))
    return FlatShard(t.shape, t.dtype, boxes)


def test_flat_range_shards_save_under_the_full_shape_and_read_back_any_other_range(tmp_path):
    weights, moments = torch.randn(5, 7), torch.randn(5, 7)
    # one writer's boxes tile the flat range [0, 35) in two pieces, as two ZeRO ranks would
    state = {
        "state_dict": {"w": _flat_shard(weights, 0, 35)},
        "optimizer_0": {
            "state.w.exp_avg": _flat_shard(moments, 0, 13),
            "state.w.exp_avg_x": _flat_shard(moments, 13, 35),
        },
    }
    state["optimizer_0"]["state.w.exp_avg"].boxes += state["optimizer_0"].pop("state.w.exp_avg_x").boxes
    write_sharded(tmp_path, state, None)
    index = read_dcp_metadata(tmp_path).state_dict_metadata
    assert index["optimizer_0.state.w.exp_avg"].size == torch.Size([5, 7])  # the unsplit shape
    # a plain tensor (another layout) reads it whole; a flat shard of other boundaries reads only its range
    whole = {"state_dict": {"w": torch.zeros(5, 7)}, "optimizer_0": {"state.w.exp_avg": torch.zeros(5, 7)}}
    read_sharded(tmp_path, whole)
    assert torch.equal(whole["state_dict"]["w"], weights) and torch.equal(
        whole["optimizer_0"]["state.w.exp_avg"], moments
    )
    target = torch.zeros(5, 7)
    part = {"optimizer_0": {"state.w.exp_avg": _flat_shard(target, 9, 23)}}
    read_sharded(tmp_path, part)
    assert torch.equal(target.reshape(-1)[9:23], moments.reshape(-1)[9:23])
    assert not target.reshape(-1)[:9].any() and not target.reshape(-1)[23:].any()
    assert part["optimizer_0"]["state.w.exp_avg"].boxes  # the caller's value survives DCP's set-up


def test_a_sharded_write_makes_its_index_last(tmp_path):
    """meta.pt is written before DCP's .metadata: a folder with an index is whole, also without a manifest."""

    def no_space(path, write):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_sharded(tmp_path, {"state_dict": {"w": torch.ones(2)}}, {"epoch": 0}, write_file=no_space)
    assert not (tmp_path / ".metadata").exists()


def test_dcp_failures_are_raised_as_errors_an_except_exception_catches(tmp_path, monkeypatch):
    """DCP's CheckpointException is a BaseException: a failed read or write leaves the pack as a RuntimeError
    naming each rank's failure (a user's ``except Exception`` sees it), Ctrl-C wrapped by DCP as itself."""
    from torch.distributed.checkpoint import CheckpointException

    from lightning_hybrid.checkpoint import _sharded

    for folder in ("ok", "new"):
        (tmp_path / folder).mkdir()
    write_sharded(tmp_path / "ok", {"state_dict": {"w": torch.ones(2)}}, {"epoch": 0}, write_file=atomic_write)
    cases = ((OSError(5, "Input/output error"), RuntimeError), (KeyboardInterrupt(), KeyboardInterrupt))
    for wrapped, expected in cases:

        def failing(*args, wrapped=wrapped, **kwargs):
            raise CheckpointException("load", {0: (wrapped, None), 1: (ValueError("peer"), None)})

        monkeypatch.setattr(_sharded.dcp, "load", failing)
        monkeypatch.setattr(_sharded.dcp, "save", failing)
        for act in (
            lambda: read_sharded(tmp_path / "ok", {"state_dict": {"w": torch.zeros(2)}}),
            lambda: write_sharded(tmp_path / "new", {"state_dict": {"w": torch.ones(2)}}, None, write_file=None),
        ):
            with pytest.raises(expected) as caught:
                act()
            if expected is RuntimeError:
                assert "rank 0: OSError: [Errno 5] Input/output error; rank 1: ValueError: peer" in str(caught.value)
