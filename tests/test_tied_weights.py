"""Parameters tied across pipeline stages (an LM's output projection = its input embedding) stay one parameter:
exact against the single process under pp2 and pp2 x dp2 ZeRO-1, stored once, resumed in another layout."""

from __future__ import annotations

import pytest
import torch
from helpers import launch
from reference import reference_run

from lightning_hybrid.checkpoint._sharded import read_sharded_index
from lightning_hybrid.checkpoint.sources import _PackCheckpoint
from lightning_hybrid.checkpoint.tied_names import CheckpointNames
from lightning_hybrid.contract import Tie, find_ties
from lightning_hybrid.strategies._layout import resolve_layout
from lightning_hybrid.strategies.pipeline.tied import check_ties
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import UnitRule, planned_units

TOTAL, FIRST = 4, 2
GPT_TIE = ("layers.0.token.weight", "layers.3.head.weight")  # the example GPT's names of its tied embedding


def _strategy(**kwargs):
    return {"name": "hybrid_class", "kwargs": {"num_microbatches": 2, **kwargs}}


def _train_then_resume(tmp_path, base, first, then, *, tied, clip=None):
    """Train ``first`` = (nproc, strategy) for FIRST steps, resume in ``then`` to TOTAL; both against one process.
    Every stage's copy of the ``tied`` parameter (its names) must end equal to the reference."""
    trainer = {"gradient_clip_val": clip} if clip else {}
    ref_losses, ref_weights = reference_run(base, steps=TOTAL, clip=clip)
    if clip:  # the clipping engages (else the norm of a tied gradient would never be tested)
        unclipped = reference_run(base, steps=TOTAL)[1]
        assert max((unclipped[k] - ref_weights[k]).abs().max() for k in ref_weights) > 1e-3
    saved = tmp_path / "first"
    runs = [
        (first, {"steps": FIRST, "save": str(saved)}, ref_losses[:FIRST]),
        (then, {"steps": TOTAL, "resume": str(saved), "data": {**base["data"], "skip": FIRST}}, ref_losses[FIRST:]),
    ]  # fmt: skip
    for i, ((nproc, strategy), extra, expected) in enumerate(runs):
        out = tmp_path / f"run{i}"
        out.mkdir()
        cfg = {**base, "devices": nproc, "strategy": strategy, "trainer": trainer, "save": str(out / "ckpt"),
               "weights": str(out / "w.pt"), "report_params": list(tied), **extra}  # fmt: skip
        if i == 0:
            cfg["save"] = str(saved)
        job = launch("train_gpt.py", cfg, nproc=nproc)
        for r in range(nproc):  # pipelined: the step's mean loss, identical on every rank
            assert job.rank(r)["losses"] == job.rank(0)["losses"]
        torch.testing.assert_close(torch.tensor(job.rank(0)["losses"]), torch.tensor(expected), rtol=0, atol=1e-5)
    # each holder's own copy (the checkpoint and the consolidated weights hold the first stage's only)
    copies = [torch.tensor(v) for r in range(nproc) for v in job.rank(r)["params"].values()]
    assert len(copies) == nproc  # every rank holds one name of the tie: pp2, a stage each
    for copy in copies:
        torch.testing.assert_close(copy, ref_weights[tied[0]], rtol=0, atol=1e-4)
        torch.testing.assert_close(copy, copies[0], rtol=0, atol=1e-6)
    weights = torch.load(tmp_path / "run1" / "w.pt")
    assert weights.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=0, atol=1e-4, msg=f"{key} differs")
    return saved, weights, ref_weights


def _stored_once(saved, first, alias):
    keys = read_sharded_index(saved).state_dict_metadata
    assert f"state_dict.{first}" in keys and f"state_dict.{alias}" not in keys
    assert not [k for k in keys if f".{alias}." in k], "the copy's optimizer state was stored too"


@pytest.mark.multiproc
def test_example_gpt_tied_embeddings_exact_with_clipping_and_resumed_in_another_layout(tmp_path):
    """SGD with clipping by the global norm (which must count the tied gradient once): pp2 for two steps, then
    resumed under pp2 x dp2 ZeRO-1 for two more, equal to one process."""
    base = {"model": {"optimizer": "sgd", "lr": 0.5, "n_layer": 2, "tie_embeddings": True}, "data": {"global_batch": 8}}
    saved, weights, ref = _train_then_resume(
        tmp_path,
        base,
        (2, _strategy(pipeline_parallel_size=2)),
        (4, _strategy(pipeline_parallel_size=2, data_parallel_size=2, zero_stage=1)),
        tied=GPT_TIE,
        clip=0.5,
    )
    first, alias = GPT_TIE
    _stored_once(saved, first, alias)
    assert weights[alias] is weights[first], "the consolidated state has both names for one tensor"
    assert (ref[first] - reference_run(base, steps=0)[1][first]).abs().max() > 1e-3  # the tied weight moved
    # init_from reads the stored tensor under every name (an untied model starts with equal copies)
    pack = _PackCheckpoint(saved)
    assert pack.index()[alias] == pack.index()[first]
    torch.testing.assert_close(pack.read(alias, (3, 7)), pack.read(first, None)[3:7], rtol=0, atol=0)
    # resuming the tied checkpoint into a model that does not tie: a clear error on every rank, not a random head
    untied = {**base, "model": {**base["model"], "tie_embeddings": False}}
    job = launch(
        "train_gpt.py",
        {**untied, "devices": 2, "steps": TOTAL, "resume": str(saved), "strategy": _strategy(pipeline_parallel_size=2)},
        nproc=2,
        expect_success=False,
    )
    assert job.output.count(f"{alias} was tied to {first} when") >= 2, job.output[-3000:]


@pytest.mark.multiproc
def test_hugging_face_gpt2_tied_embeddings_with_lamb_exact_and_resumed_in_another_layout(tmp_path):
    """GPT2LMHeadModel as Hugging Face builds it (tie_word_embeddings): LAMB (its per-tensor trust ratio over
    ZeRO-1 shards of both copies) under pp2 x dp2 ZeRO-1, resumed with its moments under pp2 ZeRO-0."""
    base = {"model_class": "hf_gpt2_tied", "model": {"n_layer": 2, "lr": 0.02, "optimizer": "lamb"},
            "data": {"global_batch": 8}}  # fmt: skip
    saved, _, _ = _train_then_resume(
        tmp_path,
        base,
        (4, _strategy(pipeline_parallel_size=2, data_parallel_size=2, zero_stage=1)),
        (2, _strategy(pipeline_parallel_size=2)),
        tied=("layers.0.wte.weight", "layers.3.lm_head.weight"),
    )
    _stored_once(saved, "layers.0.wte.weight", "layers.3.lm_head.weight")
    stored = read_sharded_index(saved).state_dict_metadata
    assert any(k.endswith("state.layers.0.wte.weight.exp_avg") for k in stored), "LAMB's moments of the tie"


@pytest.mark.multiproc
def test_tied_embeddings_exact_under_zero2_once_per_step_then_zero3(tmp_path):
    """The other two ZeRO stages the README calls exact with a tie across stages: pp2 ZeRO-2 (once_per_step)
    for two steps, resumed under pp2 ZeRO-3 (each stage's copy its own FSDP2 unit), with clipping."""
    base = {"model": {"optimizer": "adamw", "lr": 0.01, "n_layer": 2, "tie_embeddings": True},
            "data": {"global_batch": 8}}  # fmt: skip
    _train_then_resume(
        tmp_path,
        base,
        (2, _strategy(pipeline_parallel_size=2, zero_stage=2, zero={"reduce_gradients": "once_per_step"})),
        (2, _strategy(pipeline_parallel_size=2, zero_stage=3)),
        tied=GPT_TIE,
        clip=0.5,
    )


def _layout(pp, zero_stage, dp=1, schedule="1f1b"):
    return resolve_layout(
        world_size=pp * dp, num_nodes=1, pipeline_parallel_size=pp, data_parallel_size=dp, zero_stage=zero_stage,
        schedule=schedule, stages_per_rank=None, num_microbatches=None,
    )  # fmt: skip


def test_ties_are_found_and_what_cannot_be_exact_is_refused():
    from gpt import GPT

    model = GPT(vocab_size=16, block_size=8, n_layer=2, d_model=8, n_head=2, tie_embeddings=True)
    (tie,) = find_ties(model)
    assert tie.names == ("layers.0.token.weight", "layers.3.head.weight") and tie.blocks == (0, 3)
    assert find_ties(GPT(vocab_size=16, block_size=8, n_layer=2, d_model=8, n_head=2)) == []
    two_stages = [range(0, 2), range(2, 4)]
    once = ZeroConfig(reduce_gradients="once_per_step")

    def plan(zero: ZeroConfig, pipelined: bool) -> list[str]:
        return planned_units(model, UnitRule(zero.shard_units, zero.bucket_size_mb), pipelined=pipelined)

    for layout, zero in [(_layout(2, 0), ZeroConfig()), (_layout(2, 1), ZeroConfig()), (_layout(2, 2), once),
                         (_layout(2, 3), ZeroConfig())]:  # fmt: skip
        check_ties([tie], two_stages, layout, zero, plan(zero, True))
    with pytest.raises(ValueError, match=r"every_microbatch.*once_per_step"):
        check_ties([tie], two_stages, _layout(2, 2), ZeroConfig(), None)
    # ZeRO-3 with both names on one rank: two FSDP2 units would each shard (and untie) it
    for zero in [ZeroConfig(shard_units="submodules"), ZeroConfig(bucket_size_mb=1e-4)]:  # blocks of < 1 KB over 105 B
        with pytest.raises(ValueError, match=r"2 FSDP2 units of one rank \(layers.0.token, layers.3.head\)"):
            check_ties([tie], None, _layout(1, 3), zero, plan(zero, False))
    for zero in [ZeroConfig(shard_units="blocks"), ZeroConfig()]:  # under 25 MB: one unit each
        with pytest.raises(ValueError, match=r"2 FSDP2 units of one rank \(layers.0, layers.3\)"):
            check_ties([tie], None, _layout(1, 3), zero, plan(zero, False))
    # a pipeline cannot keep a name outside `self.layers` equal to the stages' copies
    outside = Tie(("embed.weight", *tie.names), (None, *tie.blocks))
    with pytest.raises(ValueError, match=r"embed.weight is outside `self.layers`"):
        check_ties([outside], two_stages, _layout(2, 0), ZeroConfig(), None)
    # a V schedule puts stages 0 and 3 on rank 0: the tie is local there (one tensor, autograd sums)
    v = _layout(2, 0, schedule="zbv_zero_bubble")
    check_ties([tie], [range(0, 1), range(1, 2), range(2, 3), range(3, 4)], v, ZeroConfig(), None)


def test_checkpoint_names_store_a_tied_parameter_once_and_read_it_back_under_any_name():
    names = CheckpointNames.from_json([["layers.0.token.weight", "layers.3.head.weight"]])
    state = {"layers.3.head.weight": 1, "layers.3.ln_f.weight": 2, "state.layers.3.head.weight.exp_avg": 3,
             "param_groups.layers.3.head.weight.lr": 4}  # fmt: skip
    assert names.to_store(state) == {"layers.3.ln_f.weight": 2}  # the last stage stores none of the copy
    read, back = names.to_read(state)
    assert read == {"layers.0.token.weight": 1, "layers.3.ln_f.weight": 2,
                    "state.layers.0.token.weight.exp_avg": 3, "param_groups.layers.0.token.weight.lr": 4}  # fmt: skip
    assert back["state.layers.0.token.weight.exp_avg"] == "state.layers.3.head.weight.exp_avg"
    # one rank holding both names: the tensor is read once, under its first name
    both = {"layers.0.token.weight": 1, "layers.3.head.weight": 1}
    assert names.to_read(both)[0] == {"layers.0.token.weight": 1}
    assert names.to_json() == [["layers.0.token.weight", "layers.3.head.weight"]]


def test_group_settings_compare_values_not_names_or_devices():
    from lightning_hybrid.strategies.pipeline.tied import _settings

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    # torch >= 2.6 records each stage's own parameter names in its groups: they must not tell the copies apart
    first = torch.optim.AdamW([("layers.0.token.weight", a.weight)], lr=torch.tensor(1e-3))
    last = torch.optim.AdamW([("layers.3.head.weight", b.weight)], lr=torch.tensor(1e-3))
    assert "param_names" in first.param_groups[0]
    assert _settings(first.param_groups[0]) == _settings(last.param_groups[0])
    other = torch.optim.AdamW([("layers.3.head.weight", b.weight)], lr=torch.tensor(1.0001e-3))
    assert _settings(first.param_groups[0]) != _settings(other.param_groups[0])
