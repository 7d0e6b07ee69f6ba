"""What HybridParallelStrategy puts into a sharded checkpoint, and how it takes it back in any layout.

The model's state has the unsplit module's parameter names (each stage keeps its blocks' original
names); the optimizer state is DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
``param_groups.<fqn>.<key>``), the same for every ZeRO stage. Under ZeRO-1/2 a rank contributes only its
flat slice of each tensor (:class:`FlatShard`), and reads back only the slice it owns in its own layout.
The folder format itself (files, manifest, safe reading) is ``lightning_hybrid.checkpoint``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_hybrid.checkpoint._safe_load import DCP_METADATA
from lightning_hybrid.checkpoint._sharded import read_meta, read_sharded, read_sharded_index
from lightning_hybrid.strategies._grad_sync import GradientSync
from lightning_hybrid.strategies._zero import FlatShardedOptimizer

__all__ = ["load_sharded_checkpoint", "model_state", "optimizer_state"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(module: nn.Module, sync: GradientSync) -> dict[str, Any]:
    state = get_model_state_dict(module)
    # ZeRO-1/2: each replica saves its slice of the parameters instead of all of them
    state.update({k: v for k, v in sync.parameter_shards().items() if k in state})
    return state


def optimizer_state(module: nn.Module, optimizer: Optimizer, sync: GradientSync) -> dict[str, Any]:
    sharded = sync.sharded_optimizer(optimizer)
    if sharded is not None:
        return sharded.flat_state_dict()
    return get_optimizer_state_dict(module, optimizer, options=_FLAT)


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    sync: GradientSync,
    *,
    strict: bool,
) -> dict[str, Any]:
    """Load model (and, when ``optimizers`` are given, optimizer) state from ``path`` into this rank's layout,
    in place. Returns the rest of the checkpoint (``meta.pt``)."""
    if not (path / DCP_METADATA).is_file():
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint written by HybridParallelStrategy (no {DCP_METADATA} file); it may"
            " be incomplete. Pass the checkpoint folder that `trainer.save_checkpoint` created."
        )
    saved = read_sharded_index(path).state_dict_metadata

    # the model: DCP reshards whatever layout wrote it into this rank's tensors (plain or DTensor)
    current = get_model_state_dict(module)
    missing = [k for k in current if f"state_dict.{k}" not in saved]
    if missing and strict:
        raise KeyError(f"The checkpoint at {path} has no values for {missing[:5]} (strict_loading=True)")
    to_load: dict[str, Any] = {"state_dict": {k: v for k, v in current.items() if k not in missing}}
    templates = {}
    for idx, optimizer in enumerate(optimizers):
        template = _optimizer_template(module, optimizer, sync.sharded_optimizer(optimizer), saved, f"optimizer_{idx}")
        if template:
            templates[idx] = to_load[f"optimizer_{idx}"] = template
    read_sharded(path, to_load)

    set_model_state_dict(module, to_load["state_dict"], options=StateDictOptions(strict=False))
    for idx, template in templates.items():
        sharded = sync.sharded_optimizer(optimizers[idx])
        if sharded is not None:
            sharded.load_parameters_into_shards()
            sharded.load_flat_state_dict(template)
        else:
            set_optimizer_state_dict(module, optimizers[idx], template, options=_FLAT)
    for optimizer in optimizers:
        sharded = sync.sharded_optimizer(optimizer)
        if sharded is not None:
            sharded.load_parameters_into_shards()
    return read_meta(path)  # tensors and plain values only: loading a checkpoint never runs code


def _optimizer_template(
    module: nn.Module,
    optimizer: Optimizer,
    sharded: FlatShardedOptimizer | None,
    saved: Mapping[str, Any],
    prefix: str,
) -> dict[str, Any]:
    """This rank's part of the flat, name-keyed optimizer state, shaped as the checkpoint stores it."""
    if sharded is None:
        current = get_optimizer_state_dict(module, optimizer, options=_FLAT)
        return {k: v for k, v in current.items() if f"{prefix}.{k}" in saved}
    names = {n for g in sharded.groups for n in g.names}
    template: dict[str, Any] = {}
    for key, meta in saved.items():
        if not key.startswith(prefix + "."):
            continue
        sub = key[len(prefix) + 1 :]
        _section, _, rest = sub.partition(".")
        if not any(rest.startswith(n + ".") for n in names):
            continue
        if isinstance(meta, TensorStorageMetadata):
            # a per-element state loads only this rank's slice; scalars load whole
            name, _, state_key = rest.rpartition(".")
            part = sharded.state_template(name, meta.size, meta.properties.dtype, key=f"{_section}.{state_key}")
            template[sub] = part if part is not None else torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            template[sub] = None
    return template
