"""Tensor-parallel parameters held as this rank's slices: plain parameters to the optimizer, DTensors when read.

``parallelize_module`` leaves each split parameter a DTensor on the tensor-parallel mesh. Everything the
pack does around a step (ZeRO-0/1/2 buckets and flat shards, the optimizer, gradient clipping, checkpoints)
works on plain tensors, so each such parameter is replaced by a plain ``nn.Parameter`` holding this rank's
slice, which records where that slice lies in the whole tensor (:class:`TensorSlice`). Reading the parameter as
an attribute of its module (``module.weight``: the module's own forward, a parent's forward, a training step,
a callback) gives a DTensor made from the slice (``DTensor.from_local``, differentiable), so torch's parallel
styles run unchanged, code anywhere computes with the whole tensor's meaning (a norm is the whole norm; mixing
it with a plain tensor is torch's error, never a silent slice) and the gradient arrives on the plain parameter
as this rank's slice of the whole gradient (a replicated parameter's gradient summed over the tensor-parallel
group, where the style left it partial). This is the composition torch itself uses under DDP
(``torch.distributed.tensor.parallel.ddp``), done here without re-creating parameters after each forward.
Only attribute lookups see the DTensor: ``named_parameters``, ``parameters``, ``state_dict`` and their order
stay the plain parameters' (the optimizer, the flat buffers and the checkpoints work on slices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_hybrid._slices import TensorSlice, mark_slice, tensor_slice
from lightning_hybrid._torch_compat import own_parameters
from lightning_hybrid.strategies._params import user_attributes

__all__ = [
    "TensorSlice",
    "local_boxes",
    "loss_context",
    "local_part",
    "localize",
    "plain",
    "plain_loss",
    "same_random_streams",
    "split_tensors",
    "state_name",
    "tensor_slice",
    "tensor_slices",
    "whole",
    "whole_boxes",
    "whole_on_every_rank",
    "whole_shape",
]


def tensor_slices(module: nn.Module) -> dict[str, TensorSlice]:
    """Every localized parameter of ``module`` by name (tied ones under each of their names)."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        found = tensor_slice(p)
        if found is not None:
            out[name] = found
    return out


def localize(module: nn.Module) -> int:
    """Replace every DTensor parameter of ``module`` (and its submodules) by a plain parameter holding this
    rank's slice, in place and in the same position; reading one as an attribute gives its DTensor view.
    Returns how many parameters were localized."""
    count = 0
    made: dict[int, nn.Parameter] = {}  # a tied DTensor (one parameter under several modules) stays one
    for owner in module.modules():
        names = []
        own = own_parameters(owner)
        for name, p in list(own.items()):
            if not isinstance(p, DTensor):
                continue
            plain = made.get(id(p))
            if plain is None:
                plain = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                vars(plain).update(user_attributes(p))  # a no-decay mark the user set stays
                mark_slice(plain, TensorSlice(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride())))
                made[id(p)] = plain
                count += 1
            own[name] = plain  # the same key: named_parameters keeps its order
            names.append(name)
        if names:
            _read_as_dtensors(owner, names)
    return count


_VIEWED = "lightning_hybrid_split_names"  # on a module: the names its attribute lookups give as DTensors
_VIEW_CLASSES: dict[type, type] = {}


def _read_as_dtensors(owner: nn.Module, names: list[str]) -> None:
    """``owner.<name>`` gives the DTensor view of the split parameter from now on. The module's class becomes a
    subclass whose attribute lookup makes the view (a parameter is found by ``nn.Module.__getattr__``, which
    Python calls only when the instance has no such attribute: the lookup costs nothing for anything else);
    FSDP2's ``fully_shard`` changes the class the same way."""
    vars(owner)[_VIEWED] = frozenset(vars(owner).get(_VIEWED, ())) | frozenset(names)
    cls = type(owner)
    if cls in _VIEW_CLASSES.values():
        return
    if cls not in _VIEW_CLASSES:
        lookup = cls.__getattr__

        def __getattr__(self: nn.Module, name: str) -> Any:
            if name in vars(self).get(_VIEWED, ()):
                p = own_parameters(self).get(name)
                found = tensor_slice(p) if p is not None else None
                if found is not None:
                    return _attribute_view(p, found, f"{type(self).__name__}.{name}")
            return lookup(self, name)

        _VIEW_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,), {"__getattr__": __getattr__})
    owner.__class__ = _VIEW_CLASSES[cls]


def _attribute_view(p: nn.Parameter, found: TensorSlice, where: str) -> DTensor:
    """The DTensor an attribute read gives. It is a view made for this read, not the parameter: what would act on
    the parameter itself is sent there (``requires_grad_``) or refused with where to do it (a hook on the view
    would run for this view's graph only, never for a later step). Traced by ``torch.compile``, it is the plain
    view (the compiler reads no instance attributes of a tensor)."""
    view = found.as_dtensor(p)
    if not torch.compiler.is_compiling():
        refused = _RefusedOnView(where)
        vars(view).update(register_hook=refused, register_post_accumulate_grad_hook=refused, requires_grad_=_SetOn(p))
    return view


class _RefusedOnView:
    """A hook registered on an attribute view: refused with where to put it (module level: a view pickles)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"{self.where} is split by tensor parallelism and held as this rank's slice (zero_stage 0-2): read as an"
            " attribute it is a DTensor view made for this read, so a hook on it would never run for a later"
            " step. Register the hook on the parameter from named_parameters() (its gradient is this rank's slice"
            " of the whole gradient), or use zero_stage=3, where split parameters are DTensors themselves."
        )


class _SetOn:
    """``requires_grad_`` on an attribute view: set on the parameter (returned)."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param

    def __call__(self, requires_grad: bool = True) -> nn.Parameter:
        return self.param.requires_grad_(requires_grad)


def whole(values: dict[str, Any], slices: dict[str, TensorSlice], name_of: Any = None) -> dict[str, Any]:
    """``values`` with each tensor-parallel entry as a DTensor of the whole tensor (sharing the local
    storage), so torch DCP writes and reads every rank's slice under the unsplit name and shape. A key's
    parameter is ``name_of(key)`` (default: the key itself); entries of another shape (a scalar state) stay."""
    out = dict(values)
    for key, value in values.items():
        found = slices.get(name_of(key) if name_of else key)
        local = found is not None and isinstance(value, Tensor) and not isinstance(value, DTensor)
        if local and tuple(value.shape) == found.local_shape():
            out[key] = found.as_dtensor(value)
    return out


def plain(values: dict[str, Any], slices: dict[str, TensorSlice], name_of: Any = None) -> dict[str, Any]:
    """The inverse of :func:`whole` after a read: the tensor-parallel entries as this rank's slices (other
    DTensors, ZeRO-3's, stay)."""
    return {
        k: v.to_local() if isinstance(v, DTensor) and (name_of(k) if name_of else k) in slices else v
        for k, v in values.items()
    }


def local_boxes(param: Tensor, boxes: list[tuple[tuple[int, ...], Tensor]]) -> list[tuple[tuple[int, ...], Tensor]]:
    """The inverse of :func:`whole_boxes`: offsets in the unsplit tensor back to ``param``'s local ones."""
    found = tensor_slice(param)
    if found is None:
        return boxes
    origin = found.origin()
    return [(tuple(o - d for o, d in zip(offsets, origin)), box) for offsets, box in boxes]


def local_part(param: Tensor, value: Tensor) -> Tensor:
    """This rank's slice of ``value``, a tensor of ``param``'s unsplit shape (itself when not split)."""
    found = tensor_slice(param)
    if found is None or found.dim is None:
        return value
    return value.narrow(found.dim, found.origin()[found.dim], param.shape[found.dim])


def whole_shape(param: Tensor) -> torch.Size:
    """The unsplit shape of ``param`` (its own for a parameter tensor parallelism does not split)."""
    found = tensor_slice(param)
    return found.shape if found is not None else torch.Size(param.shape)


def state_name(key: str) -> str:
    """The parameter name of a flat optimizer-state key (``state.<name>.<key>``, ``param_groups.<name>.<key>``)."""
    return key.partition(".")[2].rpartition(".")[0]


def whole_boxes(
    param: Tensor, boxes: list[tuple[tuple[int, ...], Tensor]]
) -> tuple[torch.Size, list[tuple[tuple[int, ...], Tensor]]]:
    """The whole tensor's shape and ``boxes`` (offsets in ``param``'s local shape) moved to the whole tensor's
    offsets: a flat shard of a tensor-parallel slice is then a set of chunks of the unsplit tensor."""
    found = tensor_slice(param)
    if found is None:
        return torch.Size(param.shape), boxes
    origin = found.origin()
    return found.shape, [(tuple(o + d for o, d in zip(offsets, origin)), box) for offsets, box in boxes]


def whole_on_every_rank(module: nn.Module, axis: str) -> list[nn.Parameter]:
    """The parameters of ``module`` that every tensor-parallel rank holds all of: not split by the plan, or
    split as ``Replicate`` (a row-wise layer's bias); a DTensor on a mesh with the tensor-parallel dimension
    ``axis`` (ZeRO-3 on top) counts by its placement there."""
    out = []
    for p in module.parameters():
        found = tensor_slice(p)
        if found is not None:
            split = found.dim is not None
        elif isinstance(p, DTensor) and axis in (p.device_mesh.mesh_dim_names or ()):
            placement = p.placements[p.device_mesh.mesh_dim_names.index(axis)]
            split = not (placement.is_replicate() or placement.is_partial())
        else:
            split = False
        if not split:
            out.append(p)
    return out


def split_tensors(params: list[Tensor], first: int = 0) -> dict[int, dist.ProcessGroup]:
    """The tensor-parallel group of each parameter held as a slice, by its number (counted from ``first``):
    whole-tensor norms (LAMB, LARS) sum these over it."""
    out = {}
    for i, p in enumerate(params):
        found = tensor_slice(p)
        if found is not None and found.dim is not None:
            out[first + i] = found.mesh.get_group()
    return out


def plain_loss(value: Any) -> Any:
    """A loss computed on DTensors (a vocabulary-parallel cross-entropy gives a replicated DTensor) as a plain
    tensor with its graph, so that Lightning and the pipeline see what they see without tensor parallelism; a
    ``{"loss": ...}`` dict has its loss converted; anything else is returned as it is."""
    if isinstance(value, dict) and isinstance(value.get("loss"), DTensor):
        return {**value, "loss": plain_loss(value["loss"])}
    if isinstance(value, DTensor):
        return value.to_local() if all(p.is_replicate() for p in value.placements) else value.full_tensor()
    return value


_LOSS_PARALLEL_DEPTH = [0]  # torch's loss_parallel() is not re-entrant: a nested exit removes its ops twice


@contextlib.contextmanager
def loss_context(tensor_parallel_size: int) -> Iterator[None]:
    """torch's ``loss_parallel()`` under tensor parallelism (a cross-entropy on logits split by vocabulary,
    forward and backward, is exact without gathering them), else nothing; entered once however deeply nested
    (a manual backward inside training_step)."""
    if tensor_parallel_size <= 1 or _LOSS_PARALLEL_DEPTH[0]:
        _LOSS_PARALLEL_DEPTH[0] += tensor_parallel_size > 1
        try:
            yield
        finally:
            _LOSS_PARALLEL_DEPTH[0] -= tensor_parallel_size > 1
        return
    _LOSS_PARALLEL_DEPTH[0] += 1
    try:
        with loss_parallel():
            yield
    finally:
        _LOSS_PARALLEL_DEPTH[0] -= 1


def same_random_streams(group: dist.ProcessGroup) -> None:
    """Tensor-parallel peers compute the replicated parts of each block alike, dropout included: their random
    generators (host, and the accelerator's) start training from the first peer's state, whatever seed each
    process was given."""
    states: list[Any] = [(torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)]
    dist.broadcast_object_list(states, group=group, group_src=0)
    cpu, accelerator = states[0]
    torch.set_rng_state(cpu)
    if accelerator is not None:
        torch.cuda.set_rng_state_all(accelerator)
