"""ZeRO-3: FSDP2 ``fully_shard`` on the data-parallel sub-mesh.

Each block is a unit (its parameters are gathered just before it runs and freed after) and each stage
(or, without a pipeline, the whole module) is the root. Under bf16 mixed precision parameters are
gathered in bf16 and gradients reduced in fp32, the usual FSDP recipe.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["shard_fully"]


def shard_fully(module: nn.Module, *, stages: list[nn.Module] | None, mesh: DeviceMesh, bf16: bool) -> None:
    """Shard ``module`` in place: the blocks of each pipeline stage, or of ``module.layers`` without one."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, "mp_policy": policy or MixedPrecisionPolicy(), "reshard_after_forward": True}
    if stages:
        for stage in stages:
            for block in stage.blocks:
                fully_shard(block, **kwargs)
            fully_shard(stage, **kwargs)
        return
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    units = list(layers.children()) if layers is not None else list(module.children())
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
