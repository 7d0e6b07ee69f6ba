"""ZeRO-3: FSDP2 ``fully_shard`` on the data-parallel sub-mesh.

A unit's parameters are gathered just before it runs and freed after. A block is one unit, or each of its
parameter-holding children is (``shard_units``; by default a block is one unit when its parameters fit in
``bucket_size_mb``); each stage (or, without a pipeline, the whole module) is the root. Under bf16 mixed
precision parameters are gathered in bf16 and gradients reduced in fp32, the usual FSDP recipe.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = [
    "ShardingPlan",
    "UnitGradients",
    "check_fully_shardable",
    "planned_units",
    "shard_fully",
    "splits_block",
    "unit_of",
]


def check_fully_shardable(module: nn.Module, units: str, limit_mb: float, *, pipelined: bool) -> None:
    """Refuse, with the names, what FSDP2 cannot shard; called on the whole module (before a pipeline cuts it),
    so every rank raises the same error."""
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"zero_stage=3 (FSDP2) cannot shard 0-dim parameters ({', '.join(scalars[:3])}): use zero_stage 0, 1 or 2"
            " (which keep them exact), or make each a 1-D tensor of one element."
        )
    plan = planned_units(module, units, limit_mb, pipelined=pipelined)
    dtypes: dict[str, dict[torch.dtype, str]] = {}
    for name, p in module.named_parameters():
        dtypes.setdefault(unit_of(name, plan), {}).setdefault(p.dtype, name)
    mixed = next(((unit, found) for unit, found in dtypes.items() if len(found) > 1), None)
    if mixed is not None:
        unit, found = mixed
        held = ", ".join(f"{name} ({str(dtype).removeprefix('torch.')})" for dtype, name in found.items())
        raise ValueError(
            f"zero_stage=3 (FSDP2) gathers each unit's parameters as one buffer of one dtype, and the unit"
            f" {unit or type(module).__name__ + ' (its own parameters)'} holds {held}. Give the parameters of one"
            " block one dtype, put each dtype in a child module of its own (with ZeroConfig(shard_units='auto')"
            " or 'submodules' each child is a unit), or use zero_stage 0, 1 or 2."
        )


def planned_units(module: nn.Module, units: str, limit_mb: float, *, pipelined: bool) -> list[str]:
    """The FSDP2 units :func:`shard_fully` makes of ``module``, by module path (``""``: the root, which a pipeline
    stage is for its blocks)."""
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    prefix = "layers." if layers is not None else ""
    out = [""]
    for name, block in (layers if layers is not None else module).named_children():
        if not (pipelined or any(p.requires_grad for p in block.parameters())):
            continue  # shard_fully leaves it in the root's unit
        out.append(f"{prefix}{name}")
        if splits_block(block, units, limit_mb):
            out += [
                f"{prefix}{name}.{child_name}"
                for child_name, child in block.named_children()
                if _units(child) and any(True for _ in child.parameters())
            ]
    return out


def unit_of(name: str, plan: list[str]) -> str:
    """The unit of ``plan`` (:func:`planned_units`) that shards parameter ``name``: its innermost enclosing one."""
    return max((u for u in plan if u == "" or name.startswith(f"{u}.")), key=len)


def _units(module: nn.Module) -> list[nn.Module]:
    """``[module]`` if it runs (has its own forward); a ModuleList or ModuleDict (of experts, branches, heads)
    is no unit FSDP2 can hook, and its members may run on some replicas only (a unit must run on every
    replica): their parameters stay in the enclosing block's unit."""
    return [module] if type(module).forward is not nn.Module.forward else []


def splits_block(block: nn.Module, units: str, limit_mb: float) -> bool:
    """Whether ``block``'s parameter-holding children are its FSDP2 units (else the block is one unit).

    ``"auto"``: a block whose parameters (as stored) exceed ``limit_mb`` is split, so FSDP2's working set
    (the gathered unit, its unsharded gradient, the prefetched next unit) stays a fraction of a large block;
    a smaller block is one unit, so its collectives are few and large rather than many and latency-bound. A block
    whose parameters have several dtypes is split too (FSDP2 gathers one dtype per unit)."""
    if units != "auto":
        return units == "submodules"
    params = list(block.parameters())
    mixed = len({p.dtype for p in params}) > 1  # one unit gathers one dtype: each child its own, where it can
    return mixed or sum(p.numel() * p.element_size() for p in params) > limit_mb * 2**20


class ShardingPlan:
    """How this job shards a block: the mesh, the mixed-precision policy, when to reshard.

    ``reshard_after_forward``: free a block's gathered parameters after its forward (gather them again for
    backward and for every pipeline micro-batch), or keep them gathered until the step ends.
    ``units``: ``"blocks"``, ``"submodules"`` (each child of a block that holds parameters) or ``"auto"``
    (:func:`splits_block` with ``unit_limit_mb``)."""

    def __init__(
        self, mesh: DeviceMesh, *, bf16: bool, reshard_after_forward: bool, units: str, unit_limit_mb: float
    ) -> None:
        self.units, self.unit_limit_mb = units, unit_limit_mb
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        self.kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": policy or MixedPrecisionPolicy(),
            "reshard_after_forward": reshard_after_forward,
        }

    def shard(self, unit: nn.Module) -> None:
        if not isinstance(unit, FSDPModule):  # a block sharded as soon as it was materialised stays as it is
            fully_shard(unit, **self.kwargs)

    def shard_block(self, block: nn.Module) -> None:
        """Shard one block: its parameter-holding children first when the units are submodules."""
        for p in block.parameters():
            if not p.is_contiguous():  # FSDP2 shards contiguous storage: same values, row-major strides
                p.data = p.data.contiguous()
        if not isinstance(block, FSDPModule) and splits_block(block, self.units, self.unit_limit_mb):
            for child in block.children():
                for unit in _units(child):
                    if any(True for _ in unit.parameters()):
                        self.shard(unit)
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
    FSDP2: its all-gather would wait; keep such a module inside a block's unit (``shard_units="blocks"``)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
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
    units = list(layers.children()) if layers is not None else list(module.children())
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            plan.shard_block(unit)
    plan.shard(module)
