"""ZeRO-3: FSDP2 ``fully_shard`` on the data-parallel sub-mesh.

A unit's parameters are gathered just before it runs and freed after. A block is one unit, or each of its
parameter-holding children is (``shard_units``; by default a block is one unit when its parameters fit in
``bucket_size_mb``); each stage (or, without a pipeline, the whole module) is the root. Under bf16 mixed
precision parameters are gathered in bf16 and gradients reduced in fp32, the usual FSDP recipe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_hybrid._torch_compat import post_accumulate_hooks, tensor_hooks
from lightning_hybrid.contract import has_forward
from lightning_hybrid.strategies._params import attributes_kept

__all__ = [
    "ShardingPlan",
    "UnitGradients",
    "UnitRule",
    "check_fully_shardable",
    "planned_units",
    "shard_fully",
    "unit_of",
]


@dataclass(frozen=True)
class UnitRule:
    """Which blocks are split into their children (``shard_units``, ``bucket_size_mb`` as ``limit_mb``);
    ``cast``: the dtype every floating parameter has when it is sharded (a ``*-true`` precision), if any."""

    units: str
    limit_mb: float
    cast: torch.dtype | None = None

    def splits(self, block: nn.Module) -> bool:
        """Whether ``block``'s parameter-holding children are its FSDP2 units (else the block is one unit).

        ``"auto"``: a block whose parameters exceed ``limit_mb`` is split, so FSDP2's working set (the gathered
        unit, its unsharded gradient, the prefetched next unit) stays a fraction of a large block; a smaller
        block is one unit, so its collectives are few and large rather than many and latency-bound. A block
        whose trainable parameters have several dtypes is split too (FSDP2 needs one per unit)."""
        if isinstance(block, FSDPModule):
            return False  # already sharded (a block sharded when it was materialised, or by the user)
        if self.units != "auto":
            return self.units == "submodules"
        params = list(block.parameters())
        mixed = len({self.dtype(p) for p in params if p.requires_grad}) > 1
        return mixed or sum(p.numel() * self.dtype(p).itemsize for p in params) > self.limit_mb * 2**20

    def dtype(self, param: Tensor) -> torch.dtype:
        return self.cast if self.cast is not None and param.is_floating_point() else param.dtype


def check_fully_shardable(module: nn.Module, rule: UnitRule, plan: list[str], *, pipelined: bool) -> None:
    """Refuse, with the names, what FSDP2 cannot shard into the units of ``plan`` (:func:`planned_units`);
    called on the whole module (before a pipeline cuts it), so every rank raises the same error."""
    hooked = [n for n, p in module.named_parameters() if tensor_hooks(p) or post_accumulate_hooks(p)]
    if hooked:
        raise ValueError(
            f"zero_stage=3 (FSDP2) replaces each parameter by its sharded DTensor and reduce-scatters gradients"
            f" outside autograd's accumulation, so the tensor hooks registered on {', '.join(hooked[:3])}"
            " (param.register_hook / register_post_accumulate_grad_hook) would never run. Edit the gradient in the"
            " model instead (a custom autograd function, or a module's register_full_backward_hook), or use"
            " zero_stage 0, 1 or 2, which keep the parameter and run its hooks."
        )
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"zero_stage=3 (FSDP2) cannot shard 0-dim parameters ({', '.join(scalars[:3])}): use zero_stage 0, 1 or 2"
            " (which keep them exact), or make each a 1-D tensor of one element."
        )
    containers = [u for u in plan if u and not has_forward(module.get_submodule(u))]
    if containers:
        raise ValueError(
            f"zero_stage=3 (FSDP2) shards each block as a unit, and {', '.join(containers[:3])} has no forward"
            " (a ModuleList or ModuleDict), which FSDP2 cannot hook. Wrap its members in a module whose forward"
            " runs them, or use zero_stage 0, 1 or 2."
        )
    dtypes: dict[str, dict[torch.dtype, str]] = {}
    for name, p in module.named_parameters():
        unit = unit_of(name, plan)
        if p.requires_grad and not (pipelined and unit == ""):  # a pipeline shards its stages' blocks only
            dtypes.setdefault(unit, {}).setdefault(rule.dtype(p), name)
    mixed = next(((unit, found) for unit, found in dtypes.items() if len(found) > 1), None)
    if mixed is not None:
        unit, found = mixed
        held = ", ".join(f"{name} ({str(dtype).removeprefix('torch.')})" for dtype, name in found.items())
        raise ValueError(
            "zero_stage=3 (FSDP2) needs one dtype among the trainable parameters of each unit (it fails at the"
            f" first forward otherwise), and the unit {unit or type(module).__name__ + ' (its own parameters)'}"
            f" holds {held}. Give them one dtype, put each dtype in a child module of its own (under"
            " ZeroConfig(shard_units='auto') or 'submodules' each child of a block that has a forward is a"
            " unit), or use zero_stage 0, 1 or 2."
        )


def planned_units(module: nn.Module, rule: UnitRule, *, pipelined: bool, meta_built: bool = False) -> list[str]:
    """The FSDP2 units :func:`shard_fully` makes of ``module``, by module path; ``""``: the root (a pipeline
    stage's own). A pipeline's stages, and a module built on the meta device (each block of ``self.layers``
    sharded as it is materialised), make every block holding parameters a unit, frozen ones too."""
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    prefix = "layers." if layers is not None else ""
    out = [""]
    for name, block in (layers if layers is not None else module).named_children():
        if not _shards_alone(block, every_block=layers is not None and (pipelined or meta_built)):
            continue  # left in the root's unit
        out.append(f"{prefix}{name}")
        if rule.splits(block):
            out += [f"{prefix}{name}.{n}" for n, child in block.named_children() if _unit_child(child)]
        out += [f"{prefix}{name}.{n}" for n, m in block.named_modules() if n and isinstance(m, FSDPModule)]
    return list(dict.fromkeys(out))


def unit_of(name: str, plan: list[str]) -> str:
    """The unit of ``plan`` (:func:`planned_units`) that shards parameter ``name``: its innermost enclosing one."""
    return max((u for u in plan if u == "" or name.startswith(f"{u}.")), key=len)


def _shards_alone(block: nn.Module, *, every_block: bool) -> bool:
    """Whether a block is a unit of its own: one with trainable parameters (a frozen one stays in the root's
    unit, so unfreezing it later changes nothing for FSDP2), or with ``every_block`` any holding parameters."""
    if every_block:
        return any(True for _ in block.parameters())
    return any(p.requires_grad for p in block.parameters())


def _unit_child(child: nn.Module) -> bool:
    """A child of a split block is a unit if it runs (has its own forward: a ModuleList or ModuleDict of experts,
    branches or heads is no unit FSDP2 can hook, and its members may run on some replicas only, where a unit
    must run on every replica; their parameters stay in the block's unit) and holds parameters."""
    return has_forward(child) and any(True for _ in child.parameters())


class ShardingPlan:
    """How this job shards a block: the mesh, the mixed-precision policy, when to reshard, the units.

    ``reshard_after_forward``: free a block's gathered parameters after its forward (gather them again for
    backward and for every pipeline micro-batch), or keep them gathered until the step ends.
    ``rule``: which blocks are split into their children (:class:`UnitRule`)."""

    def __init__(self, mesh: DeviceMesh, *, bf16: bool, reshard_after_forward: bool, rule: UnitRule) -> None:
        self.rule = rule
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        self.kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": policy or MixedPrecisionPolicy(),
            "reshard_after_forward": reshard_after_forward,
        }

    @property
    def casts_for_compute(self) -> bool:
        """FSDP2 gathers parameters in another dtype for compute (bf16): it fixes each unit's gradient dtype."""
        return self.kwargs["mp_policy"].param_dtype is not None

    def shard(self, unit: nn.Module) -> None:
        if not isinstance(unit, FSDPModule):  # a block sharded as soon as it was materialised stays as it is
            with attributes_kept(unit):  # FSDP2 makes new (sharded) parameters
                fully_shard(unit, **self.kwargs)

    def shard_block(self, block: nn.Module) -> None:
        """Shard one block: first its parameter-holding children, when the rule splits it."""
        for p in block.parameters():
            if not p.is_contiguous():  # FSDP2 shards contiguous storage: same values, row-major strides
                p.data = p.data.contiguous()
        if self.rule.splits(block):
            for child in block.children():
                if _unit_child(child):
                    self.shard(child)
        self.shard(block)


class UnitGradients:
    """ZeRO-3 with parameters some replicas do not use (a routed expert no token reached, a branch not taken).

    FSDP2 reduce-scatters the gradients of a unit's parameters *that have one*: two replicas that used
    different parameters would pair different tensors in the collective (wrong values, or a hang). Every unit
    is set to reduce a zero gradient for a parameter without one (``set_reduce_scatter_unused_params``, torch's
    counterpart of DDP's ``find_unused_parameters``), so every replica reduces the same tensors and the mean is
    what one process computes.

    A parameter no replica used must not be stepped either (a zero gradient would still move it under weight
    decay and momentum). Each unit's inputs pass through a function whose backward runs just before FSDP2's
    reduction of that unit, where the parameters with a gradient are noted; when the window closes,
    :meth:`unused_everywhere` agrees on those no replica used (one all-reduce) and their gradients are dropped.
    Parameters of a unit whose inputs need no gradient (the first unit: token ids) count as used. A unit
    that runs on some replicas only (layer drop, an optional adapter as its own unit) cannot be sharded by
    FSDP2: its all-gather would wait; keep such a module inside a block's unit (``shard_units="blocks"``:
    under ``"auto"`` a child of a block is a unit once the block outgrows ``bucket_size_mb``)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, cast_for_compute: bool = False) -> None:
        self.group = group
        self.used: set[str] = set()
        self.watched: set[str] = set()  # parameters of units whose inputs carry the hook
        self.names: list[str] = []  # every unit's own trainable parameters: the flag vector, fixed
        for prefix, unit in module.named_modules():
            if isinstance(unit, FSDPModule):
                unit.set_reduce_scatter_unused_params(True, recurse=False)
                own = [(f"{prefix}.{n}" if prefix else n) for n, p in _own_parameters(unit) if p.requires_grad]
                if own:
                    self.names += own
                    unit.register_forward_pre_hook(functools.partial(self._pre_forward, prefix, unit, own))
                elif cast_for_compute and _own_parameters(unit):
                    unit.register_forward_pre_hook(functools.partial(_refuse_unfrozen, prefix or "root"))

    def _pre_forward(
        self, prefix: str, unit: nn.Module, own: list[str], module: nn.Module, args: tuple[Any, ...]
    ) -> Any:
        if not torch.is_grad_enabled():
            return None
        hit = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not hit:
            return None  # no input to hook (token ids): the unit's parameters count as used
        self.watched.update(own)
        passed = _NoteUsed.apply(self, prefix, unit, *(args[i] for i in hit))
        out = list(args)
        for i, t in zip(hit, passed if isinstance(passed, tuple) else (passed,)):
            out[i] = t
        return tuple(out)

    def note(self, prefix: str, unit: nn.Module) -> None:
        for name, p in _own_parameters(unit):
            if p.grad is not None:
                self.used.add(f"{prefix}.{name}" if prefix else name)

    def unused_everywhere(self, names: set[str], device: torch.device) -> set[str]:
        """Which of ``names`` (an optimizer's parameters) no replica used in the window: one all-reduce of a flag
        per unit parameter, the same vector on every replica. Forgets the window of those names."""
        flags = torch.tensor([float(n in self.used or n not in self.watched) for n in self.names], device=device)
        self.used -= names
        if flags.numel():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return {n for n, f in zip(self.names, flags.tolist()) if not f and n in names}


def _refuse_unfrozen(name: str, unit: nn.Module, args: tuple[Any, ...]) -> None:
    """A unit with no trainable parameter when FSDP2 first ran it, under a parameter dtype for compute (bf16
    mixed precision): FSDP2 fixed its gradient dtype then, and a backward through a parameter made trainable
    since fails inside FSDP2. Every rank unfreezes alike (a callback), so every rank refuses here alike."""
    if not torch.is_grad_enabled():
        return
    trainable = [f"{name}.{n}" for n, p in _own_parameters(unit) if p.requires_grad]
    if trainable:
        raise RuntimeError(
            f"{name} was frozen when zero_stage=3 sharded it as its own FSDP2 unit (it was built on the meta"
            f" device, or in a pipeline stage), and now {', '.join(trainable[:3])} trainable: under bf16-mixed"
            " FSDP2 fixed the unit's gradient dtype at its first forward, and its backward would fail. Leave"
            " it trainable from the start (with a learning rate of 0 until it should learn), build the model"
            " without the meta device and the pipeline, or use zero_stage 0, 1 or 2."
        )


class _NoteUsed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, owner: UnitGradients, prefix: str, unit: nn.Module, *tensors: Tensor) -> Any:
        ctx.owner, ctx.prefix, ctx.unit = owner, prefix, unit
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.owner.note(ctx.prefix, ctx.unit)  # the unit's parameter gradients are accumulated by now
        return (None, None, None, *grads)


def _own_parameters(unit: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters FSDP2 manages in ``unit`` itself (not in units nested inside it)."""
    out: list[tuple[str, nn.Parameter]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, p in module.named_parameters(recurse=False):
            out.append((f"{prefix}{name}", p))
        for name, child in module.named_children():
            if not isinstance(child, FSDPModule):
                walk(child, f"{prefix}{name}.")

    walk(unit, "")
    return out


def shard_fully(module: nn.Module, *, stages: list[nn.Module] | None, plan: ShardingPlan) -> None:
    """Shard ``module`` in place: the blocks of each pipeline stage, or of ``module.layers`` without one."""
    if stages:
        for stage in stages:
            for block in stage.blocks:
                plan.shard_block(block)
            plan.shard(stage)
        return
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    for block in layers.children() if layers is not None else module.children():
        if _shards_alone(block, every_block=False):  # blocks sharded as they were materialised stay units
            plan.shard_block(block)
    plan.shard(module)
