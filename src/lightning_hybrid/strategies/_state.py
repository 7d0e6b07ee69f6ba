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
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.optim import Optimizer

from lightning_hybrid._agree import agree, raise_agreed
from lightning_hybrid._protocols import ShardedCheckpointing
from lightning_hybrid.checkpoint._sharded import (
    GROUP_INDEX,
    LAYOUT_KEY,
    agreed_checkpoint_folder,
    checkpoint_folder,
    missing_values,
    read_meta,
    read_sharded,
    read_sharded_index,
    save_sharded_checkpoint,
)
from lightning_hybrid.checkpoint.tied_names import CheckpointNames
from lightning_hybrid.strategies.tensor.local import plain, state_name, tensor_slices, whole
from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer
from lightning_hybrid.strategies.zero.grad_sync import GradientSync

__all__ = [
    "ShardedCheckpointIO",
    "load_sharded_checkpoint",
    "model_state",
    "optimizer_state",
]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(module: nn.Module, sync: GradientSync, names: CheckpointNames) -> dict[str, Any]:
    state = whole(get_model_state_dict(module), tensor_slices(module))  # tensor-parallel slices: unsplit names
    # ZeRO-1/2: each replica saves its slice of the parameters instead of all of them
    state.update({k: v for k, v in sync.parameter_shards().items() if k in state})
    return names.to_store(state)


def optimizer_state(
    module: nn.Module, optimizer: Optimizer, sync: GradientSync, names: CheckpointNames
) -> dict[str, Any]:
    sharded = sync.sharded_optimizer(optimizer)
    if sharded is not None:
        flat = sharded.flat_state_dict()
    else:
        flat = whole(_unstepped_state_dict(module, optimizer), tensor_slices(module), state_name)
    name_of = {id(p): n for n, p in module.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):  # the model's parameters, outside the step
        for p in group["params"]:
            if id(p) in name_of:
                flat[f"param_groups.{name_of[id(p)]}.{GROUP_INDEX}"] = index
    return names.to_store(flat)


def _unstepped_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """DCP's flat optimizer state dict, without DCP's side effect on an optimizer that has not stepped yet: torch
    2.13 first creates its state by a step with zero gradients at LR 0, which is not "no state" (SGD's momentum
    becomes weight_decay * p, Adam counts a step), so a checkpoint written before the first step (or while fp16
    skipped every step so far) changed the training that followed. The optimizer is left as it was, and the
    checkpoint holds no state for it, as for any parameter never stepped."""
    stepped = bool(optimizer.state)
    flat = get_optimizer_state_dict(module, optimizer, options=_FLAT)
    if not stepped:
        optimizer.state.clear()
        flat = {k: v for k, v in flat.items() if not k.startswith("state.")}
    return flat


def restore_added_groups(
    path: Path, saved: Mapping[str, Any], module: nn.Module, optimizers: list[Optimizer], names: CheckpointNames
) -> dict[int, set[int]]:
    """Rebuild the param groups the checkpoint's run added after set-up (their index is past this run's
    groups), each from this rank's own parameters with the group's settings as the checkpoint holds them;
    their parameters are made trainable, as whatever added them made them. One read of the groups' records.
    An added group this stage holds no parameter of becomes an empty group at its index; returns those
    (``id`` of the group dict, per optimizer index), whose settings :func:`align_added_groups` fills in."""
    placeholders: dict[int, set[int]] = {}
    if not any(k.endswith("." + GROUP_INDEX) for k in saved):
        return placeholders  # written before groups were recorded, or by the other engine (same on every rank)
    local = {names.stored_key(n): n for n, _ in module.named_parameters()}
    wanted: dict[str, Any] = {}
    for idx, _ in enumerate(optimizers):
        prefix = f"optimizer_{idx}.param_groups."
        for key, meta in saved.items():
            stored = key[len(prefix) :].rpartition(".")[0] if key.startswith(prefix) else None
            if stored in local and isinstance(meta, BytesStorageMetadata):
                wanted[key] = None
    read_sharded(path, wanted)  # every rank takes part (DCP's read is collective), with its own names
    params = dict(module.named_parameters())
    for idx, optimizer in enumerate(optimizers):
        prefix = f"optimizer_{idx}.param_groups."
        settings: dict[str, dict[str, Any]] = {}
        for key, value in wanted.items():
            if key.startswith(prefix):
                stored, _, setting = key[len(prefix) :].rpartition(".")
                settings.setdefault(local[stored], {})[setting] = value
        added: dict[int, list[str]] = {}
        for name, entries in settings.items():
            index = entries.get(GROUP_INDEX)
            if isinstance(index, int) and index >= len(optimizer.param_groups):
                added.setdefault(index, []).append(name)
        for index in sorted(added):
            while len(optimizer.param_groups) < index:  # an earlier added group without a parameter here
                optimizer.add_param_group({"params": []})
                placeholders.setdefault(idx, set()).add(id(optimizer.param_groups[-1]))
            members = [params[n] for n in added[index]]
            first = {k: v for k, v in settings[added[index][0]].items() if k != GROUP_INDEX}
            for p in members:
                p.requires_grad_(True)
            optimizer.add_param_group({**first, "params": members})
    return placeholders


def align_added_groups(optimizer: Optimizer, *, device: torch.device, refresh: Collection[int] = ()) -> None:
    """A callback that adds a param group over part of the model (``BackboneFinetuning``'s backbone) adds it
    only on the pipeline stages that hold that part. The other stages get an empty group at the same index
    with the same settings, so that the callback's later changes by position (``param_groups[-1]["lr"] *=
    ...``) land on its own group on every stage, as in one process, instead of on another group. Groups in
    ``refresh`` (empty groups a resume put at their index) take their settings from a stage that holds the
    group's parameters. One all-reduce; the settings are gathered only when something differs."""
    groups = optimizer.param_groups
    n, stale = len(groups), any(id(g) in refresh for g in groups)
    most, least, any_stale = agree([float(n), float(-n), float(stale)], op="max", device=device)
    if (most == -least and not any_stale) or not dist.is_initialized():
        return
    mine = [(_settings(g), bool(g["params"]) and id(g) not in refresh) for g in groups]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for i in range(int(most)):
        candidates = [ranks_groups[i] for ranks_groups in gathered if i < len(ranks_groups)]
        settings = next((s for s, held in candidates if held), candidates[0][0])
        settings = {k: v.to(device) if isinstance(v, Tensor) and v.device.type == device.type else v
                    for k, v in settings.items()}  # fmt: skip
        if i >= n:
            optimizer.add_param_group({**settings, "params": []})
        elif id(groups[i]) in refresh:
            groups[i].update(settings)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}  # names are per stage


class ShardedCheckpointIO:
    """``save_checkpoint`` and ``load_checkpoint`` for a Strategy whose checkpoints are the pack's sharded folders:
    mixed into a Strategy that implements :class:`ShardedCheckpointing` (it says its ``checkpoint_layout()`` and
    reads a folder into its own layout with ``read_sharded_checkpoint``)."""

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

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        # payloads are read with weights_only=True whatever `weights_only` says: a checkpoint never runs code
        if not (isinstance(self, Strategy) and isinstance(self, ShardedCheckpointing)):
            raise TypeError(
                f"{type(self).__name__} mixes in ShardedCheckpointIO but is no Strategy with read_sharded_checkpoint()"
            )
        path = checkpoint_folder(self, checkpoint_path)
        module = self.lightning_module
        assert module is not None
        meta = self.read_sharded_checkpoint(path, module, fitting=module.trainer.state.fn == TrainerFn.FITTING)
        written = meta.get(LAYOUT_KEY)
        if written:
            rank_zero_info(f"Resumed from {path} (written with {written}) onto {self.checkpoint_layout()}")
        return meta


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    sync: GradientSync,
    names: CheckpointNames,
    *,
    strict: bool,
    device: torch.device,
    restore_groups: bool = True,
) -> dict[str, Any]:
    """Load model (and, when ``optimizers`` are given, optimizer) state from ``path`` into this rank's layout,
    in place; with ``restore_groups`` the param groups the checkpoint's run added during training are rebuilt
    first (a resume; not a roll-back inside a run, which keeps its groups). Returns the rest of the checkpoint
    (``meta.pt``)."""
    agreed_checkpoint_folder(path, device)
    saved = read_sharded_index(path).state_dict_metadata

    # the model: DCP reshards whatever layout wrote it into this rank's tensors (plain or DTensor)
    # (a tied parameter held under another name than its first is read from where it is stored)
    slices = tensor_slices(module)  # tensor-parallel slices are read as parts of the unsplit tensors
    current, model_back = names.to_read(whole(get_model_state_dict(module), slices))
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
        problem = missing_values(path, missing)
    separate = [a for a in names.aliases if f"state_dict.{a}" in saved]
    if separate:  # written before the parameter was tied (or by an older version): the first name wins
        rank_zero_warn(
            f"{path} holds {separate[0]} apart from {names.aliases[separate[0]]}, which this model ties to it: both"
            f" names take the value stored under {names.aliases[separate[0]]}."
        )
    # each pipeline rank checks its own stages: agree, so every rank fails with the message, none waits
    raise_agreed(problem, KeyError, device=device)
    to_load: dict[str, Any] = {"state_dict": {k: v for k, v in current.items() if k not in missing}}
    if optimizers and restore_groups:
        problem, placeholders = None, {}
        try:
            placeholders = restore_added_groups(path, saved, module, optimizers, names)
        except Exception as exc:  # every rank stops together, none waits in the read below
            problem = f"cannot rebuild the param groups {path} records: {type(exc).__name__}: {exc}"
        raise_agreed(problem, RuntimeError, device=device)
        # before any callback hook of the resumed run changes a group by its position
        for idx, optimizer in enumerate(optimizers):
            align_added_groups(optimizer, device=device, refresh=placeholders.get(idx, ()))
    templates = {}
    for idx, optimizer in enumerate(optimizers):
        sync.adopt_param_groups(optimizer)
        sharded = sync.sharded_optimizer(optimizer)
        template = _optimizer_template(module, optimizer, sharded, saved, f"optimizer_{idx}", names)
        if template[0]:
            templates[idx] = template
            to_load[f"optimizer_{idx}"] = template[0]
    read_sharded(path, to_load)

    model = plain({model_back[k]: v for k, v in to_load["state_dict"].items()}, slices)
    set_model_state_dict(module, model, options=StateDictOptions(strict=False))
    for idx, (_template, back) in templates.items():
        local = plain({back[k]: v for k, v in to_load[f"optimizer_{idx}"].items()}, slices, state_name)
        sharded = sync.sharded_optimizer(optimizers[idx])
        if sharded is not None:
            sharded.load_parameters_into_shards()
            sharded.load_flat_state_dict(local)
        else:
            _load_unsharded_optimizer(module, optimizers[idx], local)
    for optimizer in optimizers:
        sharded = sync.sharded_optimizer(optimizer)
        if sharded is not None:
            sharded.load_parameters_into_shards()
    return meta


def _load_unsharded_optimizer(module: nn.Module, optimizer: Optimizer, loaded: dict[str, Any]) -> None:
    """Load DCP's flat, name-keyed optimizer state into a plain (or FSDP2) optimizer, per parameter: one the
    checkpoint holds no state for (never stepped: BERT's pooler, an expert no batch reached) starts fresh, as it
    would in one process, and a param group may be empty on this stage (torch 2.13's own unflattening fails on
    both). The groups keep this run's parameters and take the checkpoint's settings."""
    current = get_optimizer_state_dict(module, optimizer, options=_FLAT)  # the names torch gives each parameter
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    by_name: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
    for key, value in loaded.items():
        section, _, rest = key.partition(".")
        name, _, entry = rest.rpartition(".")
        if section in by_name:
            by_name[section].setdefault(name, {})[entry] = value
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            candidates = names.get(id(p), [])
            name = next(
                (n for n in candidates if f"param_groups.{n}.lr" in current), candidates[0] if candidates else ""
            )
            if by_name["state"].get(name):
                state[index] = dict(by_name["state"][name])
            if name in by_name["param_groups"]:
                settings.update({k: v for k, v in by_name["param_groups"][name].items() if k != GROUP_INDEX})
            ids.append(index)
            index += 1
        groups.append({**settings, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


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
        flat = get_optimizer_state_dict(module, optimizer, options=_FLAT)
        current, back = names.to_read(whole(flat, tensor_slices(module), state_name))
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
