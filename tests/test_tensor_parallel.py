"""Tensor parallelism as the third axis (pp x dp x tp): every layout reproduces a single-process run."""

from __future__ import annotations

import pytest
import torch
from helpers import launch
from reference import reference_run
from test_hybrid_exactness import BASE, _run_layout
from workers.common import build_model

# clipping that binds (the global norm is about 1-3 at these steps) but does not shrink the steps so far that a
# wrong gradient would hide under the weights' tolerance
CLIP = {"trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}, "accumulate": 2, "clip": 0.5}


# the tp2 case in the default run, the pp2 x tp2 one (4 processes) in the slow tier
TP2_AND_PP2_TP2 = [
    ({"tensor_parallel_size": 2}, 2),
    pytest.param({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, marks=pytest.mark.slow),
]


def _and_dp2_tp2(zero_stage: int):
    """tp2, pp2 x tp2 and dp2 x tp2 at ``zero_stage`` (the four-process ones in the slow tier)."""
    dp2 = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": zero_stage}
    return pytest.mark.parametrize(
        ("kwargs", "nproc"),
        [*TP2_AND_PP2_TP2, pytest.param(dp2, 4, marks=pytest.mark.slow)],
        ids=["tp2", "pp2-tp2", f"dp2-tp2-zero{zero_stage}"],
    )


def _whole_numel(model=None) -> int:
    base = {**BASE, "model": {**BASE["model"], **(model or {})}}
    return sum(p.numel() for p in build_model(base).parameters())  # a tied parameter counts once


def _check_split(job, nproc: int, *, model=None, pp: int = 1) -> None:
    """Each tensor-parallel rank stores about 1/tp of its stage (norms, biases of row-wise layers and the
    position embedding stay whole)."""
    tp = job.rank(0)["layout"]["tp"]
    held = [job.rank(r)["held_numel"] for r in range(nproc)]
    whole = _whole_numel(model)
    replica = sum(held) / (nproc // (tp * pp))  # what one replica's ranks hold between them
    assert whole <= replica < whole * 1.1, (held, whole)  # all of it, little of it twice
    assert max(held) < whole / tp * (0.7 if pp > 1 else 1.1), (held, whole)  # a stage: at most 70% of a model


@pytest.mark.multiproc
def test_tp2_with_accumulation_and_clipping_matches_single_process(tmp_path):
    # each rank seeds its own initialisation: the split weights are rank 0's (torch scatters them), and what
    # every tensor-parallel rank holds whole (positions, norms) is made rank 0's by the strategy
    # the loss reads a split weight and a whole one as attributes outside their modules (a weight penalty):
    # a split weight read anywhere is the whole tensor's DTensor, never this rank's slice taken for the whole
    tp2 = {"tensor_parallel_size": 2}
    read = ["layers.1.attn.q.weight", "layers.1.attn.proj.weight", "layers.1.ln_1.weight"]
    # flags set on parameters before set-up (a no-decay mark) survive the plan's new parameters
    flags = {"layers.1.attn.q.weight": "split", "layers.2.attn.proj.bias": "whole-in-split-module"}
    job = _run_layout(
        tmp_path, tp2, nproc=2, trainer=CLIP["trainer"], accumulate=2, clip=0.5, seed_by_rank=True,
        model_class="gpt_weight_penalty", report_attributes=read, param_attributes=flags,
    )  # fmt: skip
    assert job.rank(0)["layout"] == {"pp": 1, "dp": 1, "tp": 2}
    weights = torch.load(tmp_path / "weights.pt")  # consolidated, checked against the single process above
    for r in range(2):
        seen = job.rank(r)["attributes"]
        assert [seen[n]["dtensor"] for n in read] == [True, True, False]
        assert [seen[n]["hook"].split(":")[0] for n in read] == ["refused", "refused", "registered"]
        assert "Register the hook on the parameter from named_parameters()" in seen[read[0]]["hook"]
        assert job.rank(r)["param_attributes"] == flags
        for name in read:
            torch.testing.assert_close(torch.tensor(seen[name]["value"]), weights[name], rtol=0, atol=0)
    # tensor-parallel peers read the same batches: one data-parallel replica
    assert [job.rank(r)["sampler"] for r in range(2)] == [{"num_replicas": 1, "rank": 0}] * 2
    _check_split(job, 2)
    # each kind of block (embedding, decoder block, head) was run whole on its first input and agreed
    assert [job.rank(r)["plan_checked"] for r in range(2)] == [["layers.0", "layers.1", "layers.5"]] * 2


@pytest.mark.multiproc
def test_pp2_tp2_matches_single_process(tmp_path):
    kwargs = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_microbatches": 2}
    job = _run_layout(tmp_path, kwargs, nproc=4, trainer=CLIP["trainer"], accumulate=2, clip=0.5)
    assert job.rank(0)["layout"] == {"pp": 2, "dp": 1, "tp": 2}
    _check_split(job, 4, pp=2)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "zero_stage", [pytest.param(0, marks=pytest.mark.slow), 1, pytest.param(2, marks=pytest.mark.slow), 3]
)
def test_dp2_tp2_every_zero_stage_matches_single_process(tmp_path, zero_stage):
    kwargs = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": zero_stage}
    flags = {"layers.1.attn.q.weight": "split", "layers.1.ln_1.bias": "whole"}  # set before set-up: kept
    job = _run_layout(
        tmp_path, kwargs, nproc=4, trainer=CLIP["trainer"], accumulate=2, clip=0.5, param_attributes=flags
    )
    assert job.rank(0)["layout"] == {"pp": 1, "dp": 2, "tp": 2}
    assert [job.rank(r)["param_attributes"] for r in range(4)] == [flags] * 4
    # tensor-parallel ranks are adjacent and share a data-parallel index
    assert [job.rank(r)["sampler"]["rank"] for r in range(4)] == [0, 0, 1, 1]
    assert all(job.rank(r)["plan_checked"] for r in range(4))  # ZeRO-3: each parameter gathered over dp x tp


@pytest.mark.multiproc
@_and_dp2_tp2(zero_stage=2)
def test_tied_vocabulary_parallel_embedding_and_head_match_single_process(tmp_path, kwargs, nproc):
    """The token embedding (row-wise: vocabulary-parallel) and the output head (column-wise) are one tied
    parameter split the same way; across pipeline stages each tensor-parallel slice sums with its own."""
    model = {"tie_embeddings": True}
    job = _run_layout(tmp_path, kwargs, nproc=nproc, model=model, trainer={"accumulate_grad_batches": 2}, accumulate=2)
    _check_split(job, nproc, model=model, pp=kwargs.get("pipeline_parallel_size", 1))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("kwargs", "nproc"),
    [
        ({"tensor_parallel_size": 2}, 2),
        pytest.param({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, marks=pytest.mark.slow),
        pytest.param({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 2}, 4, marks=pytest.mark.slow),
        ({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, 4),
    ],
    ids=["tp2", "pp2-tp2", "dp2-tp2-zero2", "dp2-tp2-zero3"],
)
def test_lamb_trust_ratios_over_tensor_parallel_slices_match_single_process(tmp_path, kwargs, nproc):
    """LAMB's per-tensor norms are over the whole tensor: slices summed over the tensor-parallel group (and
    flat or FSDP2 shards over the data-parallel group first; FSDP2 over a column-wise slice is a strided
    shard, which a norm summed over the tensor-parallel group alone missed by a factor of sqrt(2))."""
    model = {"optimizer": "lamb", "lr": 0.02, "weight_decay": 0.01}
    _run_layout(tmp_path, kwargs, nproc=nproc, model=model, atol=5e-6)  # as tight as the other layouts' LAMB


@pytest.mark.multiproc
def test_checkpoint_chain_across_tensor_parallel_degrees_matches_uninterrupted_run(tmp_path):
    """pp2 x tp2 -> dp2 x tp2 ZeRO-3 -> dp2 x tp2 ZeRO-1 -> pp2 (tp1) -> one process, two steps each: every
    checkpoint holds unsplit tensors, and each resume reads its own slices (and shards) of them, the
    optimizer state with them, so every segment continues the uninterrupted run."""
    base = {"model": {"optimizer": "adamw", "lr": 0.01, "n_layer": 4}, "data": {"global_batch": 8}}
    chain = [
        ("pp2-tp2", 4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_microbatches": 2}),
        ("dp2-tp2-zero3", 4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}),
        # small buckets: flat shards cut across the slices of several tensors
        ("dp2-tp2-zero1", 4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1,
                              "zero": {"bucket_size_mb": 0.004}}),
        ("pp2", 2, {"pipeline_parallel_size": 2, "num_microbatches": 2}),
        ("single", 1, {}),
    ]  # fmt: skip
    steps = 2
    ref_losses, ref_weights = reference_run(base, steps=steps * len(chain))
    previous = None
    for i, (name, nproc, kwargs) in enumerate(chain):
        out = tmp_path / name
        cfg = {
            **base,
            "steps": steps * (i + 1),
            "devices": nproc,
            "strategy": {"name": "hybrid_class", "kwargs": kwargs},
            "data": {**base["data"], "skip": steps * i},
            "save": str(out / "ckpt"),
            "weights": str(out / "w.pt"),
            **({"resume": previous} if previous else {}),
        }
        job = launch("train_gpt.py", cfg, nproc=nproc)
        assert job.rank(0)["global_step"] == steps * (i + 1)
        losses = torch.tensor([job.rank(r)["losses"] for r in range(nproc)])
        got = losses[0] if kwargs.get("pipeline_parallel_size", 1) > 1 else losses.mean(0)
        want = torch.tensor(ref_losses[steps * i : steps * (i + 1)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{name}: losses differ from one run")
        previous = str(out / "ckpt")
    weights = torch.load(tmp_path / "single" / "w.pt")
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=0, atol=1e-4, msg=f"{key} differs")


@pytest.mark.multiproc
@_and_dp2_tp2(zero_stage=1)
def test_sequence_parallelism_matches_single_process(tmp_path, kwargs, nproc):
    """The norms and the residual stream split by sequence position between the split layers (a reduce-scatter
    out of each, an all-gather into the next; the norms' gradients summed over the positions' ranks); across
    pipeline stages the hidden states travel split by sequence."""
    model = {"sequence_parallel": True}
    job = _run_layout(
        tmp_path, kwargs, nproc=nproc, model=model, trainer={"accumulate_grad_batches": 2}, accumulate=2, norm_rows=True
    )
    # the blocks, run whole on their first input (gathered along the sequence), gave what the split ones give
    assert all(job.rank(r)["plan_checked"] for r in range(nproc))
    # and the norms did run on half the positions on each rank (without sequence parallelism: all of them)
    half = 16 // 2  # the test model's block_size (workers/common.py)
    assert all(job.rank(r)["norm_rows"] == [half] for r in range(nproc)), [
        job.rank(r)["norm_rows"] for r in range(nproc)
    ]


@pytest.mark.multiproc
@_and_dp2_tp2(zero_stage=3)
def test_vocabulary_parallel_loss_matches_single_process(tmp_path, kwargs, nproc):
    """The head's logits stay split by vocabulary (a DTensor) and the cross-entropy is computed on the split,
    forward and backward under torch's loss_parallel (run by the strategy): the same losses and weights as
    one process, with the sequence split too on the pipeline."""
    model = {"loss_parallel": True, "sequence_parallel": kwargs.get("pipeline_parallel_size", 1) > 1}
    trainer = {"accumulate_grad_batches": 2, "limit_val_batches": 1}
    job = _run_layout(
        tmp_path, kwargs, nproc=nproc, model=model, trainer=trainer, accumulate=2, count_loss_comms=True, validate=True
    )
    # evaluation too: the split logits reach the metric whole (under a pipeline, gathered on the last stage first)
    assert all(job.rank(r)["validate"]["val_loss"] > 0 for r in range(nproc))
    assert all(job.rank(r)["plan_checked"] for r in range(nproc))  # the head's split logits joined, compared
    # on the ranks that compute the loss: the logits arrive split by vocabulary, and the loss gathers none of
    # them (loss parallelism reduces a max and two sums per row; without it DTensor would all-gather the logits)
    seen = [job.rank(r)["loss_comms"] for r in range(nproc) if job.rank(r)["loss_comms"]]
    assert seen and all(s["logits"] == ["S(2)"] for s in seen), seen
    assert all(not any("gather" in k for k in s["comms"]) and s["comms"] for s in seen), seen


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
        pytest.param({"pipeline_parallel_size": 2, "num_microbatches": 2}, marks=pytest.mark.slow),
    ],
    ids=["tp2", "pp2"],
)
def test_augmentation_in_seeded_workers_is_drawn_alike_by_a_replicas_ranks(tmp_path, kwargs):
    """``seed_everything(workers=True)``: Lightning seeds dataloader workers from each process's generator
    (which a pipeline's stages advance differently) and the global rank, so two ranks of one replica would draw
    different augmentations (the batch check refuses that). The strategy seeds a replica's workers alike: its
    ranks train on what one process trains on."""
    data = {**BASE["data"], "augment": "in_workers"}
    cfg = {**BASE, "data": data, "seed_workers": True, "steps": 3}
    job = launch("train_gpt.py", {**cfg, "strategy": {"name": "hybrid_class", "kwargs": kwargs}, "devices": 2}, nproc=2)
    single = launch("train_gpt.py", {**cfg, "strategy": {"name": "hybrid_class"}, "devices": 1}, nproc=1)
    want = torch.tensor(single.rank(0)["losses"])
    for r in range(2):  # tp2: each peer's loss; pp2: the step's loss on every stage
        torch.testing.assert_close(torch.tensor(job.rank(r)["losses"]), want, rtol=0, atol=1e-5)
    plain = launch("train_gpt.py", {**BASE, "strategy": {"name": "hybrid_class"}, "steps": 3, "devices": 1}, nproc=1)
    assert plain.rank(0)["losses"] != single.rank(0)["losses"]  # the augmentation changed what trained


@pytest.mark.multiproc
def test_a_replicas_ranks_reading_different_batches_are_refused_on_every_rank(tmp_path):
    """An augmentation keyed on the global rank: the pipeline's first stage would train on one sample and its
    last stage score another's targets. Every rank stops at the first batch with the same message."""
    data = {**BASE["data"], "augment": "by_global_rank"}
    pp2 = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2}}
    cfg = {**BASE, "data": data, "strategy": pp2, "devices": 2, "out": str(tmp_path / "job")}
    job = launch("train_gpt.py", cfg, nproc=2, timeout=120, expect_success=False)
    errors = [job.rank(r).get("error", "") for r in range(2)]
    assert all("read different batches (rank 1 against rank 0)" in e for e in errors), errors
    assert errors[0] == errors[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_uneven_sequence_under_sequence_parallelism_is_refused_on_every_rank(tmp_path):
    """torch's sequence-parallel styles need equal shards: 15 positions over 2 ranks failed inside a collective
    on one rank (the other's connection reset). Refused where the sequence is first scattered, on every rank."""
    model = {**BASE["model"], "sequence_parallel": True, "block_size": 15}
    tp2 = {"name": "hybrid_class", "kwargs": {"tensor_parallel_size": 2}}
    cfg = {**BASE, "model": model, "strategy": tp2, "devices": 2, "out": str(tmp_path / "job")}
    job = launch("train_gpt.py", cfg, nproc=2, timeout=120, expect_success=False)
    errors = [job.rank(r).get("error", "") for r in range(2)]
    want = "layers.0.dropout scatters dimension 1 of its input (size 15) over tensor_parallel_size=2 ranks"
    assert all(want in e for e in errors), errors


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_one_replicas_uneven_sequence_is_refused_on_every_rank_of_every_replica(tmp_path, zero_stage):
    """dp2 x tp2: one replica's third batch is a position shorter (per-batch padding makes replicas' lengths
    differ). That replica alone would stop, and the other would wait for it in the gradient reductions (ZeRO-1)
    or in the next parameter all-gather of the same forward (ZeRO-3). The first scatter point's check agrees
    over the replicas: all four ranks raise one message, at that step, before any collective could hang."""
    model = {**BASE["model"], "sequence_parallel": True, "block_size": 16}
    kwargs = {"tensor_parallel_size": 2, "zero_stage": zero_stage}
    data = {**BASE["data"], "shorter": {"replica": 1, "batch": 2}}
    cfg = {
        **BASE, "model": model, "data": data, "steps": 4, "devices": 4,
        "strategy": {"name": "hybrid_class", "kwargs": kwargs}, "out": str(tmp_path / "job"),
    }  # fmt: skip
    job = launch("train_gpt.py", cfg, nproc=4, timeout=240, expect_success=False)
    errors = [job.rank(r).get("error", "") for r in range(4)]
    want = "layers.0.dropout scatters dimension 1 of its input (size 15 on a data-parallel replica) over"
    assert all(want in e for e in errors) and len(set(errors)) == 1, errors


def test_the_sequence_check_hooks_what_the_plan_splits_and_checks_the_scattered_dimension():
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lightning_hybrid.strategies.tensor.plan import _check_scattered_sequence

    inner = {"o_proj": nn.Linear(8, 8)}
    block = nn.ModuleDict(
        {
            "attn": nn.ModuleDict(inner),
            "vision": nn.ModuleDict({"attn": nn.ModuleDict({"o_proj": nn.Linear(8, 8)})}),
            "tok": nn.Embedding(10, 8),
            "wide": nn.Linear(3, 8),  # a row-wise split of Linear(12, 8) over 4 ranks: 3 input features each
        }
    )
    # a key matches one name level per atom, as parallelize_module resolves it: vision.attn.o_proj is not split
    assert _check_scattered_sequence(block, "*.o_proj", RowwiseParallel(output_layouts=Shard(1)), "layers.3", 2)
    assert not _check_scattered_sequence(block, "*.o_proj", RowwiseParallel(), "layers.3", 2)  # nothing scattered
    with pytest.raises(ValueError, match=r"layers\.3\.attn\.o_proj scatters dimension 1 of its input \(size 15\)"):
        block["attn"]["o_proj"](torch.randn(2, 15, 8))
    block["attn"]["o_proj"](torch.randn(2, 16, 8))
    block["vision"]["attn"]["o_proj"](torch.randn(2, 15, 8))
    # an embedding's input is (batch, sequence): its dimension 1 is the output's
    embedding = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    assert _check_scattered_sequence(block, "tok", embedding, "layers.0", 2)
    with pytest.raises(ValueError, match=r"layers\.0\.tok scatters dimension 1 of its input \(size 15\)"):
        block["tok"](torch.randint(10, (2, 15)))
    # a sharded last dimension is the features, not a sequence: a local input of 3 features is not refused
    _check_scattered_sequence(block, "wide", RowwiseParallel(output_layouts=Shard(-1)), "layers.1", 4)
    block["wide"](torch.randn(2, 5, 3))


@pytest.mark.multiproc
def test_a_plan_that_changes_what_a_block_computes_is_refused_on_every_rank(tmp_path):
    """q, k and v in one Linear split column-wise like separate projections: each rank's heads mix q with k, every
    peer alike (no comparison between peers can see it), and the model trains to other losses than one process.
    Run whole on its first input, the block gives other outputs: every rank stops after the first step, naming
    it. Every correct plan in this file passes the same check (their reports name the blocks it compared)."""
    tp2 = {"name": "hybrid_class", "kwargs": {"tensor_parallel_size": 2}}
    cfg = {**BASE, "model_class": "gpt_fused_qkv", "strategy": tp2, "devices": 2}
    job = launch("train_gpt.py", {**cfg, "out": str(tmp_path / "job")}, nproc=2, timeout=120, expect_success=False)
    errors = [job.rank(r).get("error", "") for r in range(2)]
    want = "The tensor-parallel plan changes what a block computes: layers.1's output 0 split differs from the block"
    assert all(want in e and "fused projection" in e for e in errors), errors
    assert errors[0] == errors[1]
    gap = float(errors[0].split("relative difference ")[1].split(" ")[0])
    assert gap > 0.1 and "in 100% of its rows" in errors[0], errors[0]  # far past rounding (1e-3), everywhere


def test_the_block_check_tells_a_wrong_plan_from_rounding_and_keeps_what_it_reads():
    """What the check of a split block against itself whole counts as off: rows (last-dimension vectors)
    beyond the tolerance, NaN alike in both where a padded row's attention is fully masked, a row finite in
    one and not in the other off; a few rows off (a routing decision rounding flipped) is not a wrong plan,
    which moves every row. Named tuples in a block's input are kept as they are."""
    from collections import namedtuple

    from lightning_hybrid.strategies.tensor.check import _ROWS, _map, _rows_off

    torch.manual_seed(0)
    want = torch.randn(4, 12, 32)
    assert _rows_off(want + 1e-7 * torch.randn_like(want), want, 1e-3) == (pytest.approx(0, abs=1e-5), 0.0)
    gap, rows = _rows_off(want.flip(-1), want, 1e-3)  # every row wrong
    assert gap > 0.5 and rows == 1.0
    flipped = want.clone()
    flipped[0, :3] = torch.randn(3, 32)  # 3 of 48 rows moved (a routing flip)
    gap, rows = _rows_off(flipped, want, 1e-3)
    assert gap > 1e-3 and rows == pytest.approx(3 / 48) and rows < _ROWS
    masked, masked_want = want.clone(), want.clone()
    masked[1, 5], masked_want[1, 5] = float("nan"), float("nan")
    assert _rows_off(masked, masked_want, 1e-3) == (0.0, 0.0)  # NaN in both: alike
    masked_want[1, 5] = 0.0
    gap, rows = _rows_off(masked, masked_want, 1e-3)  # NaN in one only: that row is off
    assert gap == float("inf") and rows == pytest.approx(1 / 48)
    pair = namedtuple("Pair", "hidden mask")(torch.ones(2), None)
    assert _map(lambda t: t, pair) == pair and type(_map(lambda t: t, pair)) is type(pair)


def test_the_block_check_puts_back_what_the_block_counts_and_skips_a_block_that_draws_in_eval(tmp_path, caplog):
    """In one process (a one-rank mesh): the check runs the block again, and a buffer the forward counts in
    is put back, the training flag too; a block that draws random numbers even in eval mode (``F.dropout``
    without ``training=``) differs from itself run whole twice, so it is skipped with a warning, not refused."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_hybrid.strategies.tensor.check import PlanCheck

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 8)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += 1
            return self.lin(x)

    class Drawing(Counting):  # another kind of block (a class and a plan): checked on its own
        def forward(self, x):
            return F.dropout(super().forward(x), 0.5)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh, check = init_device_mesh("cpu", (1,)), PlanCheck()
        blocks = {"counting": Counting(), "drawing": Drawing(), "counting again": Counting()}
        for name, block in blocks.items():
            plan = {"lin": ColwiseParallel()}
            check.watch(name, block, plan)
            parallelize_module(block, mesh, plan)
            block(torch.randn(2, 3, 4))
        with caplog.at_level("WARNING"):
            assert check.run(dist.group.WORLD, torch.device("cpu")) is None
        assert check.checked == ["counting"]
        assert "drawing could not be run whole" in caplog.text and "draws random numbers" in caplog.text
        assert [float(b.seen) for b in blocks.values()] == [1.0] * 3 and all(b.training for b in blocks.values())
    finally:
        dist.destroy_process_group()


def test_the_sequence_verdict_is_agreed_once_per_armed_step_and_a_second_length_is_refused(tmp_path):
    """In one process (a one-rank gloo group as the replicas' group), counting the agreements: exactly one per
    armed step, whatever ran in it (the first check agrees and names the replicas; the checks after it only
    check; a step in which no check ran agrees at its end, with this rank's own failure if it had one); a
    second length seen in a step (a decoder's target beside an encoder's source) is told in the next
    agreement, which refuses the model; evaluation's lengths are not a second length; a compiled model's
    check agrees too; unarmed or disarmed, a check raises alone."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lightning_hybrid.strategies.tensor.plan import SequenceCheck, UnevenSequence, _check_scattered_sequence

    replicas = r"\(size 15 on a data-parallel replica\) over tensor_parallel"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD

        def counted() -> tuple[SequenceCheck, list[int]]:
            check, calls = SequenceCheck(), []
            agree = check._agree
            check._agree = lambda length, size: calls.append(length) or agree(length, size)  # type: ignore
            return check, calls

        check, calls = counted()
        check.verdict("attn", 1, 16, 2)  # unarmed, even: nothing
        with pytest.raises(UnevenSequence, match=r"attn scatters dimension 1 of its input \(size 15\) over"):
            check.verdict("attn", 1, 15, 2)
        assert calls == []
        for _ in range(2):  # the first check agrees, the others check locally, settle adds nothing
            check.arm(group)
            for _ in range(3):
                check.verdict("attn", 1, 16, 2)
            check.settle(None, 2)
        assert calls == [-1, -1]
        check.verdict("attn", 1, 12, 2)  # evaluation (not armed): its own length, no second one
        check.arm(group)
        with pytest.raises(UnevenSequence, match=replicas):
            check.verdict("attn", 1, 15, 2)
        check.settle(UnevenSequence("its own", 15), 2)  # agreed already: no second agreement
        assert calls == [-1, -1, 15]
        check.arm(group)
        check.settle(None, 2)  # no check ran in the step (a training_step without a forward): agreed, fine
        assert calls == [-1, -1, 15, -1] and not check.armed
        check.arm(group)
        with pytest.raises(UnevenSequence, match=r"a sequence-parallel module scatters the sequence of its input"):
            check.settle(UnevenSequence("a check that could not agree", 13), 2)
        # a second length in a step: checked locally there, refused on every rank at the next agreement
        check.arm(group)
        check.verdict("encoder", 1, 16, 2)
        check.verdict("decoder", 1, 8, 2)
        check.settle(None, 2)
        assert len(calls) == 6
        check.arm(group)
        with pytest.raises(UnevenSequence, match=r"scatter points see several lengths in one forward: one replica"):
            check.verdict("encoder", 1, 16, 2)
        # compiled: the check runs eagerly, so it agrees (and names the replicas) as in eager mode
        check, calls = counted()
        scatter = nn.Linear(8, 8)
        _check_scattered_sequence(
            nn.ModuleDict({"o": scatter}), "o", RowwiseParallel(output_layouts=Shard(1)), "layers.0", 2, check
        )
        compiled = torch.compile(scatter, backend="eager")
        check.arm(group)
        compiled(torch.randn(2, 16, 8))
        compiled(torch.randn(2, 16, 8))
        check.settle(None, 2)
        assert calls == [-1]
        check.arm(group)
        with pytest.raises(UnevenSequence, match=replicas):
            compiled(torch.randn(2, 15, 8))
        assert calls == [-1, 15]
        check.settle(UnevenSequence("its own", 15), 2)  # as the strategy ends the step: agreed already
        # outside a training step (one replica, evaluation) the compiled check is traced: fullgraph compiles
        torch.compile(nn.Sequential(scatter), backend="eager", fullgraph=True)(torch.randn(2, 16, 8))
        # one replica: nothing to agree; an interrupted step: disarmed, later checks are local
        check.arm(None)
        assert not check.armed
        check.arm(group)
        check.disarm()
        with pytest.raises(UnevenSequence, match=r"\(size 15\) over"):
            check.verdict("attn", 1, 15, 2)
        assert len(calls) == 2
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_whole_parameters_that_drift_apart_between_peers_are_refused_on_every_rank(tmp_path):
    """Norms left out of a sequence-parallel plan act on each rank's positions: each peer's copy gets its part of
    the gradient only and the copies drift apart (nothing at set-up can see it). After the first step every rank
    stops, naming them; every correct plan in this file passes the same check."""
    model = {**BASE["model"], "sequence_parallel": True}
    tp2 = {"name": "hybrid_class", "kwargs": {"tensor_parallel_size": 2}}
    cfg = {**BASE, "model": model, "model_class": "gpt_norms_outside_the_plan", "strategy": tp2, "devices": 2}
    job = launch("train_gpt.py", {**cfg, "out": str(tmp_path / "job")}, nproc=2, timeout=120, expect_success=False)
    errors = [job.rank(r).get("error", "") for r in range(2)]
    want = "After step 1, parameters the tensor-parallel plan keeps whole differ between tensor-parallel peers:"
    assert all(want in e and "layers.1.ln_1.weight" in e for e in errors), errors
    assert errors[0] == errors[1]


def test_a_plan_splitting_a_size_the_tensor_parallel_size_does_not_divide_is_refused_with_the_values():
    """Each kind of split dimension, checked before any block is split: a column-wise Linear's outputs, a
    row-wise Linear's inputs, an embedding's vocabulary (rows) or width (columns)."""
    import re

    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_hybrid.strategies.tensor import TensorPlans

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Embedding(10, 6)
            self.up = nn.Linear(6, 9)
            self.down = nn.Linear(9, 6)

    class Model(nn.Module):
        def __init__(self, plan: dict) -> None:
            super().__init__()
            self.layers = nn.Sequential(Block())
            self.plan = plan

        def tensor_parallel_plan(self, name: str, block: nn.Module) -> dict:
            return self.plan

    cases = {
        "up": (ColwiseParallel(), "does not divide layers.0.up.out_features (9) that ColwiseParallel splits"),
        "down": (RowwiseParallel(), "does not divide layers.0.down.in_features (9) that RowwiseParallel splits"),
        "token": (RowwiseParallel(), "does not divide layers.0.token.num_embeddings (10) that RowwiseParallel"),
    }
    for key, (style, message) in cases.items():
        with pytest.raises(ValueError, match=re.escape(f"tensor_parallel_size=4 {message}") + r".* Choose a"):
            TensorPlans(Model({key: style}), 4)
    with pytest.raises(ValueError, match=r"does not divide layers\.0\.token\.embedding_dim \(6\) that ColwiseParallel"):
        TensorPlans(Model({"token": ColwiseParallel()}), 4)
    # sizes it divides pass, and each split dimension is recorded
    plans = TensorPlans(Model({"up": ColwiseParallel(), "down": RowwiseParallel()}), 3)
    assert plans.splits["layers.0.up.weight"] == 0 and plans.splits["layers.0.down.weight"] == 1
