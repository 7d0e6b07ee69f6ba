"""Layer-wise adaptive optimizers (LAMB, LARS) whose per-tensor norms stay exact when the tensors are sharded.

Both scale each parameter tensor's update by a trust ratio ``||w|| / ||update||`` (1 when either norm is
0). A norm is over the *whole* model tensor, wherever its elements live:

- unsharded (one process, a pipeline, ZeRO-0): each parameter is a tensor; nothing is communicated;
- ZeRO-3 (FSDP2 DTensor parameters, also under Lightning's ModelParallelStrategy): each rank sums the
  squares of its local shard, and the sums are all-reduced over each mesh dimension that shards it (data
  parallelism, and tensor parallelism under it);
- tensor parallelism (a parameter held as this rank's slice): the partition names the tensors that are
  slices, and their sums are all-reduced over the tensor-parallel group too;
- ZeRO-1/2 (flat shards): the optimizer steps chunks of a flat buffer, each a piece of one model tensor whose
  other pieces other ranks step; the strategy hands the optimizer a :class:`TensorPartition` (which model
  tensor each stepped chunk belongs to), and the per-tensor sums are all-reduced over the data-parallel group.

Norms are never reduced across pipeline stages: a tensor lives in one stage. One all-reduce of ``2 x
tensors`` floats per step (per reduction group); the update is computed twice (once for its norm, once to
apply it) instead of being held for the whole shard.
"""

from __future__ import annotations

import bisect
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement
from torch.optim import Optimizer

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer", "TensorPartition"]


@dataclass(frozen=True)
class TensorPartition:
    """Which model tensor each element of an optimizer parameter belongs to, and where the others are.

    ``segments[param]``: ``(tensor, lo, hi)`` triples, elements ``lo:hi`` of ``param.view(-1)`` are part of
    tensor number ``tensor`` (``0 <= tensor < num_tensors``); elements in no segment (padding) are left
    alone. Every rank of ``group`` holds the rest of those tensors, with the same numbering.

    Args:
        segments: per optimizer parameter, its ``(tensor, lo, hi)`` triples.
        num_tensors: how many model tensors the parameters hold parts of, over all ranks of ``group``.
        group: the process group whose ranks hold the other parts (``None``: every tensor is whole here).
        split: tensors that are themselves slices of a larger model tensor (tensor parallelism), by number,
            with the process group whose ranks hold its other slices; summed over it after ``group``.
    """

    segments: dict[Tensor, list[tuple[int, int, int]]]
    num_tensors: int
    group: dist.ProcessGroup | None
    split: dict[int, dist.ProcessGroup] = field(default_factory=dict)

    @staticmethod
    def of_flat_ranges(
        chunks: Iterable[tuple[Tensor, int]], offsets: list[int], numels: list[int], first_tensor: int
    ) -> dict[Tensor, list[tuple[int, int, int]]]:
        """Segments of ``chunks`` (each a parameter and its start in a flat buffer) over tensors laid out
        at ``offsets`` of that buffer, numbered from ``first_tensor``."""
        out: dict[Tensor, list[tuple[int, int, int]]] = {}
        for chunk, start in chunks:
            stop = start + chunk.numel()
            segs = []
            j = max(0, bisect.bisect_right(offsets, start) - 1)
            while j < len(offsets) and offsets[j] < stop:
                lo, hi = max(start, offsets[j]), min(stop, offsets[j] + numels[j])
                if lo < hi:
                    segs.append((first_tensor + j, lo - start, hi - start))
                j += 1
            out[chunk] = segs
        return out


class _Slots:
    """The norm slots of one step: every stepped tensor's segments, numbered, with their reduction group."""

    def __init__(self, params: list[Tensor], partition: TensorPartition | None) -> None:
        self.segments: dict[Tensor, list[tuple[int, int, int]]] = {}
        self.groups: dict[dist.ProcessGroup | None, list[int]] = {}
        n = partition.num_tensors if partition is not None else 0
        if partition is not None:
            self.groups[partition.group] = list(range(n))
            for t, group in partition.split.items():  # summed over the slices' ranks after the shards' group
                self.groups.setdefault(group, []).append(t)
        for p in params:
            if partition is not None:
                if p not in partition.segments:
                    raise ValueError(
                        f"a parameter of shape {tuple(p.shape)} is stepped but not in the tensor partition the"
                        " strategy set: add parameter groups before the strategy shards the optimizer"
                    )
                self.segments[p] = partition.segments[p]
                continue
            # a DTensor's squares are summed over each mesh dimension that shards it, one after the other (FSDP2
            # over data parallelism, and tensor parallelism under it): over the product of those dimensions
            groups: list[dist.ProcessGroup | None] = [None]
            if isinstance(p, DTensor):
                groups = [p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if _splits(pl)]
            self.segments[p] = [(n, 0, _local(p).numel())]
            for group in groups:
                self.groups.setdefault(group, []).append(n)
            n += 1
        self.num = n

    def reduce(self, sums: Tensor) -> None:
        """Sum ``sums`` (2 x slots) over each slot's group: whole-tensor squared norms on every rank."""
        for group, slots in self.groups.items():
            if group is None or not slots or dist.get_world_size(group) == 1:
                continue
            index = torch.tensor(slots, device=sums.device)
            part = sums[:, index].contiguous()
            dist.all_reduce(part, group=group)
            sums[:, index] = part


def _splits(placement: Placement) -> bool:
    """Whether a mesh dimension holds parts of the tensor: ``Shard``, and FSDP2's strided shard over tensor
    parallelism (torch 2.13's ``_StridedShard`` is no ``Shard`` and says ``is_shard() == False``)."""
    return not (placement.is_replicate() or placement.is_partial())


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _pieces(segments: list[tuple[int, int, int]], *tensors: Tensor) -> list[tuple]:
    """``(tensor, piece of each of tensors)`` per segment: the tensors themselves for a segment that is the
    whole of them (any memory layout), else views of flat chunks (contiguous by construction)."""
    if len(segments) == 1 and segments[0][1] == 0 and segments[0][2] == tensors[0].numel():
        return [(segments[0][0], *tensors)]
    return [(t, *(x.view(-1)[lo:hi] for x in tensors)) for t, lo, hi in segments]


def _zero_outside(flat: Tensor, segments: list[tuple[int, int, int]]) -> None:
    covered = 0
    for _, lo, hi in sorted(segments, key=lambda s: s[1]):
        flat[covered:lo].zero_()
        covered = hi
    flat[covered:].zero_()


def _norm(x: Tensor) -> Tensor:
    """L2 norm in float64, accumulated in at least fp32 (a bf16 norm would round differently per layout)."""
    return torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32)).double()


class LayerwiseOptimizer(Optimizer, metaclass=ABCMeta):
    """Base of optimizers that scale each tensor's update by a ratio of whole-tensor norms.

    A subclass implements :meth:`_prepare` (create and update the state with the gradient), :meth:`_update`
    (the direction, recomputable from the state) and :meth:`_apply` (the step, given the direction already
    scaled by each tensor's trust ratio). Tensors reach them local: a DTensor's shard. The
    strategy calls :meth:`set_tensor_partition` when it shards the parameters this optimizer steps. Its
    constructor is ``torch.optim.Optimizer``'s."""

    _partition: TensorPartition | None = None

    def set_tensor_partition(self, partition: TensorPartition | None) -> None:
        self._partition = partition

    @abstractmethod
    def _prepare(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        """Update ``state`` with ``grad``; ``param`` is the optimizer's own (a DTensor stays one, so state
        created like it is sharded like it)."""

    @abstractmethod
    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor:
        """The direction whose norm the trust ratio divides by (a new tensor)."""

    @abstractmethod
    def _apply(self, p: Tensor, scaled: Tensor, state: dict, group: dict) -> None:
        """Step ``p`` with ``scaled``: the direction times its tensor's trust ratio (0 outside any tensor)."""

    def _ratio(self, w_norm: Tensor, u_norm: Tensor, group: dict) -> Tensor:
        return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm.clamp_min(1e-38), torch.ones_like(w_norm))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not stepped and self._partition is None:
            return loss
        # with a partition the norms are summed over the group even where this rank steps nothing (its shard
        # may hold only frozen or unused parameters): every rank takes part in the all-reduce
        for p, group in stepped:
            self._prepare(p, _local(p.grad), self.state[p], group)
        slots = _Slots([p for p, _ in stepped], self._partition)
        anchors = [p for p, _ in stepped] or [p for g in self.param_groups for p in g["params"]]
        anchors = anchors or list(self._partition.segments) if self._partition is not None else anchors
        device = _local(anchors[0]).device if anchors else torch.device("cpu")
        sums = torch.zeros(2, slots.num, dtype=torch.float64, device=device)
        for p, group in stepped:
            w, g, state = _local(p), _local(p.grad), self.state[p]
            u = self._update(w, g, state, group)
            for t, piece_w, piece_u in _pieces(slots.segments[p], w, u):
                sums[0, t] += _norm(piece_w).square()
                sums[1, t] += _norm(piece_u).square()
        slots.reduce(sums)
        norms = sums.sqrt()
        for p, group in stepped:
            w, g, state = _local(p), _local(p.grad), self.state[p]
            update = self._update(w, g, state, group).contiguous()
            _zero_outside(update.view(-1), slots.segments[p])  # padding stays put
            for t, piece in _pieces(slots.segments[p], update):
                piece.mul_(self._ratio(norms[0, t], norms[1, t], group).to(w.dtype))
            self._apply(w, update, state, group)
        return loss


def _check(name: str, value: float, low: float = 0.0) -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


class LAMB(LayerwiseOptimizer):
    """LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

    Per parameter tensor ``w``, with Adam's bias-corrected moments::

        m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
        w = w - lr * (||w|| / ||u||) * u          (ratio 1 when ||w|| or ||u|| is 0)

    Norms are over whole tensors under every layout (see the module docstring). The state keys are Adam's
    (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints reshard like Adam's.

    Args:
        params: the parameters or parameter groups, as for any torch optimizer.
        lr: the learning rate.
        betas: Adam's ``(b1, b2)``.
        eps: added to the second moment's root.
        weight_decay: decoupled weight decay, inside the trust-ratio update ``u``.

    Example (LightningCLI YAML)::

        optimizer:
          class_path: lightning_hybrid.optim.LAMB
          init_args: {lr: 0.002, weight_decay: 0.01}
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        _check("lr", lr)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {tuple(betas)!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _prepare(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        _local(state["exp_avg"]).lerp_(grad, 1 - beta1)
        _local(state["exp_avg_sq"]).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor:
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt_().add_(group["eps"]))
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def _apply(self, p: Tensor, scaled: Tensor, state: dict, group: dict) -> None:
        p.sub_(scaled, alpha=group["lr"])


class LARS(LayerwiseOptimizer):
    """LARS (You et al., 2017, "Large Batch Training of Convolutional Networks"), with momentum.

    Per parameter tensor ``w``::

        d = g + weight_decay * w
        r = trust_coefficient * ||w|| / (||d|| + eps)      (1 when ||w|| or ||d|| is 0)
        buf = momentum * buf + lr * r * d
        w = w - buf

    Norms are over whole tensors under every layout. The denominator is the norm of the whole update ``d``
    (the 2017 paper writes its bound ``||g|| + weight_decay * ||w||``). The state key is SGD's
    (``momentum_buffer``), but the buffer holds ``lr`` times the update, so an SGD checkpoint's buffer is
    not interchangeable with it.

    Args:
        params: the parameters or parameter groups, as for any torch optimizer.
        lr: the learning rate.
        momentum: the momentum of ``buf``.
        weight_decay: weight decay, added to the gradient in ``d``.
        trust_coefficient: scales the trust ratio ``r``.
        eps: added to the denominator of ``r``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
    ) -> None:
        _check("lr", lr)
        _check("momentum", momentum)
        _check("weight_decay", weight_decay)
        _check("eps", eps)
        if not trust_coefficient > 0:
            raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient!r}")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "eps": eps}  # fmt: skip
        super().__init__(params, defaults)

    def _prepare(self, param: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        if not state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> Tensor:
        return grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else grad.clone()

    def _ratio(self, w_norm: Tensor, u_norm: Tensor, group: dict) -> Tensor:
        ratio = group["trust_coefficient"] * w_norm / (u_norm + group["eps"])
        return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(w_norm))

    def _apply(self, p: Tensor, scaled: Tensor, state: dict, group: dict) -> None:
        buf = _local(state["momentum_buffer"])
        buf.mul_(group["momentum"]).add_(scaled, alpha=group["lr"])
        p.sub_(buf)
