"""The pipeline contract: what a LightningModule gives either engine to be pipelined, read the same way by both.

A module is pipelined when it keeps its blocks, in order, in ``self.layers`` and defines
``pipeline_loss(output, target)``; optionally ``pipeline_batch(batch) -> (inputs, target)`` and
``pipeline_loss_count(target)`` (a loss that is a mean over a variable count). Here: checking the contract,
refusing a module an earlier Trainer already cut, reading a batch into micro-batches, and finding
parameters that are one Parameter under several names (ties). Both ``HybridParallelStrategy`` and
``DeepSpeedPipelineStrategy`` call these, and ``init_from`` uses the ties; nothing here depends on an engine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hybrid._agree import agree

__all__ = [
    "Tie",
    "check_pipeline_contract",
    "contract_batch",
    "find_ties",
    "has_forward",
    "mark_cut",
    "micro_batches",
    "refuse_cut_module",
    "split_batch",
]


def check_pipeline_contract(module: nn.Module) -> None:
    """Raise a ``TypeError`` that says what to add when ``module`` cannot be pipelined."""
    name = type(module).__name__
    layers = getattr(module, "layers", None)
    if not isinstance(layers, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"{name} cannot be pipelined: keep its pipeline-splittable blocks, in order, in `self.layers` (an"
            " nn.Sequential, nn.ModuleList or nn.ModuleDict whose blocks take and return tensors), or use"
            " pipeline_parallel_size=1."
        )
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"{name} cannot be pipelined: define `pipeline_loss(self, output, target) -> Tensor` returning the"
            " mean loss over a micro-batch, or use pipeline_parallel_size=1."
        )
    containers = [f"layers.{n}" for n, block in layers.named_children() if not has_forward(block)]
    if containers:
        raise TypeError(
            f"{name} cannot be pipelined: {', '.join(containers[:3])} in `self.layers` has no forward (a"
            " ModuleList or ModuleDict), and a stage calls each of its blocks in turn. Wrap its members in a"
            " module whose forward runs them, or use pipeline_parallel_size=1."
        )
    inside = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise TypeError(
            f"{name} has trainable parameters outside `self.layers` ({', '.join(outside[:3])}"
            f"{', ...' if len(outside) > 3 else ''}) that no pipeline stage would own; move them into a block"
            " of `self.layers`."
        )


def contract_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch as the contract reads it: ``pipeline_batch(batch)`` when the module
    defines it, else ``(batch[0], batch[1])``."""
    fn = getattr(module, "pipeline_batch", None)  # optional in the contract
    return fn(batch) if callable(fn) else (batch[0], batch[1])


_CUT: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules whose `layers` hold only some stages' blocks


def refuse_cut_module(module: nn.Module) -> None:
    """A module an earlier Trainer cut into this rank's stages cannot be cut again (a second cut would keep
    a stage of the stage, silently); every rank sees the same."""
    if module in _CUT:
        raise RuntimeError(
            f"This {type(module).__name__} was cut into pipeline stages by an earlier Trainer (fit, validate or test"
            " with a pipeline): its `layers` hold only this rank's blocks. Build a fresh module for a new Trainer,"
            " or run fit, validate and test on the same Trainer."
        )


def mark_cut(module: nn.Module) -> None:
    _CUT.add(module)


@dataclass(frozen=True)
class Tie:
    """One parameter known by several ``names`` in the unsplit module (``names[0]`` is where checkpoints
    store it); ``blocks[i]`` is the position in ``self.layers`` of the block holding ``names[i]`` (None
    outside ``self.layers``)."""

    names: tuple[str, ...]
    blocks: tuple[int | None, ...]


def find_ties(module: nn.Module) -> list[Tie]:
    """Every parameter of ``module`` that has more than one name, in registration order."""
    by_param: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    position = {name: i for i, (name, _) in enumerate(layers.named_children())} if layers is not None else {}

    def block(name: str) -> int | None:
        parts = name.split(".")
        return position.get(parts[1]) if parts[0] == "layers" and len(parts) > 2 else None

    return [Tie(tuple(names), tuple(block(n) for n in names)) for names in by_param.values() if len(names) > 1]


def split_batch(value: Any, parts: int) -> list[Any]:
    if isinstance(value, Tensor):
        return list(value.chunk(parts))
    if isinstance(value, (tuple, list)):
        return [tuple(items) for items in zip(*(split_batch(v, parts) for v in value))]
    raise TypeError(f"pipeline inputs and targets must be tensors or tuples of tensors, got {type(value).__name__}")


def batch_size(value: Any) -> int:
    return value.shape[0] if isinstance(value, Tensor) else batch_size(value[0])


def micro_batches(module: nn.Module, batch: Any, num_microbatches: int, device: torch.device) -> list[tuple[Any, Any]]:
    """``batch`` as the pipeline contract reads it (``pipeline_batch``, else ``(batch[0], batch[1])``), cut
    into ``num_microbatches`` equal ``(inputs, target)`` pairs; the same batch size on every rank, checked."""
    inputs, target = contract_batch(module, batch)
    size = batch_size(inputs)
    low, high = agree([-size, size], op="max", device=device)
    if -low != high:
        raise ValueError(
            f"the ranks got batches of {-low:.0f} to {high:.0f} samples; the data-parallel mean weighs every"
            " replica's batch equally, so every rank needs the same batch size (drop_last=True, or a batch size"
            " that divides the data on every rank, validation included)."
        )
    if size % num_microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be cut into num_microbatches={num_microbatches} equal micro-batches;"
            " use a batch size divisible by it (and drop_last=True if the last batch is shorter)."
        )
    return list(zip(split_batch(inputs, num_microbatches), split_batch(target, num_microbatches)))


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` can be called: a forward of its own (a ModuleList or ModuleDict has none)."""
    return type(module).forward is not nn.Module.forward
