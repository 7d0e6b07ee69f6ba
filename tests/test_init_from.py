"""``HybridParallelStrategy(init_from=...)``: pretrained weights from every kind of source, read by the ranks
that own them, renamed by a key map; bad keys fail on every rank with their names."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import launch
from safetensors.torch import save_file
from workers.common import ExactDataModule, build_model, global_batches

from lightning_hybrid.checkpoint.pretrained import open_weights, plan_pretrained
from lightning_hybrid.strategies import PretrainedWeights
from lightning_hybrid.utilities import consolidate_checkpoint

MODEL = {"vocab_size": 64, "n_layer": 4, "d_model": 32, "n_head": 2, "block_size": 16}


def _pretrained() -> dict[str, torch.Tensor]:
    """Weights no initialisation would produce: whatever a layout loads must be exactly these."""
    model = build_model({"seed": 123, "model": MODEL})
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in model.state_dict().items()}


def _first_batch_loss(model: torch.nn.Module) -> float:
    data = ExactDataModule(block_size=16)
    x, y = next(iter(global_batches(data.train_set, data.global_batch, data.seed)))
    with torch.no_grad():
        return float(model.pipeline_loss(model(x), y))


def _write_index_folder(folder, weights: dict[str, torch.Tensor]) -> None:
    """Two safetensors shards and the Hugging Face index naming them."""
    folder.mkdir()
    keys = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for name, part in halves.items():
        save_file({k: weights[k].contiguous() for k in part}, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -------------------------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_key_map_renames_by_longest_prefix_and_feeds_tied_names():
    weights = PretrainedWeights(
        "x",
        key_map={"transformer.h.1.": "layers.2.", "transformer.h.": "blocks.", "wte.": ["emb.", "head."]},
    )
    assert weights.targets("transformer.h.1.mlp.weight") == ["layers.2.mlp.weight"]
    assert weights.targets("transformer.h.10.mlp.weight") == ["blocks.10.mlp.weight"]
    assert weights.targets("wte.weight") == ["emb.weight", "head.weight"]
    assert weights.targets("other") == ["other"]
    by_call = PretrainedWeights("x", key_map=lambda k: None if k.endswith("bias") else "m." + k)
    assert by_call.targets("a.bias") == [] and by_call.targets("a.weight") == ["m.a.weight"]
    for bad in ({"a.": 3}, {"a.": []}, "prefix"):
        with pytest.raises(ValueError, match="key_map"):
            PretrainedWeights("x", key_map=bad)


@pytest.mark.unit
def test_plan_names_every_missing_unexpected_and_misshapen_key(tmp_path):
    save_file(
        {"a.w": torch.zeros(2, 3), "b.w": torch.zeros(4), "extra.w": torch.zeros(1)}, str(tmp_path / "w.safetensors")
    )
    source = open_weights(tmp_path / "w.safetensors")
    expected = {"a.w": (2, 3), "b.w": (5,), "c.w": (1,)}
    with pytest.raises(ValueError) as info:
        plan_pretrained(PretrainedWeights(tmp_path / "w.safetensors"), source, expected)
    message = str(info.value)
    assert "missing" in message and "c.w" in message
    assert "unexpected" in message and "extra.w" in message
    assert "wrong shape" in message and "b.w [4] -> b.w [5]" in message
    # what is mapped away or ignored is not unexpected; the plan names its sources
    save_file(
        {"a.w": torch.zeros(2, 3), "old.w": torch.zeros(5), "extra.w": torch.zeros(1)}, str(tmp_path / "v.safetensors")
    )
    weights = PretrainedWeights(tmp_path / "v.safetensors", key_map={"old.": ["b.", "c."]}, ignore=["extra.*"])
    plan = plan_pretrained(weights, open_weights(weights.path), {"a.w": (2, 3), "b.w": (5,), "c.w": (5,)})
    assert plan.source_of == {"a.w": "a.w", "b.w": "old.w", "c.w": "old.w"}


@pytest.mark.unit
def test_plan_refuses_values_of_the_wrong_kind_and_ties_fed_two_different_values(tmp_path):
    """Integers, booleans and float8 (which needs its scales) never load silently into float parameters; a tied
    parameter whose names two keys feed takes one value or is refused (it would depend on the layout which key
    wins)."""
    tensors = {
        "w": torch.zeros(3, dtype=torch.int64),
        "b": torch.ones(3, dtype=torch.bool),
        "s": torch.zeros(3).to(torch.float8_e4m3fn),
        "h": torch.ones(3, dtype=torch.bfloat16),
        "steps": torch.zeros((), dtype=torch.int32),
        "embed": torch.ones(4, 2),
        "head": torch.full((4, 2), 2.0),
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    weights = PretrainedWeights(tmp_path / "w.safetensors")
    source = open_weights(weights.path)
    expected = {k: tuple(v.shape) for k, v in tensors.items()}
    dtypes = {k: torch.float32 for k in tensors} | {"steps": torch.int64}
    with pytest.raises(ValueError) as info:
        plan_pretrained(weights, source, expected, dtypes=dtypes, ties=[["embed", "head"]])
    message = str(info.value)
    assert "wrong dtype" in message and all(f"{k} torch." in message for k in ("w", "b", "s"))
    assert "h torch." not in message and "steps torch." not in message  # bf16 -> fp32 and int32 -> int64 fit
    assert "tied" in message and "embed <- embed / head <- head" in message
    # the same values under both names (a checkpoint that stores a tied tensor twice) are fine
    tensors["head"] = torch.ones(4, 2)
    for k in ("w", "b", "s"):
        tensors[k] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "v.safetensors"))
    plan_pretrained(PretrainedWeights(tmp_path / "v.safetensors"), open_weights(tmp_path / "v.safetensors"),
                    expected, dtypes=dtypes, ties=[["embed", "head"]])  # fmt: skip


@pytest.mark.unit
def test_every_source_reads_rows_without_the_rest(tmp_path):
    weights = {"a": torch.arange(24.0).reshape(6, 4), "b": torch.arange(3.0)}
    torch.save(weights, tmp_path / "w.pt")
    save_file(weights, str(tmp_path / "w.safetensors"))
    _write_index_folder(tmp_path / "index", weights)
    for path in (tmp_path / "w.pt", tmp_path / "w.safetensors", tmp_path / "index"):
        source = open_weights(path)
        assert source.index() == {"a": ((6, 4), torch.float32), "b": ((3,), torch.float32)}, path
        torch.testing.assert_close(source.read("a", (2, 5)), weights["a"][2:5], rtol=0, atol=0)
        # a box: a tensor-parallel slice of columns (of ZeRO-3's rows of it)
        torch.testing.assert_close(source.read("a", ((1, 4), (2, 4))), weights["a"][1:4, 2:4], rtol=0, atol=0)
        torch.testing.assert_close(source.read("b", None), weights["b"], rtol=0, atol=0)


@pytest.mark.unit
def test_hostile_or_unusable_sources_are_refused_with_the_reason(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../secret.safetensors"}}))
    with pytest.raises(ValueError, match=r"expected a \.safetensors file in the folder"):
        open_weights(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="not there"):
        open_weights(folder)
    with pytest.raises(ValueError, match="does not exist"):
        open_weights(tmp_path / "nowhere")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state_dict"):
        open_weights(tmp_path / "list.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no weights"):
        open_weights(tmp_path / "empty")


# ------------------------------------------------------------------------------------- multi-process


@pytest.mark.multiproc
def test_init_from_every_source_under_pp2_dp2_zero3(tmp_path):
    """A .pt file, a .safetensors file, a sharded index folder and a checkpoint of this pack: each rank reads
    its own stage's rows, and the job starts from exactly those weights."""
    weights = _pretrained()
    torch.save(weights, tmp_path / "w.pt")
    save_file(weights, str(tmp_path / "w.safetensors"))
    _write_index_folder(tmp_path / "index", weights)
    sources = [tmp_path / "w.pt", tmp_path / "w.safetensors", tmp_path / "index", tmp_path / "saved-0"]
    runs = [{"init_from": {"path": str(p)}, "save": str(tmp_path / f"saved-{i}")} for i, p in enumerate(sources)]
    cfg = {
        "strategy": {"pipeline_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3, "num_microbatches": 2},
        "model": MODEL,
        "devices": 4,
        "runs": runs,
    }
    job = launch("init_from.py", cfg, nproc=4, timeout=300)
    reference = build_model({"model": MODEL})
    reference.load_state_dict(weights)
    expected_loss = _first_batch_loss(reference)
    for i, run in enumerate(runs):
        loaded = consolidate_checkpoint(run["save"])
        assert loaded.keys() == weights.keys()
        for name, value in weights.items():
            assert torch.equal(loaded[name], value), f"{sources[i].name}: {name} is not the pretrained value"
        for r in range(4):
            assert job.rank(r)["runs"][i]["losses"][0] == pytest.approx(expected_loss, abs=1e-5), sources[i].name
    # each rank read only its own stage's rows: together the four ranks read every byte exactly once
    total = sum(v.numel() * v.element_size() for v in weights.values())
    for i in range(len(runs)):
        read = [job.rank(r)["runs"][i]["bytes_read"] for r in range(4)]
        assert sum(read) == total and max(read) < 0.4 * total, (sources[i].name, read, total)


@pytest.mark.multiproc
def test_hugging_face_gpt2_loads_through_a_prefix_map_and_wrong_keys_fail_on_every_rank(tmp_path):
    import transformers  # the test extra installs it: a missing one fails here, it is never skipped
    from workers.hf_gpt2 import gpt2_config, gpt2_key_map

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(gpt2_config(n_layer=2)).eval()
    hf.save_pretrained(tmp_path / "gpt2")  # model.safetensors: the tied lm_head is not stored
    data = ExactDataModule(block_size=16)
    x, y = next(iter(global_batches(data.train_set, data.global_batch, data.seed)))
    with torch.no_grad():
        hf_loss = float(F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()))

    good = {"path": str(tmp_path / "gpt2"), "key_map": gpt2_key_map(2)}
    cfg = {
        "hf": True,
        "model": {"n_layer": 2},
        "strategy": {"pipeline_parallel_size": 2, "num_microbatches": 2},
        "devices": 2,
        "runs": [{"init_from": good, "save": str(tmp_path / "saved")}],
    }
    job = launch("init_from.py", cfg, nproc=2, timeout=240)
    for r in range(2):
        assert job.rank(r)["runs"][0]["losses"][0] == pytest.approx(hf_loss, abs=1e-5)
    loaded = consolidate_checkpoint(tmp_path / "saved")
    torch.testing.assert_close(loaded["layers.3.lm_head.weight"], hf.transformer.wte.weight, rtol=0, atol=0)

    # a map that forgets the final norm and misnames a block: every rank fails, naming the keys
    bad_map = {k: v for k, v in gpt2_key_map(2).items() if k != "transformer.ln_f."}
    bad_map["transformer.h.1."] = "layers.9."
    bad = {**cfg, "out": str(tmp_path / "bad"), "runs": [{"init_from": {**good, "key_map": bad_map}, "save": "-"}]}
    failed = launch("init_from.py", bad, nproc=2, timeout=120, expect_success=False)
    assert failed.returncode != 0
    for r in range(2):
        error = failed.rank(r)["error"]
        assert "layers.3.ln_f.weight" in error and "missing" in error, error
        assert "layers.2.* (12 keys)" in error, error  # a whole block: summarised
        assert "transformer.h.1.* -> layers.9.* (12 keys)" in error, error


def _held_whole_by_each_tensor_parallel_rank(name: str) -> bool:
    """The example GPT's plan keeps these whole on every tensor-parallel rank: norms, positions, and the
    biases of row-wise layers (added after the reduction)."""
    return ".ln_" in name or "position" in name or name.endswith(("proj.bias", "mlp.2.bias"))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [
        ({"tensor_parallel_size": 2}, 2),
        pytest.param({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, 4, marks=pytest.mark.slow),
    ],
    ids=["tp2", "dp2-tp2-zero3"],
)
def test_init_from_under_tensor_parallelism_reads_each_slice_once(tmp_path, strategy, nproc):
    """Each tensor-parallel rank reads only its slice of each split tensor (rows of a column-wise layer,
    columns of a row-wise one; under ZeRO-3 only its rows of that slice): a split tensor's bytes are read once
    over the job, a tensor every tensor-parallel rank holds whole once per tensor-parallel rank."""
    weights = _pretrained()
    save_file(weights, str(tmp_path / "w.safetensors"))
    torch.save(weights, tmp_path / "w.pt")
    sources = [tmp_path / "w.safetensors", tmp_path / "w.pt", tmp_path / "saved-0"]
    runs = [{"init_from": {"path": str(p)}, "save": str(tmp_path / f"saved-{i}")} for i, p in enumerate(sources)]
    cfg = {"strategy": strategy, "model": MODEL, "devices": nproc, "runs": runs}
    job = launch("init_from.py", cfg, nproc=nproc, timeout=300)
    reference = build_model({"model": MODEL})
    reference.load_state_dict(weights)
    expected_loss = _first_batch_loss(reference)
    tp = strategy["tensor_parallel_size"]
    size = {k: v.numel() * v.element_size() for k, v in weights.items()}
    expected = sum(n * (tp if _held_whole_by_each_tensor_parallel_rank(k) else 1) for k, n in size.items())
    for i, run in enumerate(runs):
        loaded = consolidate_checkpoint(run["save"])
        for name, value in weights.items():
            assert torch.equal(loaded[name], value), f"{sources[i].name}: {name} is not the pretrained value"
        # without a pipeline each rank reports its replica's loss, as under DDP: their mean is the batch's
        mean = sum(job.rank(r)["runs"][i]["losses"][0] for r in range(nproc)) / nproc
        assert mean == pytest.approx(expected_loss, abs=1e-5), sources[i].name
        read = [job.rank(r)["runs"][i]["bytes_read"] for r in range(nproc)]
        assert sum(read) == expected, (sources[i].name, read, expected, sum(size.values()))
        assert max(read) < 0.6 * sum(size.values()) / (nproc // tp), (sources[i].name, read)
