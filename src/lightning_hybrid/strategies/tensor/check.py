"""Each kind of split block is checked against itself run whole, on an input it received in training.

Some wrong plans train without an error and without the tensor-parallel peers drifting apart: a fused
projection (q, k and v in one ``Linear``) split column-wise gives each rank a slice across q, k and v rather
than whole heads; a module that takes a head count or a width from a constant rather than from its weights
computes with the wrong number. Every peer computes alike, so nothing the peers compare can tell (see
:mod:`.peers`). The block itself can: run whole on the same input, it must give what the split block gives.

For each kind of block (its class and its plan: a model's decoder layers are one kind), a copy without
parameters is made before the plan splits the first block of the kind, and the last input that block
receives in training before the first optimizer step is kept (a pipeline's stages first infer their shapes
on placeholders). After the first optimizer step of a fit, both run on that input in eval mode, without
gradients, under training's autocast and with the random generators set aside: the split block on the peers
as it trains, and the copy with each parameter gathered whole (``DTensor.full_tensor``) on the input gathered
whole (an input split by sequence position is joined along the dimension its plan splits). Outputs that
differ beyond rounding stop every rank, the message agreed with the peers' check. A check that cannot run
(the copy fails) is logged and stops nothing. The cost: once per fit, one more forward of each kind of
block, and its whole weights held for that forward.
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

__all__ = ["PlanCheck"]

log = logging.getLogger(__name__)
_Context = Callable[[], AbstractContextManager[Any]]

# relative to the output's norm: a split sums in another order (1e-6 in fp32); a wrong plan is off by ~1
_TOLERANCE = 1e-3
_REDUCED_TOLERANCE = 3e-2  # 16-bit outputs, autocast, or TF32 matmuls: 8 to 11 bits of mantissa


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
            self.watched.append(_Watched(name, block, plan))

    def run(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        """Compare every watched block (collectives over the peers ``group`` and each parameter's mesh: every
        rank of a stage calls it, its blocks in the same order). What differs, or ``None``."""
        watched, self.watched = self.watched, []
        context, checked = self.forward_context, self.checked
        problems = [problem for w in watched if (problem := w.check(group, device, context, checked))]
        return "; ".join(problems) or None


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
        if module.training and not torch.is_inference_mode_enabled():
            self.inputs = (_map(_kept, args), _map(_kept, kwargs))

    def check(self, group: dist.ProcessGroup, device: torch.device, context: _Context, checked: list[str]) -> Any:
        self.handle.remove()
        inputs, self.inputs = self.inputs, None
        (ready,) = agree([1.0 if inputs is not None else 0.0], op="min", device=device, group=group)
        if not ready:  # the block did not train on some peer (nothing to compare on)
            return None
        modes = [(m, m.training) for m in self.block.modules()]
        error: Exception | None = None
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), context():
                found = self._run(*inputs, group, device, checked)  # type: ignore[misc]
        except Exception as exc:  # the same on every peer: they run the same code on the same tensors
            error, found = exc, None
        finally:
            for module, mode in modes:
                module.training = mode
            for module in self.block.modules():  # ZeRO-3's units gathered for this forward: sharded again
                if isinstance(module, FSDPModule):
                    module.reshard()
        (ran,) = agree([0.0 if error is not None else 1.0], op="min", device=device, group=group)
        if not ran:  # a check that cannot run stops nothing: the block trains unchecked, and the log says so
            log.warning(f"{self.name} could not be run whole to check its tensor-parallel plan ({error!r}).")
        return found

    def _run(self, args: Any, kwargs: Any, group: dist.ProcessGroup, device: torch.device, checked: list[str]) -> Any:
        self.block.eval()
        split = self.block(*args, **kwargs)
        joined = _Joined(group, self.sequence_dim)
        whole_args, whole_kwargs = _map(joined.input, args), _map(joined.input, kwargs)
        values = {n: _full(v) for n, v in _named_values(self.block)}
        values.update(self.block.named_buffers())
        (ok,) = agree([0.0 if joined.unknown else 1.0], op="min", device=device, group=group)
        if not ok:  # an input split along a dimension the plan does not name: not compared
            return None
        self.whole.eval()
        expected = functional_call(self.whole, values, tuple(whole_args), whole_kwargs, strict=False)
        reduced = torch.is_autocast_enabled(device.type) or torch.get_float32_matmul_precision() != "highest"
        return self._compare(_flat(split), _flat(expected), joined, checked, reduced)

    def _compare(
        self, split: list[Tensor], expected: list[Tensor], joined: _Joined, checked: list[str], reduced: bool
    ) -> str | None:
        checked.append(self.name)
        if len(split) != len(expected):
            return f"{self.name} gives {len(split)} tensors split and {len(expected)} whole"
        for i, (mine, want) in enumerate(zip(split, expected)):
            got = joined.output(mine, want.shape)
            if got is None:
                return (
                    f"{self.name}'s output {i} has shape {tuple(mine.shape)} split, {tuple(want.shape)} whole: no"
                    " dimension it could be split along"
                )
            gap = _relative_gap(got, want)
            full = want.dtype in (torch.float32, torch.float64) and not reduced
            tolerance = _TOLERANCE if full else _REDUCED_TOLERANCE
            if not gap <= tolerance:
                return (
                    f"{self.name}'s output {i} split differs from the block run whole on the same input (relative"
                    f" difference {gap:.2e}, rounding allows {tolerance:.0e})"
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


def _relative_gap(got: Tensor, want: Tensor) -> float:
    """The norm of the difference over the norm of ``want``, where both are finite; a position finite in one
    and not in the other (NaN where a padded row's attention is fully masked, in both, is alike) is ``inf``."""
    got, want = got.double(), want.double()
    finite = got.isfinite() & want.isfinite()
    alike = (got == want) | (got.isnan() & want.isnan())
    if not bool((finite | alike).all()):
        return float("inf")
    difference = torch.where(finite, got - want, 0.0).norm()
    return float(difference / torch.where(finite, want, 0.0).norm().clamp_min(1e-30))


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
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _flat(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    return []
