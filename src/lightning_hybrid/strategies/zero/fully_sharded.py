"""ZeRO-3: FSDP2 ``fully_shard`` on the data-parallel sub-mesh.

Each parameter-holding child of a block is a unit (its parameters are gathered just before it runs and
freed after), or with ``shard_units="blocks"`` each block is; each stage (or, without a pipeline,
the whole module) is the root. Under bf16 mixed precision parameters are
gathered in bf16 and gradients reduced in fp32, the usual FSDP recipe.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["ShardingPlan", "UnitGradients", "check_fully_shardable", "shard_fully"]


def check_fully_shardable(module: nn.Module) -> None:
    """Refuse, with the names, what FSDP2 cannot shard; called on the whole module (before a pipeline cuts it),
    so every rank raises the same error."""
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"zero_stage=3 (FSDP2) cannot shard 0-dim parameters ({', '.join(scalars[:3])}): use zero_stage 0, 1 or 2"
            " (which keep them exact), or make each a 1-D tensor of one element."
        )


def _units(module: nn.Module) -> list[nn.Module]:
    """``[module]`` if it runs (has its own forward); a ModuleList or ModuleDict (of experts, branches, heads)
    is no unit FSDP2 can hook, and its members may run on some replicas only (a unit must run on every
    replica): their parameters stay in the enclosing block's unit."""
    return [module] if type(module).forward is not nn.Module.forward else []


class ShardingPlan:
    """How this job shards a block: the mesh, the mixed-precision policy, when to reshard.

    ``reshard_after_forward``: free a block's gathered parameters after its forward (gather them again for
    backward and for every pipeline micro-batch), or keep them gathered until the step ends.
    ``units``: ``"blocks"`` or ``"submodules"`` (each child of a block that holds parameters)."""

    def __init__(self, mesh: DeviceMesh, *, bf16: bool, reshard_after_forward: bool, units: str) -> None:
        self.units = units
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
        if self.units == "submodules" and not isinstance(block, FSDPModule):
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
