"""The layouts of the conformance matrix, in the order the resume chain visits them, and the cells the pack
refuses (with the words every rank's error must contain)."""

from __future__ import annotations

from typing import Any

PP2 = {"pipeline_parallel_size": 2, "num_microbatches": 2, "schedule": "1f1b"}
DP2 = {"data_parallel_size": 2}

# name: (processes, strategy, data-parallel replicas, micro-batches per replica batch)
LAYOUTS: dict[str, tuple[int, dict[str, Any], int, int]] = {
    "single": (1, {"name": "hybrid", "kwargs": {}}, 1, 1),
    "pp2": (2, {"name": "hybrid", "kwargs": {**PP2}}, 1, 2),
    "dp2-zero0": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 0}}, 2, 1),
    "dp2-zero1": (2, {"name": "hybrid", "kwargs": {**DP2, "zero_stage": 1}}, 2, 1),
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
    "pp2xdp2-zero1": (4, {"name": "hybrid", "kwargs": {**PP2, **DP2, "zero_stage": 1}}, 2, 2),
    "pp2xdp2-zero2": (
        4,
        {"name": "hybrid", "kwargs": {**PP2, **DP2, "zero_stage": 2, "zero": {"bucket_size_mb": 0.001}}},
        2,
        2,
    ),
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

PIPELINES = ["pp2", "pp2xdp2-zero1", "pp2xdp2-zero2", "deepspeed-pp2-zero0", "deepspeed-pp2-zero1"]
DEEPSPEED = ["deepspeed-pp2-zero0", "deepspeed-pp2-zero1"]
ZERO3 = ["dp2-zero3", "dp2-zero3-submodules"]

# (layout, shape): what every rank's error says. Anything else that fails is a defect.
REFUSED: dict[tuple[str, str], str] = {
    **{(layout, "backbone-finetuning"): "adds param groups to the optimizer" for layout in DEEPSPEED},
    **{(layout, "swa"): "keeps a whole copy of the module" for layout in [*PIPELINES, *ZERO3]},
    **{(layout, "manual-optimization"): "uses manual optimization" for layout in PIPELINES},
    **{(layout, "scalar-params"): "cannot shard 0-dim parameters" for layout in ZERO3},
    **{(layout, s): "tied parameter in 2 FSDP2 units" for layout in ZERO3 for s in ("tied", "hf-gpt2", "hf-bert")},
    **{("pp2xdp2-zero2", s): "reduce_gradients='every_microbatch'" for s in ("tied", "hf-gpt2", "hf-bert")},
    **{(layout, "scalar-params"): "0-dim parameter" for layout in DEEPSPEED},
    **{(layout, s): "one parameter in two places" for layout in DEEPSPEED for s in ("tied", "hf-gpt2", "hf-bert")},
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
}
