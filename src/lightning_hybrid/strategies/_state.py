"""What HybridParallelStrategy puts into a sharded checkpoint, and how it takes it back in any layout.

The model's state has the unsplit module's parameter names (each stage keeps its blocks' original
names); the optimizer state is DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
``param_groups.<fqn>.<key>``), the same for every ZeRO stage. Under ZeRO-1/2 a rank contributes only its
flat slice of each tensor (:class:`FlatShard`), and reads back only the slice it owns in its own layout.
A parameter tied across blocks is stored once, under its first name (:class:`CheckpointNames`).
The folder format itself (files, manifest, safe reading) is ``lightning_hybrid.checkpoint``'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
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

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid._protocols import ShardedCheckpointing
from lightning_hybrid.checkpoint._safe_load import DCP_METADATA
from lightning_hybrid.checkpoint._sharded import (
    LAYOUT_KEY,
    read_meta,
    read_sharded,
    read_sharded_index,
    split_checkpoint,
    write_sharded,
)
from lightning_hybrid.strategies._grad_sync import GradientSync
from lightning_hybrid.strategies._tied import CheckpointNames
from lightning_hybrid.strategies._zero import FlatShardedOptimizer

__all__ = [
    "ShardedCheckpointIO",
    "checkpoint_folder",
    "load_sharded_checkpoint",
    "model_state",
    "optimizer_state",
    "save_sharded_checkpoint",
]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(module: nn.Module, sync: GradientSync, names: CheckpointNames) -> dict[str, Any]:
    state = get_model_state_dict(module)
    # ZeRO-1/2: each replica saves its slice of the parameters instead of all of them
    state.update({k: v for k, v in sync.parameter_shards().items() if k in state})
    return names.to_store(state)


def optimizer_state(
    module: nn.Module, optimizer: Optimizer, sync: GradientSync, names: CheckpointNames
) -> dict[str, Any]:
    sharded = sync.sharded_optimizer(optimizer)
    if sharded is not None:
        return names.to_store(sharded.flat_state_dict())
    return names.to_store(get_optimizer_state_dict(module, optimizer, options=_FLAT))


class ShardedCheckpointIO:
    """``save_checkpoint`` for a Strategy whose checkpoints are the pack's sharded folders: mixed into a
    Strategy that implements :class:`ShardedCheckpointing` (it says its ``checkpoint_layout()``)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (it writes torch DCP).")
        if not (isinstance(self, Strategy) and isinstance(self, ShardedCheckpointing)):
            raise TypeError(
                f"{type(self).__name__} mixes in ShardedCheckpointIO but is no Strategy with checkpoint_layout()"
            )
        save_sharded_checkpoint(self, checkpoint, filepath, self.checkpoint_layout())


def checkpoint_folder(strategy: Strategy, checkpoint_path: str | os.PathLike) -> Path:
    """The folder every rank reads: rank 0 resolves links (``last.ckpt``), whatever each node caches."""
    return Path(strategy.broadcast(str(Path(checkpoint_path).resolve())))


def save_sharded_checkpoint(
    strategy: Strategy, checkpoint: dict[str, Any], filepath: str | os.PathLike, layout: dict[str, Any]
) -> None:
    """Write Lightning's ``checkpoint`` dict as a sharded folder at ``filepath`` (every rank calls it)."""
    path = Path(strategy.broadcast(str(filepath)))  # one folder for every rank
    problem = None
    if strategy.is_global_zero:
        try:
            path.mkdir(parents=True, exist_ok=True)
            # rewriting a folder: without the old index it never looks whole while the new one is written
            (path / DCP_METADATA).unlink(missing_ok=True)
        except OSError as exc:  # a file there, no permission: every rank fails the same way
            problem = f"cannot write a sharded checkpoint (a folder) at {path}: {exc}"
    problem = strategy.broadcast(problem)
    if problem:
        raise OSError(problem)
    tensors, meta = split_checkpoint(checkpoint)
    meta[LAYOUT_KEY] = layout
    write_sharded(path, tensors, meta if strategy.is_global_zero else None)
    strategy.barrier(f"{type(strategy).__name__}.save_checkpoint.done")


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    sync: GradientSync,
    names: CheckpointNames,
    *,
    strict: bool,
    device: torch.device,
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
    # (a tied parameter held under another name than its first is read from where it is stored)
    current, model_back = names.to_read(get_model_state_dict(module))
    missing = [k for k in current if f"state_dict.{k}" not in saved]
    meta = read_meta(path)  # tensors and plain values only: loading a checkpoint never runs code
    written = CheckpointNames.from_json((meta.get(LAYOUT_KEY) or {}).get("tied_parameters", []))
    untied = [k for k in missing if k in written.aliases]
    problem = None
    if untied:
        problem = (
            f"{untied[0]} was tied to {written.aliases[untied[0]]} when {path} was written (stored once, under"
            " the first name), and this model holds it as a separate parameter. Tie it again as it was, or start"
            " from the checkpoint with init_from= (each name then reads the stored tensor, no optimizer state)."
        )
    elif missing and strict:
        problem = f"The checkpoint at {path} has no values for {missing[:5]} (strict_loading=True)"
    separate = [a for a in names.aliases if f"state_dict.{a}" in saved]
    if separate:  # written before the parameter was tied (or by an older version): the first name wins
        rank_zero_warn(
            f"{path} holds {separate[0]} apart from {names.aliases[separate[0]]}, which this model ties to it: both"
            f" names take the value stored under {names.aliases[separate[0]]}."
        )
    # each pipeline rank checks its own stages: agree, so every rank fails with the message, none waits
    problem = agreed_problem(problem, device=device)
    if problem:
        raise KeyError(problem)
    to_load: dict[str, Any] = {"state_dict": {k: v for k, v in current.items() if k not in missing}}
    templates = {}
    for idx, optimizer in enumerate(optimizers):
        sharded = sync.sharded_optimizer(optimizer)
        template = _optimizer_template(module, optimizer, sharded, saved, f"optimizer_{idx}", names)
        if template[0]:
            templates[idx] = template
            to_load[f"optimizer_{idx}"] = template[0]
    read_sharded(path, to_load)

    model = {model_back[k]: v for k, v in to_load["state_dict"].items()}
    set_model_state_dict(module, model, options=StateDictOptions(strict=False))
    for idx, (_template, back) in templates.items():
        local = {back[k]: v for k, v in to_load[f"optimizer_{idx}"].items()}
        sharded = sync.sharded_optimizer(optimizers[idx])
        if sharded is not None:
            sharded.load_parameters_into_shards()
            sharded.load_flat_state_dict(local)
        else:
            set_optimizer_state_dict(module, optimizers[idx], local, options=_FLAT)
    for optimizer in optimizers:
        sharded = sync.sharded_optimizer(optimizer)
        if sharded is not None:
            sharded.load_parameters_into_shards()
    return meta


def _optimizer_template(
    module: nn.Module,
    optimizer: Optimizer,
    sharded: FlatShardedOptimizer | None,
    saved: Mapping[str, Any],
    prefix: str,
    names: CheckpointNames,
) -> tuple[dict[str, Any], dict[str, str]]:
    """This rank's part of the flat, name-keyed optimizer state, keyed and shaped as the checkpoint stores it,
    and the way back to this rank's keys."""
    if sharded is None:
        current, back = names.to_read(get_optimizer_state_dict(module, optimizer, options=_FLAT))
        return {k: v for k, v in current.items() if f"{prefix}.{k}" in saved}, back
    # the parameter each stored name stands for here (a tied one may be held under another name)
    local = {names.stored_key(n): n for g in sharded.groups for n in g.names}
    template: dict[str, Any] = {}
    back: dict[str, str] = {}
    for key, meta in saved.items():
        if not key.startswith(prefix + "."):
            continue
        sub = key[len(prefix) + 1 :]
        section, _, rest = sub.partition(".")
        stored, _, state_key = rest.rpartition(".")
        if stored not in local:
            continue
        name = local[stored]
        back[sub] = f"{section}.{name}.{state_key}"
        if isinstance(meta, TensorStorageMetadata):
            # a per-element state loads only this rank's slice; scalars load whole
            part = sharded.state_template(name, meta.size, meta.properties.dtype, key=f"{section}.{state_key}")
            template[sub] = part if part is not None else torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            template[sub] = None
    return template, back
