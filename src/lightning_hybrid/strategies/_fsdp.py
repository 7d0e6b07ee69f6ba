"""ZeRO-3: FSDP2 ``fully_shard`` on the data-parallel sub-mesh.

Each parameter-holding child of a block is a unit (its parameters are gathered just before it runs and
freed after), or with ``shard_units="blocks"`` each block is; each stage (or, without a pipeline,
the whole module) is the root. Under bf16 mixed precision parameters are
gathered in bf16 and gradients reduced in fp32, the usual FSDP recipe.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["ShardingPlan", "shard_fully"]


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
        if self.units == "submodules" and not isinstance(block, FSDPModule):
            for child in block.children():
                if any(True for _ in child.parameters()):
                    self.shard(child)
        self.shard(block)


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
