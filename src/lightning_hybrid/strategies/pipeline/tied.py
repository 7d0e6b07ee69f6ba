"""Parameters tied across the blocks of ``self.layers``: one Parameter under several names.

A language model's output projection is often its input embedding (GPT-2, T5, most small LMs): the same
Parameter in the first and the last block. Once the pipeline cuts the model, the first and the last stage
each hold a copy (equal at the start: every rank builds the whole model from the same seed). The copies
stay one parameter, as Megatron's embedding group and DeepSpeed's ``TiedLayerSpec`` keep them, when:

- their gradients are summed over the stages that hold them before clipping and the optimizer step
  (:class:`TiedGradients`), so every copy takes the same update;
- the gradient norm counts the tied gradient once (the copies on stages other than the first leave out
  their part);
- a checkpoint stores the parameter once, under its first name (:class:`CheckpointNames`), and a rank
  that holds it under another name reads it from there, whatever layout wrote it.

What cannot be exact is refused before step 0 (:func:`check_ties`): ZeRO-2 reducing gradients during
backward (the other stage has not computed its part yet), and ZeRO-3 with one tied parameter in two FSDP2
units of one rank (each unit would shard its own copy and untie it).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid.contract import Tie
from lightning_hybrid.strategies._layout import Layout, shared_group, stage_ids_on_rank
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import unit_of

__all__ = ["TiedGradients", "check_ties", "holder_ranks"]


def _rank_of_block(block: int | None, ranges: list[range] | None, layout: Layout) -> int:
    """The pipeline rank holding block ``block`` (rank 0 without a pipeline or outside ``self.layers``)."""
    if ranges is None or block is None:
        return 0
    stage = next(s for s, blocks in enumerate(ranges) if block in blocks)
    return next(r for r in range(layout.pipeline_parallel_size) if stage in stage_ids_on_rank(r, layout))


def holder_ranks(tie: Tie, ranges: list[range] | None, layout: Layout) -> list[int]:
    """The pipeline ranks holding a name of ``tie``, ascending (``ranges``: every stage's blocks)."""
    return sorted({_rank_of_block(b, ranges, layout) for b in tie.blocks})


def check_ties(
    ties: list[Tie], ranges: list[range] | None, layout: Layout, zero: ZeroConfig, units: list[str] | None
) -> None:
    """Raise a ``ValueError`` for a tie this layout cannot keep exact (the same verdict on every rank).
    ``units``: ZeRO-3's FSDP2 units (``zero.fully_sharded.planned_units``)."""
    for tie in ties:
        if ranges is not None and None in tie.blocks:
            outside = [n for n, b in zip(tie.names, tie.blocks) if b is None]
            raise ValueError(
                f"{' and '.join(tie.names)} are one tied parameter, and {', '.join(outside)} is outside"
                " `self.layers`: no pipeline stage owns it there, so it could not be kept equal to the stages'"
                " copies. Reach the tied module through a block of `self.layers` only."
            )
        if (
            len(holder_ranks(tie, ranges, layout)) > 1
            and layout.zero_stage == 2
            and (zero.reduce_gradients == "every_microbatch")
        ):
            raise ValueError(
                f"{' and '.join(tie.names)} are one tied parameter held by several pipeline stages: ZeRO-2 with"
                " reduce_gradients='every_microbatch' hands its gradient off during backward, before the other"
                " stages have computed their part. Use ZeroConfig(reduce_gradients='once_per_step') or"
                " zero_stage=1."
            )
        if layout.zero_stage != 3:
            continue
        assert units is not None, "ZeRO-3's ties are checked against its units"
        by_rank: dict[int, set[str]] = {}
        for name, block in zip(tie.names, tie.blocks):
            by_rank.setdefault(_rank_of_block(block, ranges, layout), set()).add(unit_of(name, units) or "(root)")
        split = next((units for units in by_rank.values() if len(units) > 1), None)
        if split is not None:
            raise ValueError(
                f"{' and '.join(tie.names)} are one tied parameter in {len(split)} FSDP2 units of one rank"
                f" ({', '.join(sorted(split))}) under zero_stage=3: each unit would shard its own copy and untie"
                " it. Put the tied modules in one block (with ZeroConfig(shard_units='blocks') if they are two"
                " children of a block), place the blocks on different pipeline ranks, or use zero_stage 0-2."
            )


@dataclass
class _Held:
    name: str  # the name this rank holds it under
    param: nn.Parameter
    group: dist.ProcessGroup  # the holders at this rank's data-parallel index
    copy: bool  # the first name is held by another pipeline rank: its gradient is counted there
    optimizer: int = -1  # index of the optimizer that steps it (-1: none)


class TiedGradients:
    """Sums the gradient of each parameter tied across pipeline ranks over the ranks that hold it.

    One process group per tie and data- and tensor-parallel index (the holders at that index); every rank creates
    every group, in the same order, as ``torch.distributed.new_group`` requires."""

    def __init__(
        self,
        ties: list[Tie],
        module: nn.Module,
        *,
        ranges: list[range] | None,
        layout: Layout,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        self._held: list[_Held] = []
        self._spanning = 0  # ties held by several pipeline ranks: the same number on every rank
        self._device = device
        pp_rank, dp_rank, tp_rank = layout.coordinates(dist.get_rank())
        params = dict(module.named_parameters(remove_duplicate=False))
        for tie in ties:
            holders = holder_ranks(tie, ranges, layout)
            if len(holders) < 2:
                continue  # one rank holds every name: autograd already sums, it is one tensor
            self._spanning += 1
            mine = None
            for dp in range(layout.data_parallel_size):
                for tp in range(layout.tensor_parallel_size):  # each tensor-parallel slice sums with its own
                    ranks = [layout.rank_at(pp, dp, tp) for pp in holders]
                    group = shared_group(
                        ("tied", tuple(tie.names), str(ranks)), functools.partial(dist.new_group, ranks)
                    )
                    if (dp, tp) == (dp_rank, tp_rank) and pp_rank in holders:
                        mine = group
            if mine is not None:
                name = next(n for n in tie.names if n in params)
                first = _rank_of_block(tie.blocks[0], ranges, layout)
                held = _Held(name, params[name], mine, copy=first != pp_rank)
                self._held.append(held)
                # the copies start equal, whatever filled them (a seed, init_from keys): the first name's value
                with torch.no_grad():
                    value = held.param.to_local() if isinstance(held.param, DTensor) else held.param
                    dist.broadcast(value, src=layout.rank_at(first, dp_rank, tp_rank), group=mine)

    def __bool__(self) -> bool:
        return bool(self._held)

    def attach(self, optimizers: list[Optimizer]) -> None:
        """Note which optimizer steps each tied parameter, and check that every holder steps its copy with the
        same optimizer and hyperparameters (a parameter-group rule keyed on names could tell the copies apart
        and let them drift): a difference fails on every rank, before the first step."""
        if not self._spanning:
            return
        problems = []
        for held in self._held:
            where = [(i, g) for i, opt in enumerate(optimizers) for g in opt.param_groups
                     if any(p is held.param for p in g["params"])]  # fmt: skip
            held.optimizer = where[0][0] if where else -1
            settings = _settings(where[0][1]) if where else ""
            digest = float(zlib.crc32(f"{held.optimizer}:{settings}".encode()))
            both = torch.tensor([digest, -digest], dtype=torch.float64, device=self._device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=held.group)
            if float(both[0]) != -float(both[1]):
                problems.append(
                    f"{held.name} is tied across pipeline stages, and the stages that hold it step it with different"
                    " optimizers or parameter groups of different settings (a rule keyed on parameter names?);"
                    " the copies would drift apart. Give every name of a tied parameter the same group settings."
                )
        problem = agreed_problem(problems[0] if problems else None, device=self._device)
        if problem:
            raise ValueError(problem)

    @torch.no_grad()
    def sum_gradients(self, optimizer_index: int) -> None:
        """Every holder's gradient of the tied parameters optimizer ``optimizer_index`` steps becomes the sum
        over the holders (call once the window's backward ran). A parameter no holder has a gradient for (frozen,
        unused) keeps none."""
        for held in self._held:
            if held.optimizer != optimizer_index:
                continue
            param = held.param
            has = torch.tensor([float(param.grad is not None)], device=self._device)
            dist.all_reduce(has, group=held.group)
            if not has.item():
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=held.group)

    def copies(self) -> list[nn.Parameter]:
        """The tied parameters this rank holds as a second copy: their gradient is counted elsewhere."""
        return [held.param for held in self._held if held.copy]


def _settings(group: dict[str, Any]) -> str:
    """A parameter group's settings, the same text on every rank for the same values (not its parameters or
    their names, which differ between the stages; tensors by value, not by device)."""

    def plain(value: Any) -> Any:
        return value.tolist() if isinstance(value, torch.Tensor) else value

    return repr(sorted((k, repr(plain(v))) for k, v in group.items() if k not in ("params", "param_names")))
