"""How each block splits over the tensor-parallel ranks: the module's plan, checked on the whole module, applied
to this rank's blocks.

A LightningModule trained with ``tensor_parallel_size > 1`` defines ``tensor_parallel_plan(self, name, block)``
returning torch's parallel styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput`` / ``PrepareModuleOutput``) keyed by submodule names inside the block (``fnmatch``
patterns per name level, as ``parallelize_module`` reads them), ``{}`` for a block kept whole on every
tensor-parallel rank on purpose. The blocks are the children of ``self.layers``; a module without
``self.layers`` is one block named ``""`` whose plan is keyed by its full submodule names. The plans are
read and checked on the whole module before the pipeline cuts it, so every rank gives the same verdict; each
rank then applies ``parallelize_module`` to its own blocks on the tensor-parallel mesh, after they are
materialised and before ZeRO shards them (the order torchtitan uses).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from lightning_hybrid._torch_compat import post_accumulate_hooks, tensor_hooks
from lightning_hybrid.strategies._params import attributes_kept
from lightning_hybrid.strategies.tensor.check import PlanCheck
from lightning_hybrid.strategies.tensor.local import localize

__all__ = ["SequenceCheck", "TensorPlans", "UnevenSequence", "plan_blocks", "plan_targets"]

log = logging.getLogger(__name__)

Plan = dict[str, ParallelStyle]
_SPLIT = "lightning_hybrid_tensor_parallel"  # set on a block once its plan is applied


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.Parameter):
        return [(f"layers.{n}", block) for n, block in layers.named_children()]
    return [("", module)]


def plan_targets(block: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The submodules of ``block`` a plan key names, as ``parallelize_module`` resolves it (``""``: the block)."""
    found = [("", block)]
    if not key:
        return found
    for atom in key.split("."):
        found = [(f"{p}.{n}" if p else n, c) for p, m in found for n, c in m.named_children() if fnmatch(n, atom)]
    return found


class TensorPlans:
    """The checked plan of every block of a module, by block name (see the module docstring)."""

    def __init__(self, module: nn.Module, size: int) -> None:
        self.size = size
        self.check = PlanCheck()  # each kind of split block against itself whole, after the first step
        self.sequences = SequenceCheck()  # where sequence parallelism scatters, the length divides: agreed
        self.scatters = False  # some block of this rank scatters a sequence (a check to agree on)
        self.plans: dict[str, Plan] = {}
        self.splits: dict[str, int | None] = {}  # parameter name -> the dimension its style splits
        kind = type(module).__name__
        method = getattr(module, "tensor_parallel_plan", None)
        if not callable(method):
            raise TypeError(
                f"tensor_parallel_size={size}: {kind} does not say how its blocks split. Define"
                " `tensor_parallel_plan(self, name, block)` returning torch's parallel styles keyed by submodule"
                " names inside the block, e.g. {'attn.q': ColwiseParallel(), 'attn.proj': RowwiseParallel()}"
                " ({} keeps a block whole on every tensor-parallel rank), or use tensor_parallel_size=1."
            )
        for name, block in _blocks(module):
            plan = method(name, block)
            where = name or kind
            if plan is None:
                if any(True for _ in block.parameters()):
                    raise ValueError(
                        f"tensor_parallel_size={size}: {kind}.tensor_parallel_plan returned None for {where}, which"
                        " holds parameters. Return its plan, or {} to keep it whole on every tensor-parallel rank"
                        " on purpose (its weights and optimizer state are then held tensor_parallel_size times)."
                    )
                plan = {}
            if isinstance(plan, ParallelStyle):
                plan = {"": plan}  # the block itself
            if not isinstance(plan, Mapping) or not all(isinstance(s, ParallelStyle) for s in plan.values()):
                raise TypeError(
                    f"{kind}.tensor_parallel_plan({where!r}) must return a dict of submodule name -> torch parallel"
                    f" style (ColwiseParallel(), RowwiseParallel(), ...; the key '' is the block itself), or one"
                    f" style for the block itself; got {plan!r}."
                )
            for key, style in plan.items():
                targets = plan_targets(block, key)
                if not targets:
                    inside = ", ".join(n for n, _ in block.named_modules() if n) or "none"
                    raise ValueError(
                        f"{kind}.tensor_parallel_plan({where!r}) names {key!r}, which is no submodule of that"
                        f" block (its submodules: {inside}). Fix the name (fnmatch patterns per level work)."
                    )
                for sub, target in targets:
                    where_sub = ".".join(n for n in (name, sub) if n)
                    self._check_divisible(where_sub, target, style)
                    for pname, dim in _split_dims(target, style).items():
                        self.splits[f"{where_sub}.{pname}"] = dim
                    if not isinstance(style, (PrepareModuleInput, PrepareModuleOutput)):
                        _refuse_hooked(where_sub, target)
            self.plans[name] = dict(plan)
        self._check_ties(module, kind)

    def _check_ties(self, module: nn.Module, kind: str) -> None:
        """A parameter tied under several names (also across pipeline stages, where each stage splits its own
        copy) must be split the same way under each: their slices are one tensor's."""
        for names in _ties(module):
            dims = {n: self.splits.get(n) for n in names}
            if len(set(dims.values())) > 1:
                shown = ", ".join(f"{n} {'whole' if d is None else f'split along dim {d}'}" for n, d in dims.items())
                raise ValueError(
                    f"{names[0]} and {names[1]} are one tied parameter, and the tensor-parallel plan splits them"
                    f" differently ({shown}). Split both the same way (a vocabulary-parallel embedding,"
                    f" RowwiseParallel, with a ColwiseParallel output head), or untie them in {kind}."
                )

    def _check_divisible(self, where: str, module: nn.Module, style: ParallelStyle) -> None:
        """A split dimension the tensor-parallel size does not divide would give ranks unequal slices."""
        dims: dict[str, int] = {}
        if isinstance(module, nn.Linear):
            if isinstance(style, ColwiseParallel):
                dims["out_features"] = module.out_features
            elif isinstance(style, RowwiseParallel):
                dims["in_features"] = module.in_features
        elif isinstance(module, nn.Embedding):
            if isinstance(style, ColwiseParallel):
                dims["embedding_dim"] = module.embedding_dim
            elif isinstance(style, RowwiseParallel):
                dims["num_embeddings"] = module.num_embeddings
        for attribute, value in dims.items():
            if value % self.size:
                raise ValueError(
                    f"tensor_parallel_size={self.size} does not divide {where}.{attribute} ({value}) that"
                    f" {type(style).__name__} splits. Choose a tensor_parallel_size dividing {value}, or keep"
                    f" {where} out of the plan."
                )

    def apply(self, module: nn.Module, mesh: DeviceMesh, *, keep_dtensors: bool) -> None:
        """Split this rank's blocks of ``module`` (the pipeline already cut the others out; blocks split as
        they were materialised are left) on ``mesh``. Ties between parameters are made again (each split
        module's parameters were replaced)."""
        ties = _ties(module)
        for name, block in _blocks(module):
            self.apply_block(name, block, mesh, keep_dtensors=True)
        _tie_again(module, ties)
        if not keep_dtensors:
            localize(module)

    def apply_block(self, name: str, block: nn.Module, mesh: DeviceMesh, *, keep_dtensors: bool) -> None:
        """Split one block on ``mesh`` by its plan (once): its parameters stay DTensors with ``keep_dtensors``
        (ZeRO-3 shards them over the data-parallel mesh on top, as torchtitan does), else become this rank's
        plain slices (:func:`localize`)."""
        plan = dict(self.plans.get(name) or {})
        if not plan or getattr(block, _SPLIT, False):
            return
        self.check.watch(name, block, plan)
        itself = plan.pop("", None)
        with attributes_kept(block):  # a style makes new parameters
            if itself is not None:
                parallelize_module(block, mesh, itself)
            if plan:
                parallelize_module(block, mesh, plan)
        for key, style in (self.plans.get(name) or {}).items():
            self.scatters |= _check_scattered_sequence(block, key, style, name, self.size, self.sequences)
        if not keep_dtensors:
            localize(block)
        setattr(block, _SPLIT, True)


def _check_scattered_sequence(
    block: nn.Module, key: str, style: ParallelStyle, block_name: str, size: int, check: SequenceCheck | None = None
) -> bool:
    """Where a style splits a whole input along a dimension (sequence parallelism scatters the sequence: a
    row-wise style with a sharded output, an input prepared from whole to sharded), that dimension must divide
    by the tensor-parallel size: torch's styles assume equal shards, and an uneven sequence failed inside a
    collective on one rank, the others' connections reset. Checked on each forward, before the style's hooks,
    on the first positional input (agreed over the data-parallel replicas by ``check``). Whether it registered
    a check."""
    dim, of_input = None, False
    if isinstance(style, RowwiseParallel):  # the output scattered: a leading dimension the input shares
        dims = [layout.dim for layout in style.output_layouts if isinstance(layout, Shard) and layout.dim >= 0]
        dim = dims[0] if dims else None
    elif isinstance(style, PrepareModuleInput) and style.input_layouts and style.desired_input_layouts:
        whole, wanted = style.input_layouts[0], style.desired_input_layouts[0]  # the first input, split here
        if isinstance(wanted, Shard) and not isinstance(whole, Shard):
            dim, of_input = wanted.dim, True
    if dim is None:
        return False
    for sub_name, sub in plan_targets(block, key):  # the modules parallelize_module splits for this key
        name = f"{block_name}.{sub_name}".strip(".")
        # an embedding's input has no feature dimension; a linear layer's last one is the features
        shared = of_input or isinstance(sub, nn.Embedding)
        sub.register_forward_pre_hook(_Divisible(dim, size, name, shared, check or SequenceCheck()), prepend=True)
    return True


class UnevenSequence(ValueError):
    """A sequence the tensor-parallel size does not divide reached a scatter point."""

    def __init__(self, message: str, length: int) -> None:
        super().__init__(message)
        self.length = length


class SequenceCheck:
    """The verdict of the sequence-length checks (:class:`_Divisible`), agreed over the data-parallel replicas.

    Each replica reads its own batch: one whose sequence the tensor-parallel size does not divide would stop
    alone, and the others would wait for it in the step's collectives (the gradient reductions; under ZeRO-3
    the parameters' all-gathers of the same forward). So the strategy arms this before each training step
    (:meth:`arm`, with a gloo group of the data-parallel peers), and the first check that runs in it
    all-reduces the verdict there, on the host (no device sync), before any rank stops: every rank raises one
    message, naming the longest offending length. A step in which no check ran (a training_step that ran no
    forward) agrees in :meth:`settle` instead: every replica takes part in exactly one agreement per step,
    whatever it ran, so the agreements pair up on every rank.

    The checks after the first in a step check locally, on the length the first agreed: a model's scatter
    points see one sequence length. One whose scatter points see several (a decoder's target beside an
    encoder's source) would stop one replica alone at an uneven second length; a rank that sees a second
    length says so in its next agreement, and every rank refuses the model there with one message. A compiled
    model runs the check eagerly (a graph break at each scatter point), so that it can communicate. Pipeline
    stages are not armed: a stage that stopped would leave the next one waiting in a receive, which no
    agreement within a stage reaches."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.stepping = False  # inside an armed training step
        self.armed = False  # the step's agreement is still to come
        self.first: int | None = None  # the step's first length on this rank
        self.several: str | None = None  # where this rank saw a second length (told in its next agreement)

    def arm(self, group: dist.ProcessGroup | None) -> None:
        """A training step begins; its first check agrees over ``group`` (``None``: one replica, nothing to
        agree)."""
        self.group, self.first = group, None
        self.stepping = self.armed = group is not None

    def disarm(self) -> None:
        """The step ended by another error: its checks are local until the next :meth:`arm`."""
        self.stepping = self.armed = False

    def verdict(self, where: str, dim: int, length: int, size: int) -> None:
        if self.stepping:  # a training step at dp > 1 (evaluation's lengths are its own)
            self._stepping_verdict(where, dim, length, size)
        elif length % size != 0:
            raise UnevenSequence(_uneven_message(where, dim, length, size, replicas=False), length)

    @torch.compiler.disable  # compiled code runs it eagerly: it all-reduces and raises as in eager mode
    def _stepping_verdict(self, where: str, dim: int, length: int, size: int) -> None:
        bad = length % size != 0
        if self.first is None:
            self.first = length
        elif length != self.first and self.several is None:
            self.several = f"{where} ({length} against {self.first})"
        if self.armed:
            worst = self._agree(length if bad else -1, size)
            if worst >= 0:
                raise UnevenSequence(_uneven_message(where, dim, worst, size, replicas=True), worst)
        elif bad:
            raise UnevenSequence(_uneven_message(where, dim, length, size, replicas=False), length)

    def settle(self, problem: UnevenSequence | None, size: int) -> None:
        """The step ended (``problem``: by this rank's own check): agree now if no check of it agreed."""
        self.stepping = False
        if not self.armed:
            return
        worst = self._agree(problem.length if problem is not None else -1, size)
        if worst >= 0:
            raise UnevenSequence(_uneven_message("a sequence-parallel module", None, worst, size, replicas=True), worst)

    def _agree(self, length: int, size: int) -> int:
        """The worst offending length over the replicas (-1: none); refuses, on every rank, a model some rank
        saw several lengths in."""
        self.armed = False
        flags = torch.tensor([float(length), float(self.several is not None)], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        worst, several = flags.tolist()
        seen, self.several = self.several, None  # told: a later fit starts afresh
        if several and worst < 0:  # one message on every rank: what this rank saw is logged, not raised
            if seen is not None:
                log.error(f"A second sequence length in one training step: {seen}.")
            raise UnevenSequence(
                "Sequence parallelism at data_parallel_size > 1 agrees each step's sequence length over the"
                " replicas once, at the first module that scatters it, but this model's scatter points see"
                " several lengths in one forward: one replica's uneven second length would stop it"
                " alone while the others wait for it. Give every scattered input one length (pad the shorter"
                f" to the longer, a multiple of tensor_parallel_size={size}), turn sequence parallelism off,"
                " or use data_parallel_size=1.",
                -1,
            )
        return int(worst)


def _uneven_message(where: str, dim: int | None, length: int, size: int, *, replicas: bool) -> str:
    return (
        f"{where} scatters {'the sequence' if dim is None else f'dimension {dim}'} of its input (size {length}"
        f"{' on a data-parallel replica' if replicas else ''}) over tensor_parallel_size={size} ranks (sequence"
        f" parallelism), which must divide it: torch's sequence-parallel styles need equal shards. Make the"
        f" sequence length a multiple of {size} (pad the batch, or choose the block size), or turn sequence"
        " parallelism off."
    )


class _Divisible:
    def __init__(self, dim: int, size: int, where: str, any_dim: bool, check: SequenceCheck) -> None:
        self.dim, self.size, self.where, self.any_dim, self.check = dim, size, where, any_dim, check

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None  # an input given by keyword is not checked
        if not isinstance(x, Tensor) or not -x.dim() <= self.dim < x.dim():
            return
        dim = self.dim % x.dim()
        if self.any_dim or dim < x.dim() - 1:
            self.check.verdict(self.where, dim, x.shape[dim], self.size)


def _refuse_hooked(where: str, module: nn.Module) -> None:
    """A style replaces the parameters of the module it splits: a hook registered on one would stop running."""
    for pname, p in module.named_parameters(recurse=False):
        if tensor_hooks(p) or post_accumulate_hooks(p):
            raise ValueError(
                f"{where}.{pname} has a gradient hook (register_hook / register_post_accumulate_grad_hook), and"
                " the tensor-parallel plan replaces that parameter by its slice: the hook would silently stop"
                " running. Register it after set-up (e.g. in on_fit_start, on the parameter the module then holds),"
                f" or keep {where} whole in the plan."
            )


def _ties(module: nn.Module) -> list[list[str]]:
    by_param: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def _tie_again(module: nn.Module, ties: list[list[str]]) -> None:
    """Each split module got new parameters: the names of a tie point at the first name's again (the plans
    split them alike: checked on the whole module)."""
    held = dict(module.named_parameters(remove_duplicate=False))  # not attribute reads: those give DTensor views
    for names in ties:
        first = held[names[0]]
        for other in names[1:]:
            owner, _, attribute = other.rpartition(".")
            if held[other] is not first:
                setattr(module.get_submodule(owner) if owner else module, attribute, first)


def _split_dims(module: nn.Module, style: ParallelStyle) -> dict[str, int | None]:
    """The dimension torch's style splits each of ``module``'s own parameters along (``None``: whole), as
    ``ColwiseParallel`` / ``RowwiseParallel`` place ``nn.Linear`` and ``nn.Embedding``; other styles keep
    parameters whole (``SequenceParallel`` replicates them)."""
    if isinstance(style, ColwiseParallel):
        weight = 0 if isinstance(module, nn.Linear) else 1 if isinstance(module, nn.Embedding) else None
        return {"weight": weight, "bias": 0}
    if isinstance(style, RowwiseParallel):
        weight = 1 if isinstance(module, nn.Linear) else 0 if isinstance(module, nn.Embedding) else None
        return {"weight": weight, "bias": None}
    return {}


def plan_blocks(module: nn.Module, size: int) -> TensorPlans | None:
    """The checked plans of ``module`` for ``size`` tensor-parallel ranks (``None`` for one)."""
    return TensorPlans(module, size) if size > 1 else None
