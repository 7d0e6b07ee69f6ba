"""DeepSpeed's pipeline engine state in the pack's sharded checkpoint format, and back.

DeepSpeed's own checkpoint files are read with ``torch.load(weights_only=False)`` (a file can run code) and
fit only the layout that wrote them. DeepSpeedPipelineStrategy writes the folders HybridParallelStrategy
writes instead: the unsplit module's parameter names, fp32 weights (DeepSpeed's fp32 master copy where it
keeps one), and the optimizer state in DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
``param_groups.<fqn>.<key>``). Under ZeRO-1 (and bf16/fp16, whose master copy DeepSpeed partitions the same
way) each data-parallel rank writes the elements of each tensor its flat partition holds, as
:class:`FlatShard` boxes. So a checkpoint of either engine loads into the other, into any layout, and
through ``consolidate_checkpoint``; reading it never runs code.

:class:`Slot` is where one parameter's values live: the parameter itself (ZeRO-0 fp32, where the torch
optimizer steps the model's parameters), or a range of a flat fp32 partition that DeepSpeed's optimizer
wrapper hands to the torch optimizer (its ``_hp_mapping``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import raise_agreed
from lightning_hybrid._torch_compat import init_optimizer_state
from lightning_hybrid.checkpoint._flat_shards import FlatShard, view_boxes
from lightning_hybrid.checkpoint._sharded import (
    agreed_checkpoint_folder,
    missing_values,
    read_sharded,
    read_sharded_index,
)
from lightning_hybrid.strategies.deepspeed.compat import fp32_partition_of, inner_optimizer, loss_scaler
from lightning_hybrid.strategies.deepspeed.config import precision_kind

__all__ = [
    "EnginePrecision",
    "load_sharded",
    "Slot",
    "apply_loaded",
    "client_optimizer",
    "fill_masters",
    "model_state",
    "optimizer_state",
    "slots",
    "templates",
]


@dataclass
class Slot:
    """Where parameter ``name``'s fp32 value and optimizer state live on this rank."""

    name: str
    param: nn.Parameter  # the model's parameter (fp32, or bf16/fp16 under mixed precision)
    owner: Tensor  # what the torch optimizer steps: the parameter itself, or a flat fp32 partition
    group: dict[str, Any]  # owner's param group in the torch optimizer
    lp_start: int  # the first element of the parameter this rank holds
    hp_start: int  # where that element sits in ``owner`` (flattened)
    numel: int  # how many elements this rank holds

    @property
    def whole(self) -> bool:
        return self.owner is self.param

    def piece(self, tensor: Tensor) -> Any:
        """This rank's elements of a per-element tensor shaped like ``owner``: the tensor, or a FlatShard."""
        if self.whole:
            return tensor
        flat = tensor.view(-1).narrow(0, self.hp_start, self.numel)
        return FlatShard(self.param.shape, tensor.dtype, view_boxes(self.param.shape, self.lp_start, flat))


def client_optimizer(engine: Any) -> Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO-1, bf16, fp16), or the engine's own one."""
    optimizer = engine.optimizer
    inner = inner_optimizer(optimizer)  # DeepSpeed's wrappers keep the torch optimizer inside
    return inner if isinstance(inner, Optimizer) else optimizer


def slots(module: nn.Module, engine: Any) -> list[Slot]:
    """Every trainable parameter this rank holds values for, under the unsplit module's names."""
    optimizer = client_optimizer(engine)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        linked, mapping = fp32_partition_of(param)  # DeepSpeed's link from the parameter to its fp32 partition
        if not linked:  # the torch optimizer steps the model's own parameter
            if id(param) not in group_of:
                raise ValueError(
                    f"{name} is trainable but in no param group of the optimizer: give it to the optimizer."
                )
            out.append(Slot(name, param, param, group_of[id(param)], 0, 0, param.numel()))
            continue
        if mapping is None:
            continue  # another data-parallel rank's partition holds all of it
        group = optimizer.param_groups[mapping.param_group_index]
        (owner,) = group["params"]
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        if mapping.hp_fragment.data_ptr() != owner.data_ptr() + hp.start * owner.element_size():
            raise RuntimeError(
                f"DeepSpeed's fp32 partition of {name} is not where this version of the strategy expects it;"
                " this DeepSpeed version is not supported by DeepSpeedPipelineStrategy's checkpoints."
            )
        out.append(Slot(name, param, owner, group, lp.start, hp.start, hp.numel))
    return out


@torch.no_grad()
def fill_masters(held: list[Slot], source: Any, plan: Any) -> None:
    """Copy pretrained values into DeepSpeed's fp32 master partitions (bf16/fp16, ZeRO-1): DeepSpeed built them
    from the low-precision parameters, so without this the run starts from weights rounded to bf16/fp16."""
    for slot in held:
        if slot.whole or slot.name not in plan.source_of:
            continue
        value = source.read(plan.source_of[slot.name], None).reshape(-1)[slot.lp_start : slot.lp_start + slot.numel]
        slot.owner.data.view(-1)[slot.hp_start : slot.hp_start + slot.numel].copy_(value)


def model_state(module: nn.Module, held: list[Slot], *, partitioned: bool) -> dict[str, Any]:
    """The module's state dict with each trainable parameter's fp32 value: with an engine that steps
    (``partitioned``), this rank's elements of it from where the optimizer keeps it; else the parameter."""
    state = dict(module.state_dict())
    if not partitioned:  # before the engine exists, or an engine built for validate / test
        params = {n for n, _ in module.named_parameters()}
        return {k: v.float() if k in params and v.is_floating_point() else v for k, v in state.items()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    for name in trainable:
        state.pop(name, None)  # written by the ranks that hold it, below
    for slot in held:
        state[slot.name] = slot.piece(slot.owner.detach())
    return state


def optimizer_state(optimizer: Optimizer, held: list[Slot]) -> dict[str, Any]:
    """DCP's flattened optimizer state (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``) of ``held``."""
    out: dict[str, Any] = {}
    for slot in held:
        for key, value in optimizer.state.get(slot.owner, {}).items():
            per_element = isinstance(value, Tensor) and value.shape == slot.owner.shape
            out[f"state.{slot.name}.{key}"] = slot.piece(value) if per_element else value
        for key, value in slot.group.items():
            if key != "params":
                out[f"param_groups.{slot.name}.{key}"] = value
    return out


def templates(
    module: nn.Module, held: list[Slot], optimizer: Optimizer | None, saved: dict[str, Any], prefix: str
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """What this rank reads: ``(model, optimizer)`` dicts shaped as the checkpoint stores them, and the names
    whose stored optimizer state this optimizer has no place for (the caller refuses those).

    Trainable parameters read whole into fp32 buffers (every rank needs the whole low-precision parameter),
    except where the optimizer steps the parameter itself, which reads in place. The optimizer's state is
    created first (as its first step would), so every stored key reads in place into a tensor of the right
    kind, device and dtype: per-element state into this rank's range of what DeepSpeed steps, scalars (Adam's
    step) whole. State the checkpoint does not hold for a parameter is dropped again, as a fresh optimizer
    has none."""
    model: dict[str, Any] = {}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    whole = {s.name for s in held if s.whole}
    for name, value in module.state_dict().items():
        if name in trainable and name not in whole:
            model[name] = torch.empty(value.shape, dtype=torch.float32, device=value.device)
        else:
            model[name] = value  # read in place: ZeRO-0 fp32 parameters, buffers, frozen parameters
    optim: dict[str, Any] = {}
    if optimizer is None:
        return model, optim, []
    fresh = {id(s.owner): s.owner for s in held if not optimizer.state.get(s.owner)}
    init_optimizer_state(optimizer)
    stored = _index(saved, prefix)
    read, unread = set(), []
    for slot in held:
        state = optimizer.state.get(slot.owner, {})
        entries = stored.get(("state", slot.name), [])
        for sub, meta in entries:
            value = state.get(sub)
            key = f"state.{slot.name}.{sub}"
            if sub not in state:
                continue
            if not isinstance(value, Tensor) or not isinstance(meta, TensorStorageMetadata):
                optim[key] = None  # a plain value, assigned after the read
            elif value.shape == slot.owner.shape and tuple(meta.size) == tuple(slot.param.shape):
                optim[key] = slot.piece(value)  # per element: into this rank's range
            elif tuple(meta.size) == tuple(value.shape):
                optim[key] = value  # a scalar (shared by a flat partition): in place
            else:
                continue
            read.add(id(slot.owner))
        if entries and not any(k.startswith(f"state.{slot.name}.") for k in optim):
            unread.append(slot.name)
        for sub, meta in stored.get(("param_groups", slot.name), []):
            if isinstance(meta, BytesStorageMetadata) and sub in slot.group and sub != "params":
                optim[f"param_groups.{slot.name}.{sub}"] = None
    for key, owner in fresh.items():
        if key not in read:
            optimizer.state.pop(owner, None)  # nothing stored for it: as fresh as before
    return model, optim, unread


def load_sharded(
    path: Path,
    module: nn.Module,
    held: list[Slot],
    optimizer: Optimizer | None,
    *,
    strict: bool,
    device: torch.device,
) -> None:
    """Read a sharded checkpoint of either engine into this rank's stage and DeepSpeed's partitions (every rank
    together; a problem on any rank fails on all)."""
    agreed_checkpoint_folder(path, device)
    saved = read_sharded_index(path).state_dict_metadata
    model, optim, unread = templates(module, held, optimizer, saved, "optimizer_0")
    missing = [k for k in model if f"state_dict.{k}" not in saved]
    problem = None
    if missing and strict:
        problem = missing_values(path, missing)
    elif unread:
        problem = (
            f"The checkpoint at {path} holds optimizer state for {unread[:3]} that this optimizer"
            f" ({type(optimizer).__name__}) has no place for; resume with the optimizer that wrote it"
        )
    raise_agreed(problem, KeyError, device=device)
    to_load: dict[str, Any] = {"state_dict": {k: v for k, v in model.items() if k not in missing}}
    if optim:
        to_load["optimizer_0"] = optim
    read_sharded(path, to_load)
    apply_loaded(module, held, to_load["state_dict"], optimizer, to_load.get("optimizer_0", {}))


def _index(saved: dict[str, Any], prefix: str) -> dict[tuple[str, str], list[tuple[str, Any]]]:
    """``(section, fqn) -> [(key, storage metadata)]`` of the checkpoint's flat optimizer entries."""
    out: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    head = prefix + "."
    for key, meta in saved.items():
        if key.startswith(head):
            section, _, rest = key[len(head) :].partition(".")
            fqn, _, sub = rest.rpartition(".")
            out.setdefault((section, fqn), []).append((sub, meta))
    return out


def apply_loaded(
    module: nn.Module, held: list[Slot], model: dict[str, Any], optimizer: Optimizer | None, optim: dict[str, Any]
) -> None:
    """Copy what :func:`templates` read into the model and into DeepSpeed's fp32 partitions."""
    by_name = {s.name: s for s in held}
    with torch.no_grad():
        for name, param in module.named_parameters():
            full = model.get(name)
            slot = by_name.get(name)
            if full is None or full is param or (slot is not None and slot.whole):
                continue
            param.copy_(full)  # every rank holds the whole (low-precision) parameter
            if slot is not None:
                flat = full.reshape(-1).narrow(0, slot.lp_start, slot.numel)
                slot.owner.view(-1).narrow(0, slot.hp_start, slot.numel).copy_(flat)
    if optimizer is None:
        return
    for key, value in optim.items():
        if isinstance(value, (Tensor, FlatShard)):
            continue  # read in place
        section, _, rest = key.partition(".")
        fqn, _, sub = rest.rpartition(".")
        slot = by_name.get(fqn)
        if slot is None:
            continue
        target = optimizer.state.get(slot.owner, {}) if section == "state" else slot.group
        if sub in target and sub != "params":  # only what the optimizer already has
            target[sub] = value


class EnginePrecision(Precision):
    """Lightning's side of a precision DeepSpeed's engine runs itself (it casts the module, scales the loss).
    Its state in a checkpoint is the engine's: step counters and, under fp16, the loss scaler."""

    _COUNTERS = ("global_steps", "global_samples", "skipped_steps")
    _SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, precision: str, engine: Callable[[], Any]) -> None:
        self.precision = precision  # type: ignore[assignment]
        self._engine = engine

    def _scaler(self) -> Any:
        """DeepSpeed's dynamic fp16 loss scaler, or None (fp32, bf16: nothing to keep)."""
        engine = self._engine()
        if engine is None or precision_kind(self.precision) != "fp16":
            return None
        return loss_scaler(engine.optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        engine = self._engine()
        if engine is None:
            return {}
        state: dict[str, Any] = {k: int(getattr(engine, k)) for k in self._COUNTERS}
        scaler = self._scaler()
        for key in self._SCALER:
            if isinstance(getattr(scaler, key, None), (int, float)):
                state[f"loss_scaler.{key}"] = getattr(scaler, key)
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine, scaler = self._engine(), self._scaler()
        for key in self._COUNTERS:
            if isinstance(state_dict.get(key), int):
                setattr(engine, key, state_dict[key])
        for key in self._SCALER:  # only a checkpoint's fp16 scaler state, into an fp16 run
            value = state_dict.get(f"loss_scaler.{key}")
            if scaler is not None and isinstance(value, (int, float)) and hasattr(scaler, key):
                setattr(scaler, key, value)
