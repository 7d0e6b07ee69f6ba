"""The layouts of the conformance matrix, in the order the resume chain visits them, and the cells the pack
refuses (with the words every rank's error must contain)."""

from __future__ import annotations

from typing import Any

PP2 = {"pipeline_parallel_size": 2, "num_microbatches": 2, "schedule": "1f1b"}
DP2 = {"data_parallel_size": 2}
TP2 = {"tensor_parallel_size": 2}
# about 260 fp32 elements a bucket: every shape's stage spans several buckets, so the order in which buckets
# start during backward, their overlap and the late-gradient checks all run
SMALL_BUCKETS = {"zero": {"bucket_size_mb": 0.001}}

# name: (processes, strategy, data-parallel replicas, micro-batches per replica batch)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int, int]] = {
    "single": (1, {"name": "hybrid", "kwargs": {}}, 1, 1),
    "pp2": (2, {"name": "hybrid", "kwargs": {**PP2}}, 1, 2),
    "dp2-zero0": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 0, **SMALL_BUCKETS}}, 2, 1),
    "dp2-zero1": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 1, **SMALL_BUCKETS}}, 2, 1),
    "dp2-zero2": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 2, "zero": {"bucket_size_mb": 0.001}}}, 2, 1),
    "dp2-zero2-once": (
        2,
        {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 2, "zero": {"reduce_gradients": "once_per_step"}}},
        2,
        1,
    ),
    "dp2-zero3": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 3}}, 2, 1),  # shapes' blocks: one unit
    "dp2-zero3-submodules": (
        2,
        {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 3, "zero": {"shard_units": "submodules"}}},
        2,
        1,
    ),
    "pp2xdp2-zero0": (4, {"name": "hybrid", "kwargs": {**PP2, **DP2, "zero_stage": 0, **SMALL_BUCKETS}}, 2, 2),
    "pp2xdp2-zero1": (4, {"name": "hybrid", "kwargs": {**PP2, **DP2, "zero_stage": 1, **SMALL_BUCKETS}}, 2, 2),
    "pp2xdp2-zero2": (
        4,
        {"name": "hybrid", "kwargs": {**PP2, **DP2, "zero_stage": 2, "zero": {"bucket_size_mb": 0.001}}},
        2,
        2,
    ),
    # tensor parallelism (each shape's plan: its Linear layers split by outputs, gathered), after the layouts
    # without it: the resume chain crosses from tp1 to tp2 and back (to DeepSpeed)
    "tp2": (2, {"name": "hybrid", "kwargs": {**TP2}}, 1, 1),
    "pp2xtp2": (4, {"name": "hybrid", "kwargs": {**PP2, **TP2}}, 1, 2),
    "dp2xtp2-zero1": (4, {"name": "hybrid", "kwargs": {**DP2, **TP2, "zero_stage": 1, **SMALL_BUCKETS}}, 2, 1),
    "dp2xtp2-zero3": (4, {"name": "hybrid", "kwargs": {**DP2, **TP2, "zero_stage": 3}}, 2, 1),
    "deepspeed-pp2-zero0": (
        2,
        {"name": "deepspeed", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 0}},
        1,
        2,
    ),
    "deepspeed-pp2-zero1": (
        2,
        {"name": "deepspeed", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 1}},
        1,
        2,
    ),
}

# layouts the slow tier (CI) leaves to `run.py` (which writes docs/conformance.md with every layout), so that the
# whole CI run stays well inside its time on 2 CPU cores: the four-process ones (3-4 minutes each) and the
# variants of a stage CI runs otherwise (ZeRO-2 once per step, ZeRO-3 by submodules, DeepSpeed's ZeRO-0). CI keeps
# one process, pp2, dp2 at ZeRO-0/1/2/3, tp2 and DeepSpeed's pp2 ZeRO-1 (a checkpoint still crosses into the
# other engine and out of tensor parallelism); the planted bugs run on those. The others' exactness, checkpoints
# and refusals stay in tests/test_hybrid_exactness.py, tests/test_tensor_parallel.py and the engines' own tests
RUN_PY_ONLY = (
    "dp2-zero2-once",
    "dp2-zero3-submodules",
    "pp2xdp2-zero0",
    "pp2xdp2-zero1",
    "pp2xdp2-zero2",
    "pp2xtp2",
    "dp2xtp2-zero1",
    "dp2xtp2-zero3",
    "deepspeed-pp2-zero0",
)

PIPELINES = [
    "pp2",
    "pp2xdp2-zero0",
    "pp2xdp2-zero1",
    "pp2xdp2-zero2",
    "pp2xtp2",
    "deepspeed-pp2-zero0",
    "deepspeed-pp2-zero1",
]
DEEPSPEED = ["deepspeed-pp2-zero0", "deepspeed-pp2-zero1"]
ZERO3 = ["dp2-zero3", "dp2-zero3-submodules", "dp2xtp2-zero3"]
TENSOR = ["tp2", "pp2xtp2", "dp2xtp2-zero1", "dp2xtp2-zero3"]
MANUAL = ("manual-optimization", "manual-edits", "manual-frozen")
# shapes whose hooks (or manual optimization) read or edit gradients between backward and the step
GRADIENT_CODE = (
    "grad-scaled", "grad-surgery", "grad-hand-set", "grad-estimated", "step-hook-groups", "step-hook-params",
    "outside-optimizer", *MANUAL,
)  # fmt: skip

# (layout, shape): what every rank's error says, whatever the optimizer. Anything else that fails is a defect.
TIED_SHAPES = ("tied", "hf-gpt2", "hf-bert", "causal-lm-gpt2-tied")  # input and output embeddings one Parameter
REFUSED: dict[tuple[str, str], str] = {
    **{(layout, "backbone-finetuning"): "adds param groups to the optimizer" for layout in DEEPSPEED},
    **{(layout, "swa"): "keeps a whole copy of the module" for layout in [*PIPELINES, *ZERO3, *TENSOR]},
    # user code that edits .grad where ZeRO-2 handed the gradient off, or the model's .grad at the step under
    # ZeRO-1/2 (each rank keeps its shard): refused by the placeholder in .grad, naming the parameter
    **{
        (layout, s): "each gradient is handed off"
        for layout in ("dp2-zero2", "pp2xdp2-zero2")
        for s in ("grad-scaled", "grad-surgery", "grad-hand-set", "grad-estimated", "step-hook-params", "manual-edits")
    },
    **{
        (layout, s): "was assigned to"
        for layout in ZERO3
        for s in ("grad-scaled", "grad-surgery", "grad-hand-set", "grad-estimated", "manual-edits")
    },
    **{
        (layout, "step-hook-params"): "keeps only its shard of the reduced gradient"
        for layout in ("dp2-zero1", "dp2-zero2-once", "pp2xdp2-zero1")
    },
    **{
        (layout, "reads-optimizer-state"): "holds the optimizer state of its shard"
        for layout in (
            "dp2-zero1",
            "dp2-zero2",
            "dp2-zero2-once",
            "pp2xdp2-zero1",
            "pp2xdp2-zero2",
            "dp2xtp2-zero1",
            "deepspeed-pp2-zero1",
        )
    },
    **{(layout, "tensor-hook"): "tensor hooks registered on" for layout in ZERO3},
    **{
        (layout, s): "changed requires_grad between two backward passes"
        for layout in ZERO3
        for s in ("frozen-mid-window", "manual-frozen")
    },
    **{
        (layout, s): "uses manual optimization"
        for layout in PIPELINES
        for s in ("manual-optimization", "manual-edits", "manual-frozen")
    },
    # torch's pipeline stages compute input gradients with autograd.grad(inputs=...)
    **{(layout, "checkpointed-reentrant"): "use_reentrant=True" for layout in PIPELINES if layout not in DEEPSPEED},
    **{(layout, "scalar-params"): "cannot shard 0-dim parameters" for layout in ZERO3},
    **{(layout, s): "tied parameter in 2 FSDP2 units" for layout in ZERO3 for s in TIED_SHAPES},
    **{("pp2xdp2-zero2", s): "reduce_gradients='every_microbatch'" for s in TIED_SHAPES},
    **{(layout, "scalar-params"): "0-dim parameter" for layout in DEEPSPEED},
    **{(layout, s): "one parameter in two places" for layout in DEEPSPEED for s in TIED_SHAPES},
    **{
        (layout, s): "hold no parameter of stage"
        for layout in DEEPSPEED
        for s in ("param-groups", "lr-monitor", "frozen-part")
    },
    **{(layout, "padded-lm"): "accumulate_grad_batches" for layout in DEEPSPEED},
    **{
        (layout, s): "got no gradient on any replica"
        for layout in DEEPSPEED
        for s in ("routed-experts", "unused-everywhere")
    },
    # DeepSpeed's engine steps inside training_step; what it cannot do as the Trainer asks
    **{
        (layout, s): "DeepSpeed's engine runs forward, backward and the optimizer step"
        for layout in DEEPSPEED
        for s in (
            "grad-scaled",
            "grad-surgery",
            "grad-hand-set",
            "grad-estimated",
            "step-hook-groups",
            "step-hook-params",
            "outside-optimizer",
        )
    },
    **{
        (layout, s): "set num_microbatches instead"
        for layout in DEEPSPEED
        for s in ("partial-window", "frozen-mid-window")
    },
    **{(layout, "clip-value"): "clips gradients by their norm only" for layout in DEEPSPEED},
    **{(layout, "fp16-scaled"): "cannot drive DeepSpeed's engine" for layout in DEEPSPEED},
    ("deepspeed-pp2-zero0", "bf16-mixed"): "accumulates bf16 gradients only in bf16",
    # tensor parallelism with ZeRO-0/1/2: .grad of a split parameter is this rank's slice, so user code that
    # reads or edits gradients before the step is refused (under ZeRO-3 they are DTensors: exact); a pipeline
    # refuses manual optimization first
    **{
        (layout, s): "under tensor parallelism with zero_stage="
        for layout in ("tp2", "pp2xtp2", "dp2xtp2-zero1")
        for s in GRADIENT_CODE
        if (layout, s) not in {(p, m) for p in PIPELINES for m in MANUAL}
    },
    **{(layout, "tensor-hook"): "the tensor-parallel plan replaces that parameter" for layout in TENSOR},
    # the shapes' generic plan splits BERT's decoder (its bias tied to the prediction head's own, kept whole)
    **{(layout, "hf-bert"): "the tensor-parallel plan splits them differently" for layout in TENSOR},
}
