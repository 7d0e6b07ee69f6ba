"""Pure layout arithmetic: mesh sizes, schedule table, stage split and stage placement.

Nothing here touches a process group or a Trainer, so every rule is unit-tested in one process and every
rank of a job reaches the same verdict on the same input (bad input fails everywhere, never hangs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, Union

__all__ = [
    "PRESETS",
    "SCHEDULES",
    "check_choices",
    "last_stage_rank",
    "Layout",
    "PipelineSplit",
    "ScheduleName",
    "ScheduleSpec",
    "ZeroConfig",
    "partition_layers",
    "resolve_layout",
    "stage_ids_on_rank",
]

ScheduleName = Literal[
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """How one torch pipeline schedule places and runs its stages."""

    torch_name: str  # the name `torch.distributed.pipelining.schedules.get_schedule_class` knows
    multi_stage: bool  # several (virtual) stages per rank
    style: Literal["loop", "v"]  # stage placement: round-robin, or V-shaped (first and last stage on rank 0)
    default_stages_per_rank: int
    fixed_stages_per_rank: bool  # the V schedules need exactly two stages per rank
    splits_weight_grad: bool  # zero-bubble family: input and weight gradients are computed separately


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("GPipe", False, "loop", 1, True, False),
    "1f1b": ScheduleSpec("1F1B", False, "loop", 1, True, False),
    "interleaved_1f1b": ScheduleSpec("Interleaved1F1B", True, "loop", 2, False, False),
    "looped_bfs": ScheduleSpec("LoopedBFS", True, "loop", 2, False, False),
    "interleaved_zero_bubble": ScheduleSpec("InterleavedZeroBubble", True, "loop", 2, False, True),
    "zbv_zero_bubble": ScheduleSpec("ZBVZeroBubble", True, "v", 2, True, True),
    "dualpipev": ScheduleSpec("DualPipeV", True, "v", 2, True, True),
}


# registered strategy names: (name, description, constructor arguments)
PRESETS: list[tuple[str, str, dict[str, object]]] = [
    ("hybrid", "Pipeline x ZeRO hybrid parallelism (defaults: no pipeline, ZeRO-0)", {}),
    ("hybrid_zero1", "Data parallel with ZeRO-1 (optimizer state sharded)", {"zero_stage": 1}),
    ("hybrid_zero2", "Data parallel with ZeRO-2 (+ gradients sharded)", {"zero_stage": 2}),
    ("hybrid_zero3", "Data parallel with ZeRO-3 (+ parameters sharded, FSDP2)", {"zero_stage": 3}),
    (
        "hybrid_pipeline",
        "One 1F1B pipeline stage per node, ZeRO-1 inside each node",
        {"pipeline_parallel_size": "auto", "zero_stage": 1},
    ),
]


@dataclass(frozen=True)
class PipelineSplit:
    """How the blocks of ``self.layers`` are cut into pipeline stages.

    By default stages are balanced by parameter count. Give at most one of ``layers_per_stage`` (how many
    consecutive blocks each stage holds) or ``split_points`` (the block indices at which stage 1, 2, ...
    begin). ``first_stage_extra`` / ``last_stage_extra`` add cost, in units of the mean block, to the first
    and last stage when balancing, for work the parameter count misses (embedding lookups, the loss).
    """

    layers_per_stage: Union[list[int], None] = None
    split_points: Union[list[int], None] = None
    first_stage_extra: float = 0.0
    last_stage_extra: float = 0.0

    def __post_init__(self) -> None:
        if self.layers_per_stage is not None and self.split_points is not None:
            raise ValueError("PipelineSplit takes `layers_per_stage` or `split_points`, not both")
        if self.first_stage_extra < 0 or self.last_stage_extra < 0:
            raise ValueError(
                f"first_stage_extra ({self.first_stage_extra}) and last_stage_extra ({self.last_stage_extra})"
                " must be >= 0"
            )


@dataclass(frozen=True)
class ZeroConfig:
    """Advanced ZeRO settings of :class:`HybridParallelStrategy` (the defaults save the most memory).

    Args:
        reduce_gradients: ZeRO-2 only. ``"every_microbatch"``: each bucket of gradients is reduced to the
            ranks that own it as soon as backward produced it and then freed, so no rank ever holds the
            whole stage gradient (one reduction per micro-batch, DeepSpeed's choice). ``"once_per_step"``:
            the full gradient accumulates over the accumulation window and pipeline micro-batches and is
            reduce-scattered once per optimizer step (less communication, the full gradient in memory).
        bucket_size_mb: the size of a gradient bucket (the ZeRO-0 all-reduce, ZeRO-2's reductions during
            backward). A ZeRO-1/2 optimizer steps and gathers its shard in chunks of at most this size and
            8 MiB of fp32, so an optimizer's temporaries (Adam's denominator, ...) are a chunk, not the shard.
        reshard_after_forward: ZeRO-3 only. ``True``: free each block's gathered parameters after its
            forward and gather them again for its backward (and for every micro-batch). ``False``: keep them
            gathered until the step ends (about one stage of full parameters more, fewer all-gathers).
        shard_units: ZeRO-3 only. ``"submodules"``: each direct child of a block that holds parameters (a
            transformer block's attention, MLP, norms) is its own FSDP2 unit, so FSDP2's working set (the
            gathered unit, its unsharded gradient, the prefetched next unit) is a fraction of a block.
            ``"blocks"``: each block is one unit (torchtitan's choice): fewer, larger all-gathers and
            reduce-scatters, faster where collectives are latency-bound, a larger peak on shallow models.
    """

    reduce_gradients: Literal["every_microbatch", "once_per_step"] = "every_microbatch"
    bucket_size_mb: float = 25.0
    reshard_after_forward: bool = True
    shard_units: Literal["blocks", "submodules"] = "submodules"

    def __post_init__(self) -> None:
        if self.reduce_gradients not in ("every_microbatch", "once_per_step"):
            raise ValueError(
                f"reduce_gradients must be 'every_microbatch' or 'once_per_step', got {self.reduce_gradients!r}."
            )
        size = self.bucket_size_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            raise ValueError(f"bucket_size_mb must be a finite number > 0, got {size!r}.")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}.")
        if self.shard_units not in ("blocks", "submodules"):
            raise ValueError(f"shard_units must be 'blocks' or 'submodules', got {self.shard_units!r}.")


@dataclass(frozen=True)
class Layout:
    """The resolved parallel layout of one job."""

    pipeline_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    schedule: str
    stages_per_rank: int
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size


def check_choices(*, schedule: object, zero_stage: object) -> None:
    """The checks that need no world size (the strategy's constructor runs them on every rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}. Choose one of: {', '.join(SCHEDULES)}.")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")


def resolve_layout(
    *,
    world_size: int,
    num_nodes: int,
    pipeline_parallel_size: Union[int, Literal["auto"]],
    data_parallel_size: Union[int, Literal["auto"]],
    zero_stage: int,
    schedule: str,
    stages_per_rank: Union[int, None],
    num_microbatches: Union[int, None],
) -> Layout:
    """Turn the user's (possibly ``"auto"``) sizes into a checked :class:`Layout`.

    ``"auto"`` pipeline size means one stage per node (data-parallel ranks stay inside a node); ``"auto"``
    data-parallel size takes whatever the pipeline leaves of the world.
    """
    check_choices(schedule=schedule, zero_stage=zero_stage)
    spec = SCHEDULES[schedule]

    pp, dp = pipeline_parallel_size, data_parallel_size
    if pp == "auto" and dp == "auto":
        pp = num_nodes if world_size % num_nodes == 0 else 1
    if pp == "auto":
        _check_positive("data_parallel_size", dp)
        if world_size % dp:
            raise ValueError(f"data_parallel_size ({dp}) must divide the world size ({world_size}).")
        pp = world_size // dp
    _check_positive("pipeline_parallel_size", pp)
    if dp == "auto":
        if world_size % pp:
            raise ValueError(
                f"pipeline_parallel_size ({pp}) must divide the world size ({world_size}); choose a divisor"
                f" of {world_size} or change the number of devices."
            )
        dp = world_size // pp
    _check_positive("data_parallel_size", dp)
    if pp * dp != world_size:
        raise ValueError(
            f"pipeline_parallel_size ({pp}) x data_parallel_size ({dp}) = {pp * dp} must equal the world size"
            f" ({world_size}); set one of them to 'auto'."
        )

    if stages_per_rank is None:
        stages_per_rank = spec.default_stages_per_rank if pp > 1 else 1
    _check_positive("stages_per_rank", stages_per_rank)
    if pp > 1 and spec.fixed_stages_per_rank and stages_per_rank != spec.default_stages_per_rank:
        raise ValueError(
            f"schedule={schedule!r} runs exactly {spec.default_stages_per_rank} stage(s) per rank, got"
            f" stages_per_rank={stages_per_rank}; leave stages_per_rank unset."
        )

    if pp > 1 and zero_stage == 3 and spec.splits_weight_grad:
        raise ValueError(
            f"schedule={schedule!r} computes weight gradients separately from input gradients, which gives"
            " wrong gradients when parameters are resharded after forward (zero_stage=3). Use zero_stage <= 2"
            " with this schedule, or schedule='1f1b' / 'interleaved_1f1b' with zero_stage=3."
        )

    num_stages = pp * stages_per_rank
    if num_microbatches is None:
        num_microbatches = num_stages if pp > 1 else 1
    _check_positive("num_microbatches", num_microbatches)
    if pp > 1:
        minimum = num_stages if spec.style == "v" else pp
        if num_microbatches < minimum:
            raise ValueError(
                f"schedule={schedule!r} with {num_stages} stages on {pp} ranks needs at least {minimum}"
                f" micro-batches, got num_microbatches={num_microbatches}; raise num_microbatches."
            )
        if spec.multi_stage and spec.style == "loop" and num_microbatches % pp:
            raise ValueError(
                f"schedule={schedule!r} needs num_microbatches ({num_microbatches}) to be a multiple of"
                f" pipeline_parallel_size ({pp})."
            )
    return Layout(pp, dp, zero_stage, schedule, stages_per_rank, num_microbatches)


def partition_layers(costs: list[float], num_stages: int, split: Union[PipelineSplit, None] = None) -> list[range]:
    """Cut ``len(costs)`` consecutive blocks into ``num_stages`` non-empty stages.

    Returns one ``range`` of block indices per stage. Balanced splits minimise the largest stage cost
    (exact dynamic programme; cheap for the hundreds of blocks real models have).
    """
    split = split or PipelineSplit()
    n = len(costs)
    if n < num_stages:
        raise ValueError(
            f"The model has {n} blocks in `self.layers` but the pipeline needs {num_stages} stages"
            " (pipeline_parallel_size x stages_per_rank), and every stage needs at least one block. Use fewer"
            " stages or split the model into more blocks."
        )
    if split.layers_per_stage is not None:
        counts = list(split.layers_per_stage)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"layers_per_stage={counts} must have {num_stages} entries, each >= 1, adding up to the {n}"
                " blocks of `self.layers`."
            )
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    if split.split_points is not None:
        points = list(split.split_points)
        full = [0, *points, n]
        if len(points) != num_stages - 1 or any(b <= a for a, b in itertools.pairwise(full)):
            raise ValueError(
                f"split_points={points} must be {num_stages - 1} strictly increasing block indices between 1"
                f" and {n - 1} (each stage needs at least one block)."
            )
        return [range(full[i], full[i + 1]) for i in range(num_stages)]

    mean = sum(costs) / n if n else 1.0
    extra_first, extra_last = split.first_stage_extra * mean, split.last_stage_extra * mean
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage_cost(i: int, j: int, s: int) -> float:  # blocks [i, j) as stage s
        return prefix[j] - prefix[i] + (extra_first if s == 0 else 0.0) + (extra_last if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest possible largest-stage cost putting blocks [0, j) into stages 0..s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(i, j, s))
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, i
    ranges, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        ranges.append(range(i, j))
        j = i
    ranges.append(range(0, j))
    return ranges[::-1]


def stage_ids_on_rank(pp_rank: int, layout: Layout) -> list[int]:
    """The stage indices one pipeline rank runs, in the order the schedule expects them."""
    pp, spr = layout.pipeline_parallel_size, layout.stages_per_rank
    if SCHEDULES[layout.schedule].style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(spr)]


def last_stage_rank(layout: Layout) -> int:
    """The pipeline rank that runs the last stage (where the outputs and the loss exist)."""
    last = layout.num_stages - 1
    return next(r for r in range(layout.pipeline_parallel_size) if last in stage_ids_on_rank(r, layout))


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")
