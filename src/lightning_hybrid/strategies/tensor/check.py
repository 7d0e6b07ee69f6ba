"""Each kind of split block is checked against itself run whole, on an input it received in training.

Some wrong plans train without an error and without the tensor-parallel peers drifting apart: a fused
projection (q, k and v in one ``Linear``) split column-wise gives each rank a slice across q, k and v rather
than whole heads; a module that takes a head count or a width from a constant rather than from its weights
computes with the wrong number. Every peer computes alike, so nothing the peers compare can tell (see
:mod:`.peers`). The block itself can: run whole on the same input, it must give what the split block gives.

For each kind of block (its class and its plan: a model's decoder layers are one kind), a copy without
parameters is made before the plan splits the first block of the kind, and one sample of the last input that
block receives in training before the first optimizer step is kept (a pipeline's stages first infer their
shapes on placeholders). After the first optimizer step of the first fit, both run on it in eval mode,
without gradients, under training's autocast and with the random generators set aside: the split block on
the peers as it trains (its buffers put back after), and the copy with each parameter gathered whole
(``DTensor.full_tensor``) on the input gathered whole (an input split by sequence position is joined along
the dimension its plan splits). An output off beyond rounding in more than a quarter of its rows (a wrong
plan moves them all; rounding that flips an expert's routing, a few) stops every rank, the message agreed
with the peers' check. Each local step is agreed over the peers before the next collective, so a check
that cannot run on one (a block that cannot be copied, memory, a block drawing random numbers in eval mode)
is skipped on all, logged, and stops nothing.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, SequenceParallel
from torch.func import functional_call

from lightning_hybrid._agree import agree
from lightning_hybrid._torch_compat import clear_forward_hooks
from lightning_hybrid.strategies._same_batch import _tensors

__all__ = ["PlanCheck"]

log = logging.getLogger(__name__)
_Context = Callable[[], AbstractContextManager[Any]]

# relative to the output's norm: a split sums in another order (1e-6 in fp32); a wrong plan is off by ~1
_TOLERANCE = 1e-3
_REDUCED_TOLERANCE = 3e-2  # 16-bit outputs, autocast, or TF32 matmuls: 8 to 11 bits of mantissa
_ROWS = 0.25  # the fraction of an output's rows that must be off: a wrong plan moves all of them
_ROWS_READ = 1024  # rows compared at a time


class PlanCheck:
    """The first block of each kind, watched from before its plan splits it (see the module docstring)."""

    def __init__(self) -> None:
        self.forward_context: _Context = nullcontext  # training's (the precision plugin's autocast): the strategy's
        self.watched: list[_Watched] = []
        self.kinds: set[tuple[Any, ...]] = set()
        self.checked: list[str] = []  # the blocks compared, by name (the tests read it)

    def watch(self, name: str, block: nn.Module, plan: dict[str, ParallelStyle]) -> None:
        """Before ``plan`` splits ``block`` (called for each block; the first of each kind is kept)."""
        kind = (type(block).__qualname__, tuple(sorted((key, _describe(style)) for key, style in plan.items())))
        if kind not in self.kinds:
            self.kinds.add(kind)
            try:
                self.watched.append(_Watched(name, block, plan))
            except Exception as exc:  # a block holding what cannot be copied (a process group, a lock)
                log.warning(
                    f"{name or type(block).__name__} cannot be copied to check its tensor-parallel plan: {exc!r}"
                )

    def run(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Compare every watched block (collectives over the peers ``group`` and each parameter's mesh: every
        rank of a stage calls it, its blocks in the same order). What differs, or ``None``."""
        watched, self.watched = self.watched, []
        context, checked = self.forward_context, self.checked
        problems = [problem for w in watched if (problem := w.check(group, device, context, checked))]
        return "; ".join(problems) or None


class _Skip(Exception):
    """The check cannot run on some peer: every peer skips it alike."""


def _agreed(step: Callable[[], Any], group: dist.ProcessGroup, device: torch.device) -> Any:
    """``step()``, and whether it ran on every peer (an error on one, memory say, must not leave the others in
    the next collective): :class:`_Skip` on every peer when it failed on any."""
    error, result = None, None
    try:
        result = step()
    except Exception as exc:
        error = exc
    (ok,) = agree([0.0 if error is not None else 1.0], op="min", device=device, group=group)
    if not ok:
        raise _Skip(repr(error) if error is not None else "it failed on a tensor-parallel peer")
    return result


class _Watched:
    def __init__(self, name: str, block: nn.Module, plan: dict[str, ParallelStyle]) -> None:
        self.name, self.block = name or type(block).__name__, block
        # the block's structure and constants; its tensors come from the split block when it runs
        memo: dict[int, Any] = {id(t): _meta(t) for t in (*block.parameters(), *block.buffers())}
        self.whole = copy.deepcopy(block, memo)
        clear_forward_hooks(self.whole)  # the user's hooks run on the split block
        self.sequence_dim = _sequence_dim(plan)
        self.inputs: tuple[Any, Any] | None = None
        self.handle = block.register_forward_pre_hook(self._keep, with_kwargs=True, prepend=True)

    def _keep(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling() or not module.training or torch.is_inference_mode_enabled():
            return  # a compiled block, validation: nothing kept (every peer alike)
        try:  # one sample of the batch is enough, and bounds what is kept and run whole
            first = next((t for t in _all_tensors((args, kwargs)) if t.dim() > 1), None)
            batch = first.shape[0] if first is not None else 0
            keep = (lambda t: _kept(t[:1] if t.dim() and t.shape[0] == batch else t)) if batch > 1 else _kept
            self.inputs = (_map(keep, args), _map(keep, kwargs))
        except Exception as exc:  # an input structure the copy cannot rebuild: the block goes unchecked
            log.warning(f"{self.name}: its input cannot be kept to check its tensor-parallel plan ({exc!r}).")
            self.inputs = None
            self.handle.remove()

    def check(self, group: dist.ProcessGroup, device: torch.device, context: _Context, checked: list[str]) -> Any:
        self.handle.remove()
        inputs, self.inputs = self.inputs, None
        (ready,) = agree([1.0 if inputs is not None else 0.0], op="min", device=device, group=group)
        if not ready:  # the block did not train on some peer (nothing to compare on)
            return None
        modes = [(m, m.training) for m in self.block.modules()]
        buffers = [(b, b.clone()) for b in self.block.buffers()]  # put back after: a count kept in forward
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), context():
                return self._run(*inputs, group, device, checked)  # type: ignore[misc]
        except _Skip as skipped:  # a check that cannot run stops nothing: the block trains unchecked
            log.warning(f"{self.name} could not be run whole to check its tensor-parallel plan: {skipped}.")
            return None
        finally:
            for module, mode in modes:
                module.training = mode
            for buffer, saved in buffers:
                buffer.copy_(saved)
            for module in self.block.modules():  # ZeRO-3's units gathered for this forward: sharded again
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _run(self, args: Any, kwargs: Any, group: dist.ProcessGroup, device: torch.device, checked: list[str]) -> Any:
        self.block.eval()
        buffers = {n: b.clone() for n, b in self.block.named_buffers()}  # as the split run finds them
        split = _all_tensors(_agreed(lambda: self.block(*args, **kwargs), group, device))
        joined = _Joined(group, self.sequence_dim)
        whole_args, whole_kwargs = _map(joined.input, args), _map(joined.input, kwargs)
        (ok,) = agree([0.0 if joined.unknown else 1.0], op="min", device=device, group=group)
        if not ok:  # an input split along a dimension the plan does not name: not compared
            return None
        values = {n: _full(v) for n, v in _named_values(self.block)}
        self.whole.eval()

        def whole(seed: int) -> list[Tensor]:
            torch.manual_seed(seed)  # two runs apart: a block that draws random numbers in eval mode shows
            state = {**values, **{n: b.clone() for n, b in buffers.items()}}
            return _all_tensors(functional_call(self.whole, state, tuple(whole_args), whole_kwargs, strict=False))

        expected = _agreed(lambda: whole(1), group, device)
        got = [joined.output(mine, want.shape) for mine, want in zip(split, expected)]  # gathered: every output
        reduced = torch.is_autocast_enabled(device.type) or torch.get_float32_matmul_precision() != "highest"
        verdict = _agreed(lambda: self._compare(split, got, expected, reduced), group, device)
        if verdict is not None:  # a block that draws in eval mode differs from itself: not the plan's doing
            again = _agreed(lambda: whole(2), group, device)
            if any(_rows_off(a, b, 0.0)[1] > 0 for a, b in zip(expected, again)):
                raise _Skip("it draws random numbers in eval mode (two runs whole differ)")
        checked.append(self.name)
        return verdict

    def _compare(
        self, split: list[Tensor], got: list[Tensor | None], expected: list[Tensor], reduced: bool
    ) -> str | None:
        if len(split) != len(expected):
            return f"{self.name} gives {len(split)} tensors split and {len(expected)} whole"
        for i, (mine, whole, want) in enumerate(zip(split, got, expected)):
            if whole is None:
                return (
                    f"{self.name}'s output {i} has shape {tuple(mine.shape)} split, {tuple(want.shape)} whole: no"
                    " dimension it could be split along"
                )
            full = want.dtype in (torch.float32, torch.float64) and not reduced
            tolerance = _TOLERANCE if full else _REDUCED_TOLERANCE
            gap, rows = _rows_off(whole, want, tolerance)
            # a wrong plan moves every row; rounding that flips a routing decision (MoE) moves a few
            if gap > tolerance and rows > _ROWS:
                return (
                    f"{self.name}'s output {i} split differs from the block run whole on the same input (relative"
                    f" difference {gap:.2e} where rounding allows {tolerance:.0e}, in {rows:.0%} of its rows)"
                )
        return None


class _Joined:
    """Tensors the peers hold, made whole: gathered over the peers, and either equal on all (whole already)
    or joined along the dimension they were split along."""

    def __init__(self, group: dist.ProcessGroup, sequence_dim: int | None) -> None:
        self.group, self.sequence_dim, self.unknown = group, sequence_dim, False

    def _gather(self, t: Tensor) -> list[Tensor]:
        peers = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(peers, t.contiguous(), group=self.group)
        return peers

    def input(self, t: Any) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor()
        if not isinstance(t, Tensor) or not t.is_floating_point():  # ids, masks, positions: whole
            return t
        peers = self._gather(t)
        if all(torch.equal(_bits(peers[0]), _bits(p)) for p in peers[1:]):  # NaN at masked positions included
            return t
        if self.sequence_dim is None:
            self.unknown = True
            return t
        return torch.cat(peers, dim=self.sequence_dim)

    def output(self, t: Tensor, whole: torch.Size) -> Tensor | None:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if t.shape == whole:
            return t
        size = dist.get_world_size(self.group)
        split = [d for d in range(t.dim()) if t.dim() == len(whole) and t.shape[d] * size == whole[d]]
        if len(split) != 1 or any(t.shape[d] != whole[d] for d in range(t.dim()) if d != split[0]):
            return None  # no one dimension it could be split along
        return torch.cat(self._gather(t), dim=split[0])


def _bits(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


def _rows_off(got: Tensor, want: Tensor, tolerance: float) -> tuple[float, float]:
    """The relative difference of ``got`` from ``want`` over all of it, and the fraction of its rows (the last
    dimension's vectors) off by more than ``tolerance``; read in chunks of rows, in float32 with float64 sums.
    Where both are finite they are compared; a position finite in one and not in the other makes its row off
    (NaN in both, where a padded row's attention is fully masked, is alike)."""
    got, want = (
        got.reshape(-1, got.shape[-1] if got.dim() else 1),
        want.reshape(-1, want.shape[-1] if want.dim() else 1),
    )
    squares, norms, broken = [], [], []
    for start in range(0, got.shape[0], _ROWS_READ):
        g, w = got[start : start + _ROWS_READ].float(), want[start : start + _ROWS_READ].float()
        finite = g.isfinite() & w.isfinite()
        broken.append(~(finite | (g == w) | (g.isnan() & w.isnan())).all(dim=-1))
        squares.append(torch.where(finite, g - w, 0.0).double().square().sum(dim=-1))
        norms.append(torch.where(finite, w, 0.0).double().square().sum(dim=-1))
    if not squares:
        return 0.0, 0.0
    square, norm, bad = torch.cat(squares), torch.cat(norms), torch.cat(broken)
    gap = float(square.sum().sqrt() / norm.sum().sqrt().clamp_min(1e-30))
    floor = (1e-3 * norm.mean().sqrt()).clamp_min(1e-30)  # a row near zero is measured against a typical row
    off = (square.sqrt() / norm.sqrt().maximum(floor) > tolerance) | bad
    return (float("inf") if bool(bad.any()) else gap), float(off.double().mean())


def _sequence_dim(plan: dict[str, ParallelStyle]) -> int | None:
    """The dimension the plan expects the block's split inputs to be split along (sequence parallelism)."""
    for style in plan.values():
        if isinstance(style, SequenceParallel):
            return style.sequence_sharding[0].dim
        if isinstance(style, PrepareModuleInput):
            for layout in style.input_layouts or ():
                if isinstance(layout, Shard):
                    return layout.dim
    return None


def _describe(style: ParallelStyle) -> str:
    return f"{type(style).__name__}{sorted((k, repr(v)) for k, v in vars(style).items())}"


def _meta(t: Tensor) -> Tensor:
    meta = torch.empty_like(t, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def _named_values(block: nn.Module) -> list[tuple[str, Tensor]]:
    """Each parameter as its module gives it: a split one as its DTensor (ZeRO-3's, or the view a plain slice
    is read through; see :mod:`.local`)."""
    out = []
    for name, _ in block.named_parameters():
        owner, _, attribute = name.rpartition(".")
        out.append((name, getattr(block.get_submodule(owner), attribute)))
    return out


def _full(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _kept(t: Any) -> Any:
    return t.detach().clone() if isinstance(t, Tensor) else t


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        items = [_map(fn, v) for v in x]
        # a named tuple (a tuple's subclass) takes its fields one by one
        return type(x)(*items) if isinstance(x, tuple) and type(x) is not tuple else type(x)(items)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _all_tensors(x: Any) -> list[Tensor]:
    return list(_tensors(x))  # the batch fingerprint's walk: mappings, sequences, dataclasses
