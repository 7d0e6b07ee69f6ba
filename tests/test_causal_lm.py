"""``lightning_hybrid.models.CausalLM`` against ``transformers`` itself trained in one plain process.

The reference is the Hugging Face model built by ``AutoModelForCausalLM.from_config`` under the same seed,
trained with AdamW on the same global batches by ``model(**batch).loss`` (the mean over the global batch's
counted tokens): padded rows (right and left), ``-100`` labels. Each layout's per-step losses must match
the reference's within 1e-5, and its checkpoint, exported with ``export_pretrained`` and loaded by
``from_pretrained``, the reference's weights within 1e-4.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import launch

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from workers.causal_lm import PaddedRows
from workers.common import GlobalBatchSampler

from lightning_hybrid.models import CausalLM
from lightning_hybrid.utilities.export_pretrained import export_pretrained

SMALL = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
}  # fmt: skip
FAMILIES = {
    "llama": SMALL,
    "gemma": {**SMALL, "head_dim": 8},  # its embedding scales by sqrt(hidden) (a buffer outside the state_dict)
    "phi3": {**SMALL, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2_moe": {
        **SMALL,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
    },
    "qwen2": SMALL,
    # input and output embeddings tied (Qwen2-0.5B, Llama 3.2 1B): under tensor parallelism the embedding is split
    # by vocabulary as the head is, one slice of the one parameter on each rank
    "llama+tied": {**SMALL, "tie_word_embeddings": True},
    # one dense decoder layer among sparse ones: the model's own plan splits its MLP, and not the experts' (the
    # first: with the second, rounding alone, a row-wise layer's sum in two halves, moves AdamW's weights 3e-4)
    "qwen2_moe+mixed": {
        **SMALL,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "mlp_only_layers": [0],
    },
    "qwen2+tied": {**SMALL, "tie_word_embeddings": True},
    "mistral": {**SMALL, "sliding_window": 4},
    "mixtral": {**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt2": {
        "vocab_size": 64,
        "n_embd": 32,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },  # fmt: skip  (tied input and output embeddings)
}
STEPS, GLOBAL_BATCH, LR = 4, 8, 0.01


def hf_config(family: str, attn: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type(family), **FAMILIES[family])
    config._attn_implementation = attn
    return config


def model_type(family: str) -> str:
    """transformers' model type of a ``FAMILIES`` key (``llama+tied`` is a Llama)."""
    return family.split("+")[0]


def reference(family: str, attn: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers alone: losses of each step and the final weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family, attn))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    rows = PaddedRows()
    losses = []
    for ids in list(GlobalBatchSampler(len(rows), GLOBAL_BATCH, 0, 1))[:steps]:
        batch = {k: torch.stack([rows[i][k] for i in ids]) for k in ("input_ids", "attention_mask", "labels")}
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_model(family: str, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(family, attn))


def _cfg(tmp: Path, family: str, attn: str, strategy: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "family": model_type(family), "config": FAMILIES[family], "attn": attn, "strategy": strategy, "steps": STEPS,
        "lr": LR, "global_batch": GLOBAL_BATCH, "out": str(tmp / "out"), "save": str(tmp / "ckpt"), **extra,
    }  # fmt: skip


def _hybrid(**kwargs: Any) -> dict[str, Any]:
    return {"name": "hybrid_class", "kwargs": kwargs}


def _exported(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    export_pretrained(checkpoint, out)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.state_dict()


def _check(result, ref: tuple[list[float], dict[str, torch.Tensor]], checkpoint: Path, out: Path, nproc: int) -> None:
    ref_losses, ref_weights = ref
    for r in range(nproc):
        losses = result.rank(r)["losses"]
        assert len(losses) == len(ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (r, losses, ref_losses)
    weights = _exported(checkpoint, out)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in weights)
    assert worst < 1e-4, worst


# Every default-tier case starts from a save_pretrained folder of the reference's initial weights (meta-built,
# GPT-2's tied embeddings on the host), read by the strategy; the slow Mixtral case builds from the config.
SLICED_READS = {
    "llama-pp2-1f1b-4mb-eager", "qwen2-dp2-zero3-sdpa", "mistral-interleaved-4-stages", "llama-tp2-eager",
    "llama-tied-tp2-eager",
}  # fmt: skip
CASES = {
    "llama-pp2-1f1b-4mb-eager": ("llama", "eager", _hybrid(pipeline_parallel_size=2, num_microbatches=4), 2),
    "qwen2-dp2-zero3-sdpa": ("qwen2", "sdpa", _hybrid(zero_stage=3), 2),
    "gpt2-tied-pp2": ("gpt2", "sdpa", _hybrid(pipeline_parallel_size=2, num_microbatches=2), 2),
    "mistral-interleaved-4-stages": (
        "mistral",
        "sdpa",
        _hybrid(pipeline_parallel_size=2, schedule="interleaved_1f1b", num_microbatches=2),
        2,
    ),
    # tensor parallelism from the model's own base_model_tp_plan: GQA (4 query heads, 2 key/value heads) split
    # over 2 ranks keeps 2 query heads and 1 key/value head on each; the head's logits gathered
    "llama-tp2-eager": ("llama", "eager", _hybrid(tensor_parallel_size=2), 2),
    "llama-tied-tp2-eager": ("llama+tied", "eager", _hybrid(tensor_parallel_size=2), 2),
    "llama-deepspeed-pp2": (
        "llama",
        "eager",
        {"name": "deepspeed_class", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2}},
        2,
    ),
}
SLOW_CASES = {
    # both families at every tensor-parallel layout: tp2, pp2 x tp2 and dp2 x tp2 at ZeRO-1/2/3
    "qwen2-tp2-sdpa": ("qwen2", "sdpa", _hybrid(tensor_parallel_size=2), 2),
    "qwen2-pp2-tp2-sdpa": ("qwen2", "sdpa", _hybrid(pipeline_parallel_size=2, tensor_parallel_size=2), 4),
    # the tied embedding and head on different stages, each split by vocabulary
    "qwen2-tied-pp2-tp2-sdpa": (
        "qwen2+tied",
        "sdpa",
        _hybrid(pipeline_parallel_size=2, tensor_parallel_size=2),
        4,
    ),
    "llama-pp2-tp2-eager": ("llama", "eager", _hybrid(pipeline_parallel_size=2, tensor_parallel_size=2), 4),
    **{
        f"{family}-dp2-tp2-zero{stage}-{attention}": (
            family,
            attention,
            _hybrid(data_parallel_size=2, tensor_parallel_size=2, zero_stage=stage),
            4,
        )
        for family, attention, stage in (
            ("llama", "sdpa", 1),
            ("llama", "eager", 2),
            ("qwen2", "sdpa", 2),
            ("qwen2", "sdpa", 3),
        )
    },
    "llama-dp2-tp2-zero3-sdpa": (
        "llama",
        "sdpa",
        _hybrid(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3),
        4,
    ),
    "qwen2-dp2-tp2-zero1-eager": (
        "qwen2",
        "eager",
        _hybrid(data_parallel_size=2, tensor_parallel_size=2, zero_stage=1),
        4,
    ),
    # the model's plan names mlp.gate_proj, which its sparse layers do not have: their experts stay whole, the
    # dense layer's MLP splits
    "qwen2_moe-mixed-tp2-eager": ("qwen2_moe+mixed", "eager", _hybrid(tensor_parallel_size=2), 2),
    "mixtral-pp2-dp2-zero1": ("mixtral", "eager", _hybrid(pipeline_parallel_size=2, zero_stage=1), 4),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [*CASES, *(pytest.param(case, marks=pytest.mark.slow) for case in SLOW_CASES)])
def test_causal_lm_trains_as_transformers_itself(tmp_path, case):
    family, attn, strategy, nproc = {**CASES, **SLOW_CASES}[case]
    extra = {}
    if case in CASES:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)  # the reference's initial weights
        AutoModelForCausalLM.from_config(hf_config(family, attn)).save_pretrained(tmp_path / "folder")
        extra["folder"] = str(tmp_path / "folder")
    cfg = _cfg(tmp_path, family, attn, strategy, **extra)
    result = launch("causal_lm.py", cfg, nproc=nproc, timeout=300)
    _check(result, reference(family, attn), Path(cfg["save"]), tmp_path / "exported", nproc)
    if "pipeline_parallel_size" in strategy.get("kwargs", {}) and strategy["name"] == "hybrid_class":
        # what Lightning's summary cannot show under a pipeline: each stage's blocks and the whole model's count
        n = sum(p.numel() for p in reference_model(family, attn).parameters())
        assert f"pipeline stages of CausalLM: {n / 1e3:.1f} K parameters" in result.output, result.output[-3000:]
        assert "  stage 1: blocks " in result.output
    tp = strategy.get("kwargs", {}).get("tensor_parallel_size", 1)
    if tp > 1:  # each tensor-parallel rank holds about 1/tp of its stage (norms and an untied embedding whole)
        n = sum(p.numel() for p in reference_model(family, attn).parameters())
        held = [result.rank(r)["held"] for r in range(nproc)]
        pp = strategy["kwargs"].get("pipeline_parallel_size", 1)
        # unsplit: 1.0, or the larger stage's 0.65; a sparse MoE layer's experts stay whole (the model's own plan)
        limit = 0.95 if family.startswith("qwen2_moe") else 0.7 if pp == 1 else 0.45
        assert max(held) < limit * n, (held, n)
        # every rank's split blocks (a decoder layer, the head, a tied embedding) ran whole on their first input:
        # the same outputs
        checked = [result.rank(r)["plan_checked"] for r in range(nproc)]
        tied = FAMILIES[family].get("tie_word_embeddings")
        # a stage: 2 at most at pp2; a dense and a sparse decoder layer are two kinds
        kinds = 3 if (tied or "mlp_only_layers" in FAMILIES[family]) and pp == 1 else 2
        assert all(checked) and any(len(c) == kinds for c in checked), checked
        if tied:  # the embedding's split block (the first) too, on its stage
            assert any("layers.0" in c for c in checked), checked
        if family.startswith("qwen2_moe"):  # what the model's plan passes over is said
            assert "kept whole on every tensor-parallel rank there, as transformers does" in result.output
    if case in SLICED_READS:  # each rank read its stages' tensors (pp2) or its rows (ZeRO-3): the file once
        from safetensors import safe_open

        with safe_open(str(tmp_path / "folder" / "model.safetensors"), "pt") as f:
            file_bytes = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
        read = [result.rank(r)["read"] for r in range(nproc)]
        assert all(0 < r < 0.8 * file_bytes for r in read), (read, file_bytes)
        assert abs(sum(read) - file_bytes) <= 0.1 * file_bytes, (read, file_bytes)


def test_every_family_gives_transformers_loss_and_initial_weights_in_one_process():
    """Bitwise: the cut model's loss equals ``model(**batch).loss`` on padded batches (both attention
    implementations), and ``CausalLM(config)`` starts from ``from_config``'s weights under the same seed."""
    from transformers import AutoModelForCausalLM

    rows = PaddedRows(n=8)
    batch = {"input_ids": rows.ids, "attention_mask": rows.mask, "labels": rows.labels}
    for family in FAMILIES:
        for attn in ("eager", "sdpa"):
            torch.manual_seed(1)
            hf = AutoModelForCausalLM.from_config(hf_config(family, attn)).eval()
            torch.manual_seed(1)
            ours = CausalLM(hf_config(family, attn)).eval()
            (ids, mask), target = ours.pipeline_batch(batch)
            assert torch.equal(ours.pipeline_loss(ours(ids, mask), target), hf(**batch).loss), (family, attn)
            names = ours.hf_state_dict_names()
            theirs = hf.state_dict()
            for name, value in ours.state_dict().items():
                assert torch.equal(value, theirs[names[name]]), (family, name)
            wrapped = CausalLM(copy.deepcopy(hf)).eval()
            assert torch.equal(wrapped.pipeline_loss(wrapped(ids, mask), target), hf(**batch).loss)


def test_families_not_checked_against_transformers_are_refused_with_what_to_do():
    """OPT has no pipeline plan; Gemma2 has one, but soft-caps its logits outside the layers: a cut would
    train another model, silently."""
    from transformers import AutoConfig

    small = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    for family, extra in (("opt", {"ffn_dim": 64, "word_embed_proj_dim": 32}), ("gemma2", {"head_dim": 8})):
        with pytest.raises(ValueError, match=rf"model_type='{family}'.*gemma, gpt2, llama.*pipeline contract"):
            CausalLM(AutoConfig.for_model(family, **small, **extra))


def test_batch_keys_it_would_ignore_are_refused():
    model = CausalLM(hf_config("llama", "sdpa"))
    rows = PaddedRows(n=2)
    batch = {"input_ids": rows.ids, "attention_mask": rows.mask, "position_ids": rows.mask.cumsum(-1)}
    with pytest.raises(ValueError, match=r"also has \['position_ids'\].*packed"):
        model.pipeline_batch(batch)


def test_a_causal_lm_pickles_and_reloads_its_own_checkpoint(tmp_path):
    import pickle

    model = CausalLM(hf_config("gpt2", "eager"), attn_implementation="eager")
    clone = pickle.loads(pickle.dumps(model))  # ddp_spawn and torch.save(model) pickle the module
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), clone.state_dict().values()))
    assert clone.hparams.attn_implementation == "eager"


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_pretrained_folder_round_trip_through_two_layouts_matches_transformers(tmp_path):
    """save_pretrained -> CausalLM(folder), meta-built, at pp2 x dp2 ZeRO-2 -> 2 steps -> resume at dp2 ZeRO-1
    -> 2 steps -> export_pretrained -> from_pretrained: each step's loss and the final weights as the reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("mistral", "sdpa")).save_pretrained(tmp_path / "folder")
    ref_losses, ref_weights = reference("mistral", "sdpa")
    first = _cfg(tmp_path / "a", "mistral", "sdpa", _hybrid(pipeline_parallel_size=2, zero_stage=2),
                 folder=str(tmp_path / "folder"), steps=2)  # fmt: skip
    result = launch("causal_lm.py", first, nproc=4, timeout=300)
    second = _cfg(tmp_path / "b", "mistral", "sdpa", _hybrid(zero_stage=1), folder=str(tmp_path / "folder"),
                  resume=first["save"], skip=2)  # fmt: skip
    resumed = launch("causal_lm.py", second, nproc=2, timeout=300)
    for r in range(4):
        assert max(abs(a - b) for a, b in zip(result.rank(r)["losses"], ref_losses[:2])) < 1e-5
    for r in range(2):
        assert max(abs(a - b) for a, b in zip(resumed.rank(r)["losses"], ref_losses[2:])) < 1e-5
    weights = _exported(Path(second["save"]), tmp_path / "exported")
    assert max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) < 1e-4


def _fit_one_process(model: CausalLM, steps: int) -> list[float]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    rows = PaddedRows()
    loader = DataLoader(rows, batch_sampler=GlobalBatchSampler(len(rows), GLOBAL_BATCH, 0, 1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    return losses


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma"])  # meta-built; tied (built on the host); a buffer
def test_a_folder_under_a_plain_lightning_strategy_loads_its_weights_and_trains_as_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config(family, "sdpa")).save_pretrained(tmp_path / "folder")
    torch.manual_seed(123)  # another seed: only the folder's weights can give the reference's losses
    model = CausalLM(tmp_path / "folder", attn_implementation="sdpa", lr=LR)
    assert model.pretrained_weights is not None  # read by name (and by slice under the pack's strategies)
    losses = _fit_one_process(model, 2)
    ref_losses, _ = reference(family, "sdpa", steps=2)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)


def test_a_folder_whose_weights_do_not_fit_its_config_is_refused_with_the_tensor_named(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config("llama", "sdpa")).save_pretrained(tmp_path / "folder")
    config = json.loads((tmp_path / "folder" / "config.json").read_text())
    config["intermediate_size"] = 48  # the MLP's weights in the file are 64 wide
    (tmp_path / "folder" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight"):
        _fit_one_process(CausalLM(tmp_path / "folder", lr=LR), 1)


@pytest.mark.multiproc
def test_a_model_with_fewer_blocks_than_stages_is_refused_on_every_rank(tmp_path):
    """One decoder layer is three blocks; an interleaved schedule on 2 ranks wants 4 stages."""
    strategy = _hybrid(pipeline_parallel_size=2, schedule="interleaved_1f1b", num_microbatches=2)
    cfg = {**_cfg(tmp_path, "llama", "sdpa", strategy), "config": {**SMALL, "num_hidden_layers": 1}}
    result = launch("causal_lm.py", cfg, nproc=2, timeout=120, expect_success=False)
    errors = [result.rank(r).get("error", "") for r in range(2)]
    assert errors[0] == errors[1] and "3" in errors[0] and "4" in errors[0] and "stage" in errors[0], errors


def test_a_moe_folder_stored_expert_by_expert_is_read_by_transformers_and_trains_as_it(tmp_path):
    """transformers 5 saves Mixtral's experts one by one and holds them fused: the folder is read by its own
    loader (on the host) instead of by name, and the run trains as transformers itself."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("mixtral", "eager")).save_pretrained(tmp_path / "folder")
    model = CausalLM(tmp_path / "folder", attn_implementation="eager", lr=LR)
    assert model.pretrained_weights is None and not any(p.is_meta for p in model.parameters())
    losses = _fit_one_process(model, 2)
    ref_losses, _ = reference("mixtral", "eager", steps=2)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)


@pytest.mark.unit
def test_the_models_own_tensor_parallel_plan_and_its_refusals():
    """Each block's plan comes from the config's base_model_tp_plan, inside the cut's names; sizes that do not
    split whole heads, and models without a plan, are refused with the values and what to do."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoConfig

    from lightning_hybrid.models._hf_tp import hf_tensor_parallel_plan

    llama = CausalLM(hf_config("llama", "sdpa"))
    blocks = list(llama.layers)
    decoder = hf_tensor_parallel_plan(llama.config, blocks[1], 2)
    assert {k: type(v) for k, v in decoder.items()} == {
        "layer.self_attn.q_proj": ColwiseParallel, "layer.self_attn.k_proj": ColwiseParallel,
        "layer.self_attn.v_proj": ColwiseParallel, "layer.self_attn.o_proj": RowwiseParallel,
        "layer.mlp.gate_proj": ColwiseParallel, "layer.mlp.up_proj": ColwiseParallel,
        "layer.mlp.down_proj": RowwiseParallel,
    }  # fmt: skip
    assert hf_tensor_parallel_plan(llama.config, blocks[0], 2) == {}  # an untied embedding stays whole
    assert list(hf_tensor_parallel_plan(llama.config, blocks[-1], 2)) == ["lm_head"]
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 must divide the llama config's num_key_value_heads \(2\)"
    ):
        hf_tensor_parallel_plan(llama.config, blocks[1], 4)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 must divide the llama config's num_attention_heads \(6\)"
    ):  # the query heads, checked first
        wide = CausalLM(AutoConfig.for_model("llama", **{**SMALL, "num_attention_heads": 6, "num_key_value_heads": 6,
                                                          "hidden_size": 48}))  # fmt: skip
        hf_tensor_parallel_plan(wide.config, list(wide.layers)[1], 4)
    tied = CausalLM(hf_config("llama+tied", "sdpa"))  # a tied embedding is split by vocabulary, as its head
    assert {k: type(v) for k, v in hf_tensor_parallel_plan(tied.config, tied.layers[0], 2).items()} == {
        "embed_tokens": RowwiseParallel
    }
    moe = CausalLM(hf_config("qwen2_moe", "sdpa"))  # its plan's mlp keys name no module of a sparse layer
    assert set(hf_tensor_parallel_plan(moe.config, moe.layers[1], 2)) == {f"layer.self_attn.{p}_proj" for p in "qkvo"}
    mixed = CausalLM(hf_config("qwen2_moe+mixed", "sdpa"))  # decoder layer 0 (block 1) dense, the others sparse
    passed_over: set[str] = set()
    assert len(hf_tensor_parallel_plan(mixed.config, mixed.layers[1], 2, passed_over)) == 7 and not passed_over
    assert len(hf_tensor_parallel_plan(mixed.config, mixed.layers[2], 2, passed_over)) == 4
    assert passed_over == {f"layer.mlp.{p}_proj" for p in ("gate", "up", "down")}
    moe.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "colwise"}  # no key fits the layer at all
    with pytest.raises(ValueError, match=r"base_model_tp_plan names none of this decoder layer's modules"):
        hf_tensor_parallel_plan(moe.config, moe.layers[1], 2)
    gpt2 = CausalLM(hf_config("gpt2", "sdpa"))
    with pytest.raises(ValueError, match="the gpt2 config has no base_model_tp_plan"):
        hf_tensor_parallel_plan(gpt2.config, list(gpt2.layers)[1], 2)
