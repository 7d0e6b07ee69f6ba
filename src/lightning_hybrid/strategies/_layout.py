"""The one layout object of both engines: the degrees (pipeline, data and tensor), the schedule and
micro-batches, resolved by one function with one set of spellings and defaults (:class:`LayoutRequest` ->
:class:`Layout`), the named device mesh and process groups they make (made once per process and layout:
:func:`shared_group`), and the record checkpoints carry; with the schedule table and where each schedule places
its stages.

Resolution touches no process group or Trainer, so every rule is unit-tested in one process and every rank of
a job reaches the same verdict on the same input (bad input fails everywhere, never hangs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_hybrid._validate import check_choice, check_int

__all__ = [
    "DP_AXIS",
    "PP_AXIS",
    "PRESETS",
    "SCHEDULES",
    "TP_AXIS",
    "Layout",
    "LayoutRequest",
    "ScheduleName",
    "ScheduleSpec",
    "check_choices",
    "last_stage_rank",
    "resolve_layout",
    "shared_group",
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


def check_choices(*, schedule: object, zero_stage: object) -> None:
    """The checks that need no world size (the strategy's constructor runs them on every rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}. Choose one of: {', '.join(SCHEDULES)}.")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")


PP_AXIS, DP_AXIS, TP_AXIS = "pipeline_parallel", "data_parallel", "tensor_parallel"  # the mesh's dimension names


@dataclass(frozen=True)
class LayoutRequest:
    """The degrees a user asks either engine for, before the world size is known: one set of spellings and
    defaults for ``HybridParallelStrategy`` and ``DeepSpeedPipelineStrategy``.

    A size is a positive integer or ``"auto"``: ``"auto"`` data parallelism (``None`` means the same) takes
    what the other degrees leave of the world; ``"auto"`` pipeline parallelism makes one stage per node (or,
    with a data-parallel size given, what that leaves). ``num_microbatches`` defaults to one per stage (1
    without a pipeline); ``stages_per_rank`` to the schedule's own. ``tensor_parallel_size`` ranks split each
    block's matrices (the innermost mesh dimension; pipeline x data parallelism share what it leaves).
    ``engine`` says who runs the schedule: torch's schedules need
    at least one micro-batch per pipeline rank, DeepSpeed's 1F1B does not. Checks that need no world size
    run here, at construction, on every rank; the rest in :meth:`resolve`.
    """

    pipeline_parallel_size: Union[int, Literal["auto"]] = 1
    data_parallel_size: Union[int, Literal["auto"], None] = "auto"
    zero_stage: int = 0
    schedule: str = "1f1b"
    num_microbatches: Union[int, None] = None
    stages_per_rank: Union[int, None] = None
    tensor_parallel_size: int = 1
    engine: Literal["torch", "deepspeed"] = "torch"

    def __post_init__(self) -> None:
        check_choices(schedule=self.schedule, zero_stage=self.zero_stage)
        check_choice("engine", self.engine, ("torch", "deepspeed"))
        if self.data_parallel_size is None:
            object.__setattr__(self, "data_parallel_size", "auto")
        for name in ("pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value != "auto":
                check_int(name, value, minimum=1, fix="pass 'auto' to derive it from the world size")
        check_int("num_microbatches", self.num_microbatches, minimum=1, optional=True)
        check_int("stages_per_rank", self.stages_per_rank, minimum=1, optional=True)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.engine == "deepspeed" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size}: DeepSpeed's pipeline engine has no tensor"
                " parallelism. Use HybridParallelStrategy(tensor_parallel_size=..., pipeline_parallel_size=...,"
                " zero_stage=...), which splits each block over tensor-parallel ranks inside its pipeline stages,"
                " or tensor_parallel_size=1."
            )

    def resolve(self, *, world_size: int, num_nodes: int) -> Layout:
        """The checked :class:`Layout` on ``world_size`` processes over ``num_nodes`` nodes; the same verdict,
        and the same error with the values and the fix, on every rank."""
        return resolve_layout(
            world_size=world_size,
            num_nodes=num_nodes,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            zero_stage=self.zero_stage,
            schedule=self.schedule,
            stages_per_rank=self.stages_per_rank,
            num_microbatches=self.num_microbatches,
            tensor_parallel_size=self.tensor_parallel_size,
            torch_schedule=self.engine == "torch",
        )


@dataclass(frozen=True)
class Layout:
    """The resolved parallel layout of one job: its degrees, schedule and micro-batches, the named device mesh
    they make, and the record checkpoints carry."""

    pipeline_parallel_size: int
    data_parallel_size: int
    zero_stage: int
    schedule: str
    stages_per_rank: int
    num_microbatches: int
    tensor_parallel_size: int = 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size * self.tensor_parallel_size

    def coordinates(self, global_rank: int) -> tuple[int, int, int]:
        """``(pipeline rank, data-parallel rank, tensor-parallel rank)`` of a global rank in the row-major mesh
        (DeepSpeed numbers its ranks the same way: stage x data-parallel size + data index)."""
        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        return global_rank // (dp * tp), (global_rank // tp) % dp, global_rank % tp

    def rank_at(self, pp: int, dp: int, tp: int = 0) -> int:
        """The global rank at mesh coordinates ``(pp, dp, tp)`` (the inverse of :meth:`coordinates`)."""
        return (pp * self.data_parallel_size + dp) * self.tensor_parallel_size + tp

    def data_parallel_groups(self) -> list[list[int]]:
        """Every data-parallel group's global ranks, one group per pipeline and tensor-parallel coordinate."""
        pp, dp, tp = self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        return [[p * dp * tp + d * tp + t for d in range(dp)] for p in range(pp) for t in range(tp)]

    def model_parallel_groups(self) -> list[list[int]]:
        """Every group of ranks holding one whole model replica between them (pipeline x tensor-parallel
        peers), one group per data-parallel coordinate."""
        pp, dp, tp = self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size
        return [[p * dp * tp + d * tp + t for p in range(pp) for t in range(tp)] for d in range(dp)]

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's sizes and dimension names, row-major: data-parallel (and tensor-parallel) peers get
        adjacent global ranks, i.e. the same node. The tensor-parallel dimension exists only when it is > 1."""
        sizes = [self.pipeline_parallel_size, self.data_parallel_size]
        names = [PP_AXIS, DP_AXIS]
        if self.tensor_parallel_size > 1:
            sizes.append(self.tensor_parallel_size)
            names.append(TP_AXIS)
        return tuple(sizes), tuple(names)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's one named device mesh (every rank calls it)."""
        sizes, names = self.mesh_shape()
        return shared_group(
            ("mesh", device_type, sizes, names), lambda: init_device_mesh(device_type, sizes, mesh_dim_names=names)
        )

    def host_data_parallel_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel group on the host (gloo, whatever the default backend), shared."""
        groups = self.data_parallel_groups()
        return shared_group(
            ("host dp", str(groups)), lambda: dist.new_subgroups_by_enumeration(groups, backend="gloo")[0]
        )

    def model_parallel_group(self) -> dist.ProcessGroup:
        """This rank's group of every pipeline and tensor-parallel rank of its replica, shared."""
        groups = self.model_parallel_groups()
        return shared_group(("model", str(groups)), lambda: dist.new_subgroups_by_enumeration(groups)[0])

    def record(self, *, engine: str, tied_parameters: list[Any]) -> dict[str, Any]:
        """What a checkpoint records of the layout that wrote it (informational: any layout and either engine
        reads any checkpoint)."""
        return {
            "engine": engine,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "zero_stage": self.zero_stage,
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "tied_parameters": tied_parameters,
        }

    def describe(self) -> str:
        """One line for the log."""
        text = (
            f"pipeline_parallel_size={self.pipeline_parallel_size}, data_parallel_size={self.data_parallel_size},"
            f" zero_stage={self.zero_stage}"
        )
        if self.tensor_parallel_size > 1:
            text += f", tensor_parallel_size={self.tensor_parallel_size}"
        if self.pipeline_parallel_size > 1:
            text += f", schedule={self.schedule}, stages={self.num_stages}, num_microbatches={self.num_microbatches}"
        return text


_T = TypeVar("_T")
_SHARED: dict[tuple[Any, ...], Any] = {}


def shared_group(key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """The process group (or device mesh) ``make`` creates, made once per ``key`` for the life of the default
    process group: every later Trainer of the same layout in this process (fit, validate and test; a sweep; the
    next stage of a fine-tune) uses the same groups instead of adding its own.

    A process group lives until the process ends or it is destroyed (gloo: three threads each; NCCL: a
    communicator and its device memory), and the strategy cannot destroy its groups at teardown: the module's
    DTensors keep the mesh after ``fit``, for ``validate``, ``test`` and saving. Without sharing, a process
    that ran a few hundred Trainers (a hyper-parameter search, the conformance matrix) held thousands of idle
    threads and its steps slowed several-fold. Every rank reaches the same keys in the same order, so every rank
    creates the same groups, as ``new_group`` requires; a new default group (``destroy_process_group`` and
    ``init_process_group`` again) starts afresh."""
    world = dist.group.WORLD
    for stale in [k for k in _SHARED if k[0] is not world]:
        del _SHARED[stale]  # made under a default group that was destroyed with its subgroups
    full = (world, *key)
    if full not in _SHARED:
        _SHARED[full] = make()
    return _SHARED[full]


def resolve_layout(
    *,
    world_size: int,
    num_nodes: int,
    pipeline_parallel_size: Union[int, Literal["auto"], None],
    data_parallel_size: Union[int, Literal["auto"], None],
    zero_stage: int,
    schedule: str,
    stages_per_rank: Union[int, None],
    num_microbatches: Union[int, None],
    tensor_parallel_size: int = 1,
    torch_schedule: bool = True,
) -> Layout:
    """Turn the user's (possibly ``"auto"``) sizes into a checked :class:`Layout` (:meth:`LayoutRequest.resolve`).

    ``"auto"`` pipeline size means one stage per node (data-parallel ranks stay inside a node); ``"auto"``
    data-parallel size takes whatever the pipeline leaves of the world.
    """
    check_choices(schedule=schedule, zero_stage=zero_stage)
    spec = SCHEDULES[schedule]

    pp, tp = pipeline_parallel_size, tensor_parallel_size
    dp = "auto" if data_parallel_size is None else data_parallel_size
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
    if world_size % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide the world size ({world_size}).")
    world_size //= tp  # pipeline x data parallelism share what tensor parallelism leaves
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
            usable = ", ".join(str(pp * tp * n) for n in range(1, 5))
            what = f"pipeline_parallel_size ({pp})" + (f" x tensor_parallel_size ({tp})" if tp > 1 else "")
            raise ValueError(
                f"{what} must divide the world size ({world_size * tp}): this layout runs on"
                f" {usable}, ... processes (a multiple of {pp * tp}); choose a divisor of {world_size} as"
                " pipeline_parallel_size or change the number of processes (a resume reshards the checkpoint onto"
                " either)."
            )
        dp = world_size // pp
    _check_positive("data_parallel_size", dp)
    if pp * dp != world_size:
        raise ValueError(
            f"pipeline_parallel_size ({pp}) x data_parallel_size ({dp}) = {pp * dp} must equal the world size"
            f" ({world_size * tp}{f' / tensor_parallel_size {tp}' if tp > 1 else ''}); set one of them to 'auto'."
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
    if pp > 1 and torch_schedule:
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
    return Layout(pp, dp, zero_stage, schedule, stages_per_rank, num_microbatches, tp)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}.")


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
