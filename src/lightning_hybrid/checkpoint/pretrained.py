"""Start from pretrained weights without any rank holding all of them (``HybridParallelStrategy(init_from=...)``).

Four kinds of source, each read lazily so a rank touches only the tensors (and under ZeRO-3 the rows, under
tensor parallelism the slices) it owns:

* a plain ``state_dict`` file (``torch.save(module.state_dict(), path)``), read with ``mmap=True,
  weights_only=True``: a tensor's pages are read only when its rows are copied;
* a ``.safetensors`` file, read by slice;
* a folder of ``.safetensors`` shards with a ``*.safetensors.index.json`` (the layout Hugging Face
  checkpoints use), or a folder holding ``.safetensors`` files without an index;
* a sharded checkpoint of this pack (its weights only; DCP reads just the requested box).

Names rarely match: ``key_map`` renames each checkpoint key to the module's name for it (a dict of prefix
renames, longest prefix first, or a callable), and a key may feed several names (tied embeddings). The plan
is made on every rank from the whole (possibly meta-built) module before the pipeline cuts it, so missing,
unexpected or wrongly shaped keys fail on every rank with the key names, before step 0.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import Tensor, nn

from lightning_hybrid._agree import agreed_problem, raise_agreed
from lightning_hybrid._slices import Box, held_box
from lightning_hybrid.checkpoint.sources import WeightsSource, open_weights

__all__ = [
    "KeyMap",
    "PretrainedWeights",
    "WeightsPlan",
    "agreed_load",
    "agreed_plan",
    "as_pretrained_weights",
    "load_pretrained",
    "open_weights",
    "plan_pretrained",
]

KeyMap = Union[Mapping[str, Union[str, Sequence[str]]], Callable[[str], Union[str, Sequence[str], None]]]


@dataclass(frozen=True)
class PretrainedWeights:
    """Pretrained weights to start training from (``HybridParallelStrategy(init_from=PretrainedWeights(...))``).

    Args:
        path: a ``torch.save`` state_dict file, a ``.safetensors`` file, a folder of ``.safetensors`` shards
            (with or without ``*.safetensors.index.json``), or a sharded checkpoint folder of this pack.
        key_map: renames checkpoint keys to the module's names. A dict of prefix renames (``{"transformer.h.0.":
            "layers.1."}``; the longest matching prefix wins; a list value feeds several names, e.g. tied
            embeddings) or a callable ``key -> name | [names] | None`` (``None`` leaves the key unused).
            Keys no prefix matches keep their name.
        ignore: ``fnmatch`` patterns of checkpoint keys that are expected to stay unused (e.g. ``"*.attn.bias"``).

    Example::

        weights = PretrainedWeights(
            "gpt2/",  # save_pretrained output: model.safetensors (+ index for big models)
            key_map={"transformer.wte.": ["layers.0.token.", "layers.13.head."], "transformer.h.0.": "layers.1."},
        )
        strategy = HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=3, init_from=weights)
    """

    path: Union[str, os.PathLike]
    key_map: Union[KeyMap, None] = None
    ignore: Sequence[str] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"PretrainedWeights.path must be a path, got {self.path!r}.")
        if self.key_map is not None and not callable(self.key_map) and not isinstance(self.key_map, Mapping):
            raise ValueError(
                f"PretrainedWeights.key_map must be a dict of prefix renames or a callable, got {self.key_map!r}."
            )
        if isinstance(self.key_map, Mapping):
            for prefix, names in self.key_map.items():
                values = [names] if isinstance(names, str) else names
                if (
                    not isinstance(prefix, str)
                    or not isinstance(values, Sequence)
                    or not values
                    or not all(isinstance(v, str) for v in values)
                ):
                    raise ValueError(
                        f"PretrainedWeights.key_map entries map a prefix (str) to a prefix or a list of prefixes;"
                        f" got {prefix!r}: {names!r}."
                    )
        if isinstance(self.ignore, str) or not all(isinstance(p, str) for p in self.ignore):
            raise ValueError(f"PretrainedWeights.ignore must be a list of patterns, got {self.ignore!r}.")

    def targets(self, key: str) -> list[str]:
        """The module names checkpoint ``key`` feeds (``[]``: unused)."""
        key_map = self.key_map
        if key_map is None:
            return [key]
        if callable(key_map) and not isinstance(key_map, Mapping):
            names = key_map(key)
            if names is None:
                return []
            return [names] if isinstance(names, str) else list(names)
        matches = [p for p in key_map if key.startswith(p)]
        if not matches:
            return [key]
        prefix = max(matches, key=len)
        names = key_map[prefix]
        return [n + key[len(prefix) :] for n in ([names] if isinstance(names, str) else names)]

    def ignored(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.ignore)


def as_pretrained_weights(init_from: Any) -> Union[PretrainedWeights, None]:
    """``init_from`` as given to a strategy: a path, a :class:`PretrainedWeights`, or its fields as a dict (with
    or without LightningCLI's ``class_path``/``init_args``), as YAML gives it."""
    if init_from is None or isinstance(init_from, PretrainedWeights):
        return init_from
    if isinstance(init_from, Mapping):
        fields = dict(init_from)
        if "class_path" in fields:
            if str(fields["class_path"]).rsplit(".", 1)[-1] != "PretrainedWeights":
                raise ValueError(f"init_from names {fields['class_path']!r}; it takes PretrainedWeights or a path.")
            fields = dict(fields.get("init_args") or {})
        unknown = set(fields) - {"path", "key_map", "ignore"}
        if unknown or "path" not in fields:
            raise ValueError(
                f"init_from as a dict takes PretrainedWeights' fields path, key_map and ignore; got {sorted(fields)}."
            )
        return PretrainedWeights(**fields)
    return PretrainedWeights(init_from)


@dataclass
class WeightsPlan:
    """Which checkpoint key fills each module name (the same on every rank)."""

    weights: PretrainedWeights
    source_of: dict[str, str]  # module name -> checkpoint key


def plan_pretrained(
    weights: PretrainedWeights,
    source: WeightsSource,
    expected: dict[str, tuple[int, ...]],
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    ties: Sequence[Sequence[str]] = (),
) -> WeightsPlan:
    """Match the checkpoint's keys to the module's names (``expected``: name -> full shape, of the whole
    module; ``dtypes``: name -> dtype; ``ties``: names that are one tensor); raises ``ValueError`` naming every
    missing, unexpected, doubly fed, wrongly shaped or wrongly typed key, and every tied parameter whose names
    different keys would feed with different values."""
    index = source.index()
    source_of: dict[str, str] = {}
    unexpected, doubled, wrong_shape, wrong_dtype = [], [], [], []
    for key in sorted(index):
        names = weights.targets(key)
        if not names and not weights.ignored(key):
            continue  # the callable left it out on purpose
        unknown = [n for n in names if n not in expected]
        if unknown and not weights.ignored(key):
            unexpected.append(key if unknown == [key] else f"{key} -> {', '.join(unknown)}")
        for name in names:
            if name not in expected:
                continue
            if name in source_of:
                doubled.append(f"{name} <- {source_of[name]}, {key}")
                continue
            if index[key][0] != tuple(expected[name]):
                wrong_shape.append(f"{key} {list(index[key][0])} -> {name} {list(expected[name])}")
            elif dtypes is not None and name in dtypes and not _dtype_fits(index[key][1], dtypes[name]):
                wrong_dtype.append(f"{key} {index[key][1]} -> {name} {dtypes[name]}")
            source_of[name] = key
    missing = [n for n in expected if n not in source_of]
    split_ties = [
        " / ".join(f"{n} <- {source_of[n]}" for n in names)
        for names in ties
        if len({source_of.get(n) for n in names if n in source_of}) > 1 and not _same_values(source, names, source_of)
    ]
    problems = [
        (what, keys)
        for what, keys in (
            ("missing (no checkpoint key feeds them)", missing),
            ("unexpected (the module has no such name; map or ignore them)", unexpected),
            ("fed twice", doubled),
            ("wrong shape", wrong_shape),
            ("wrong dtype (a float parameter takes float16, bfloat16, float32 or float64 values only)", wrong_dtype),
            ("tied (one tensor) but fed different values by different keys", split_ties),
        )
        if keys
    ]
    if problems:
        lines = [f"  {what}: {len(keys)}: {_summarise(keys)}" for what, keys in problems]
        raise ValueError(
            f"init_from={str(weights.path)!r} does not fit the module:\n" + "\n".join(lines) + "\nFix the key_map"
            " (checkpoint prefix -> module prefix) or ignore=[...] of PretrainedWeights."
        )
    return WeightsPlan(weights, source_of)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_fits(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether values of ``source`` may be copied into a tensor of ``target``: floats from the four plain float
    types (float8 needs its scales, integers and booleans are no weights); integers from integers; any other
    kind from itself."""
    if target.is_floating_point:
        return source in _FLOATS
    if target.is_complex:
        return source.is_complex
    if target == torch.bool or source == torch.bool:
        return source == target
    return not source.is_floating_point and not source.is_complex


def _same_values(source: WeightsSource, names: Sequence[str], source_of: Mapping[str, str]) -> bool:
    """Whether the keys feeding a tied parameter's names hold equal values (a checkpoint that stores a tied
    tensor under both names): read whole, only for ties fed by two keys."""
    keys = sorted({source_of[n] for n in names if n in source_of})
    first = source.read(keys[0], None)
    return all(torch.equal(first, source.read(k, None)) for k in keys[1:])


def _summarise(entries: list[str], limit: int = 12) -> str:
    """Keys named one by one, except that more than three under one block read ``layers.2.* (12 keys)``."""

    def block(key: str) -> str:
        parts = key.split(".")
        numeric = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        return ".".join(parts[: numeric + 1 if numeric is not None else min(2, len(parts) - 1)])

    groups: dict[str, list[str]] = {}
    for entry in entries:
        sides = [side.split(" ")[0] for side in entry.split(" -> ")]  # "key [shape] -> name [shape]"
        groups.setdefault(" -> ".join(block(side) + ".*" for side in sides), []).append(entry)
    shown: list[str] = []
    for group, members in groups.items():
        shown += [f"{group} ({len(members)} keys)"] if len(members) > 3 else members
    return ", ".join(shown[:limit]) + (f" ... ({len(shown) - limit} more)" if len(shown) > limit else "")


def expected_names(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every name of the module's state_dict with its full shape (tied parameters under each of their names)."""
    return {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}


def expected_dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in module.state_dict(keep_vars=True).items()}


def tied_names(module: nn.Module) -> list[list[str]]:
    """Names of the state_dict that are one tensor (tied parameters), each group in order."""
    groups: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _local_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor, Union[Box, None]]]:
    """``(name, tensor to fill, its box in the full tensor)`` for what this rank holds (``None``: all of it):
    ZeRO-3's rows, a tensor-parallel slice along its split dimension, or both."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        local, box = held_box(tensor)
        if box is not None and tuple(b - a for a, b in box) != tuple(local.shape):
            raise ValueError(f"init_from: {name} holds {tuple(local.shape)} here, its box is {box}.")
        yield name, local, box


@torch.no_grad()
def load_pretrained(module: nn.Module, plan: WeightsPlan, source: WeightsSource) -> int:
    """Copy into this rank's tensors (its stages; under ZeRO-3 its rows, under tensor parallelism its slices)
    from ``source``. Returns the bytes
    read."""
    read = 0
    for name, tensor, box in _local_tensors(module):
        if box is not None and any(a == b for a, b in box):
            continue  # this rank holds no rows of a short tensor
        value = source.read(plan.source_of[name], box)
        tensor.copy_(value)  # to the tensor's device and dtype in one copy
        read += value.numel() * value.element_size()
    return read


def agreed_plan(
    weights: PretrainedWeights, module: nn.Module, device: torch.device
) -> tuple[WeightsSource, WeightsPlan]:
    """Open the source and plan it against the whole ``module``, every rank together: a problem on any rank
    (a file missing on one node, a key that does not fit) raises the same ``ValueError`` on every rank."""

    problem, pretrained = None, None
    try:
        source = open_weights(weights.path, verify=_first_on_node())
        plan = plan_pretrained(
            weights, source, expected_names(module), dtypes=expected_dtypes(module), ties=tied_names(module)
        )
        pretrained = source, plan
    except Exception as exc:  # no rank may be left waiting in a collective
        problem = str(exc) if isinstance(exc, ValueError) and str(exc) else f"init_from={str(weights.path)!r}: {exc!r}"
    problem = agreed_problem(problem, device=device)
    if problem or pretrained is None:
        raise ValueError(problem)
    return pretrained


def _first_on_node() -> bool:
    """One process per node hashes a pack checkpoint (each node may read its own copy of the files)."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def agreed_load(module: nn.Module, source: WeightsSource, plan: WeightsPlan, device: torch.device) -> int:
    """:func:`load_pretrained` on every rank together; returns this rank's bytes read."""

    problem, read = None, 0
    try:
        read = load_pretrained(module, plan, source)
    except Exception as exc:  # e.g. a shard truncated on one node: every rank stops with the reason
        problem = f"init_from={str(plan.weights.path)!r}: reading the weights failed: {exc!r}"
    raise_agreed(problem, ValueError, device=device)
    return read
