"""ZeRO-1 / ZeRO-2 for plain (replicated) parameters: optimizer state sharded over the data-parallel group.

The parameters of each parameter group (one flat group per dtype and device in it) are moved into one
buffer, padded to a multiple of the data-parallel size; rank ``r`` owns the contiguous slice ``r``. The
optimizer object keeps its identity and its groups keep the model's parameters, so LR schedulers and
callbacks that read or change param groups (``BackboneFinetuning``, ``LearningRateMonitor``, SWA) see what
they would see without ZeRO. Only from the end of a window's backward to the end of the optimizer step
(:meth:`FlatShardedOptimizer.swap_in`) do the groups hold this rank's *chunks*: views of its slice cut at
parameter boundaries, so optimizer state is allocated for ``1/N`` of the parameters, is kept per parameter
(its own ``step``), and a parameter no rank produced a gradient for is not stepped, as in one process. A
group added after set-up (``optimizer.add_param_group``) is flattened and sharded at the next step, and
``optimizer.zero_grad()`` discards the gradients wherever ZeRO holds them.

Element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) are exact on a shard; an optimizer that
needs whole-tensor norms is told which tensor each element of its chunks belongs to
(:meth:`tensor_partition`, used by ``lightning_hybrid.optim.LAMB`` / ``LARS``); any other is refused at
set-up (``lightning_hybrid.optim._shardable``).

Checkpoints: ``flat_state.FlatStateDict``.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid._torch_compat import replace_optimizer_step
from lightning_hybrid.optim.layerwise import TensorPartition
from lightning_hybrid.strategies._user_code import UserGradientCode
from lightning_hybrid.strategies.tensor.local import split_tensors
from lightning_hybrid.strategies.zero.bucket_gradients import BucketGradients
from lightning_hybrid.strategies.zero.buckets import BucketQueue
from lightning_hybrid.strategies.zero.flat_gradients import FlatGradients, WindowGradients
from lightning_hybrid.strategies.zero.flat_state import FlatStateDict
from lightning_hybrid.strategies.zero.flat_step import FlatStep
from lightning_hybrid.strategies.zero.group_gradients import GroupGradients
from lightning_hybrid.strategies.zero.sharded_state import ShardedState, checkpoint_advice

__all__ = ["FlatShardedOptimizer"]

# the most elements one optimizer parameter (a chunk of a shard) holds: 8 MiB of fp32
STEP_CHUNK_NUMEL = 2**21


@dataclass
class _Chunk:
    """What the optimizer steps: elements ``start:stop`` of this rank's slice, all of parameter ``index``."""

    index: int
    start: int
    stop: int
    tensor: nn.Parameter


@dataclass
class _FlatGroup:
    settings: dict[str, Any]  # the user's param group (its "params" are swapped while stepping)
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: Tensor  # the parameters' storage, padded to a multiple of the group size
    shard: nn.Parameter  # this rank's slice of `flat`
    grads: GroupGradients  # where the gradients live and how they reach `shard.grad`
    chunks: list[_Chunk]

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


class FlatShardedOptimizer(FlatStep, FlatStateDict):
    """Owns the sharding of one optimizer; the strategy calls it around Lightning's optimizer step."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        names: dict[Tensor, str],
        group: dist.ProcessGroup,
        zero_stage: int,
        reduce_gradients: str = "every_microbatch",
        bucket_numel: int = 2**22,
        queue: BucketQueue | None = None,
        user: UserGradientCode | None = None,
    ) -> None:
        assert zero_stage in (1, 2), zero_stage  # the layout validated it
        fresh_adagrad = isinstance(optimizer, torch.optim.Adagrad) and all(
            float(s.get("step", 0)) == 0 for s in optimizer.state.values()
        )
        if fresh_adagrad:  # Adagrad creates its state in its constructor: created again for the chunks
            optimizer.state.clear()
        elif optimizer.state:
            raise RuntimeError("the optimizer already has state; shard it before the first step")
        self.optimizer = optimizer
        self.group = group
        self.zero_stage, self.reduce_mode, self.bucket_numel = zero_stage, reduce_gradients, bucket_numel
        self.queue = queue if queue is not None else BucketQueue()
        self.names = names
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.groups: list[_FlatGroup] = []
        self._by_params: dict[tuple[int, ...], list[_FlatGroup]] = {}
        self._adagrad = fresh_adagrad
        self._where: dict[str, tuple[_FlatGroup, int]] = {}
        self._templates: dict[tuple[int, str, torch.dtype], Tensor] = {}  # shared loading buffers
        self._stepping = False
        # between a pipeline's backward (inside training_step) and Lightning's backward call, Lightning's
        # zero_grad at a window's first batch must not discard the gradients the schedule just produced
        self.hold = False
        self.problem: str | None = None  # adopting added groups failed on this rank: agreed by reduce_gradients
        self.user_problem: str | None = None  # user code assigned a gradient the pack had taken (refused)
        self.user = user or UserGradientCode()
        self._zero_grad, self._step = optimizer.zero_grad, optimizer.step
        # the optimizer's zero_grad discards the flat buffers and buckets too, and its step first checks what user
        # code did to the gradients since the step began (set on the instance: the optimizer keeps its class and
        # identity; Lightning and user code call both as before)
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]
        # a method of the optimizer itself: an LR scheduler made later (SWALR) rebinds what it wraps to the optimizer
        replace_optimizer_step(optimizer, _stepping(self))
        # user code reading or writing whole optimizer state is told where it is (``sharded_state``)
        optimizer.state_dict = self._refuse_state_dict  # type: ignore[method-assign]
        optimizer.load_state_dict = self._refuse_state_dict  # type: ignore[method-assign]
        self.sync_groups()
        self._keep_state_sharded()

    # ------------------------------------------------------------------------------------------- groups

    def sync_groups(self) -> bool:
        """Take charge of param groups added since the last call (flattened and sharded now). Returns whether
        any was added. A group whose parameters changed in place cannot be resharded and is refused."""
        added = False
        seen: set[int] = set()
        for pg in self.optimizer.param_groups:
            key = tuple(id(p) for p in pg["params"])
            flat_groups = self._by_params.get(key)
            if flat_groups is None:
                clash = [
                    self.names.get(p, "?") for p in pg["params"] if any(p is q for g in self.groups for q in g.params)
                ]
                if clash:
                    raise RuntimeError(
                        f"A param group now holds {clash[:3]}, which an earlier group held when the strategy sharded"
                        " the optimizer: under zero_stage 1/2 a parameter's group cannot change after set-up. Add new"
                        " parameters with optimizer.add_param_group(...) instead, or use zero_stage=0 or 3."
                    )
                flat_groups = self._add_group(pg)
                self._by_params[key] = flat_groups
                added = True
            for g in flat_groups:
                g.settings = pg  # a callback may have replaced the group's dict (BackboneFinetuning on resume)
            seen.update(id(g) for g in flat_groups)
        gone = [g for g in self.groups if id(g) not in seen]
        if gone:
            raise RuntimeError(
                f"A param group holding {gone[0].names[:3]} was removed from the optimizer after the strategy"
                " sharded it (zero_stage 1/2); freeze the parameters (requires_grad=False) instead."
            )
        return added

    def _add_group(self, pg: dict[str, Any]) -> list[_FlatGroup]:
        params = list(pg["params"])
        unknown = [tuple(p.shape) for p in params if p not in self.names]
        if unknown:
            raise ValueError(
                f"A param group holds parameters of shapes {unknown[:3]} that the module did not have when the"
                " strategy sharded the optimizer (zero_stage 1/2 shards the module's own parameters only). Create"
                " them in the module before fit (frozen until needed, if they are added later), or use"
                " zero_stage=0 or 3."
            )
        kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:  # one flat buffer per dtype and device (a bf16 parameter beside fp32 ones)
            kinds.setdefault((p.dtype, p.device), []).append(p)
        made = []
        for (dtype, device), members in kinds.items():
            g = self._flat_group(pg, members, dtype, device)
            self.groups.append(g)
            made.append(g)
            for i, name in enumerate(g.names):
                self._where[name] = (g, i)
        return made

    def _flat_group(
        self, pg: dict[str, Any], params: list[nn.Parameter], dtype: torch.dtype, device: torch.device
    ) -> _FlatGroup:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        padded = -(-max(total, 1) // self.world) * self.world
        shard_numel = padded // self.world
        # the parameters become views of one flat buffer and the shard is a view of that buffer too: the
        # optimizer updates the model's own memory, no second copy of the weights exists
        flat = _flatten(params, offsets, padded, dtype, device)
        shard = nn.Parameter(flat[self.rank * shard_numel : (self.rank + 1) * shard_numel], requires_grad=True)
        # chunks: this rank's range of each parameter, in pieces of a bounded size (an optimizer's temporaries,
        # Adam's denominator, are then a chunk, not the shard)
        step = min(self.bucket_numel, STEP_CHUNK_NUMEL)
        base = self.rank * shard_numel
        chunks = []
        for i, (p, off) in enumerate(zip(params, offsets)):
            lo, hi = max(off, base), min(off + p.numel(), base + shard_numel)
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                chunks.append(_Chunk(i, a - base, b - base, nn.Parameter(shard.data[a - base : b - base])))
        grads = self._gradients(params, offsets, padded, dtype, device)
        names = [self.names[p] for p in params]
        if self._adagrad:
            for c in chunks:
                self.optimizer.state[c.tensor] = {
                    "step": torch.zeros((), device=device) if pg.get("fused") else torch.tensor(0.0),
                    "sum": torch.full_like(c.tensor, pg["initial_accumulator_value"]),
                }
        return _FlatGroup(pg, params, names, offsets, flat, shard, grads, chunks)

    def _gradients(
        self, params: list[nn.Parameter], offsets: list[int], padded: int, dtype: torch.dtype, device: torch.device
    ) -> GroupGradients:
        names = [self.names[p] for p in params]
        kwargs: dict[str, Any] = {"group": self.group, "dtype": dtype, "device": device, "names": names,
                                  "zero_stage": self.zero_stage, "user": self.user}  # fmt: skip
        if self.zero_stage == 2 and self.reduce_mode == "once_per_step":
            return WindowGradients(params, offsets, padded, **kwargs)
        kwargs.update(bucket_numel=self.bucket_numel, queue=self.queue)
        if self.zero_stage == 1:
            return FlatGradients(params, offsets, padded, **kwargs)
        return BucketGradients(params, offsets, padded, **kwargs)

    def swap_in(self) -> None:
        """From the end of the window's backward to the end of the step: the param groups hold this rank's
        chunks (what the precision plugin unscales and clips, what the optimizer steps)."""
        if self._stepping:
            return
        self._stepping = True
        for settings, groups in self._settings():
            settings["params"] = [c.tensor for g in groups for c in g.chunks]

    def _refuse_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"optimizer.state_dict() / load_state_dict(): {checkpoint_advice(self.zero_stage)}")

    def _keep_state_sharded(self) -> None:
        if not isinstance(self.optimizer.state, ShardedState):
            self.optimizer.state = ShardedState(
                self.optimizer.state, name_of=self.names.get, zero_stage=self.zero_stage
            )

    def swap_out(self) -> None:
        """The rest of the time: the model's own parameters (callbacks and LR schedulers see them)."""
        self._keep_state_sharded()
        if not self._stepping:
            return
        for settings, groups in self._settings():
            settings["params"] = [p for g in groups for p in g.params]
        self._stepping = False

    def _settings(self) -> list[tuple[dict[str, Any], list[_FlatGroup]]]:
        out: dict[int, tuple[dict[str, Any], list[_FlatGroup]]] = {}
        for g in self.groups:
            out.setdefault(id(g.settings), (g.settings, []))[1].append(g)
        return list(out.values())

    def tensor_partition(self) -> TensorPartition:
        """Which model tensor each element of each stepped chunk belongs to (for per-tensor norms)."""
        segments: dict[Tensor, list[tuple[int, int, int]]] = {}
        first = 0
        split = {}
        for g in self.groups:
            for c in g.chunks:
                segments[c.tensor] = [(first + c.index, 0, c.stop - c.start)]
            split.update(split_tensors(g.params, first))
            first += len(g.params)
        return TensorPartition(segments, first, self.group, split)

    @property
    def averaged_every_backward(self) -> bool:
        return self.zero_stage == 2 and self.reduce_mode == "every_microbatch"  # the same on every stage

    def shard_gradient_parts(self, param: Tensor) -> list[Tensor]:
        """The part of ``param``'s gradient in this rank's shard, as the optimizer steps it (empty if none)."""
        g, i = self._where.get(self.names.get(param, ""), (None, -1))
        return [c.tensor.grad for c in g.chunks if c.index == i and c.tensor.grad is not None] if g else []

    def local_gradients(self, skip: Set[int] = frozenset()) -> list[Tensor]:
        """The window's gradient so far as this rank holds it, less the parameters in ``skip`` (ids): views of
        a ZeRO-2 shard gradient around their ranges, or the other parameters' own gradients."""
        out: list[Tensor] = []
        for g in self.groups:
            grads = g.grads.local_gradients()
            if not skip:
                out += grads
            elif isinstance(g.grads, BucketGradients):  # one shard-sized gradient over the group's flat range
                base = self.rank * g.shard_numel
                for shard in grads:
                    for p, off in zip(g.params, g.offsets):
                        lo, hi = max(off, base), min(off + p.numel(), base + g.shard_numel)
                        if id(p) not in skip and lo < hi:
                            out.append(shard[lo - base : hi - base])
            else:
                kept = {id(p.grad) for p in g.params if id(p) not in skip}
                out += [t for t in grads if id(t) in kept]
        return out

    @torch.no_grad()
    def load_parameters_into_shards(self) -> None:
        """Make sure the (just loaded) parameters still live in the flat buffer the shards view."""
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                if p.data_ptr() != g.flat[off:].data_ptr():  # a loader replaced the storage: copy back in
                    g.flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = g.flat[off : off + p.numel()].view_as(p)


@torch.no_grad()
def _flatten(
    params: list[nn.Parameter], offsets: list[int], padded: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """One buffer holding every parameter; each parameter's own storage is freed as soon as it is copied
    (the buffer's untouched pages cost nothing until then), so the model is not held twice. Non-contiguous
    and channels_last parameters become contiguous views (their values, not their strides, are the model)."""
    out = torch.empty(padded, dtype=dtype, device=device)
    end = offsets[-1] + params[-1].numel() if params else 0
    out[end:].zero_()  # the padding
    for p, off in zip(params, offsets):
        out[off : off + p.numel()].copy_(p.detach().reshape(-1))
        p.data = out[off : off + p.numel()].view(p.shape)
    return out


def _stepping(sharded: FlatShardedOptimizer) -> Callable[..., Any]:
    def step(optimizer: Optimizer, closure: Any = None) -> Any:
        return sharded.step(closure)

    return step
