"""Models that do not fit: materialise only this rank's blocks, one at a time, with layout-free initial values.

A LightningModule may build its blocks on the meta device (``with torch.device("meta")`` in
``configure_model``, or ``Trainer.init_module(empty_init=True)``): nothing is allocated. The strategy cuts
the stages first, so each rank keeps only its own blocks, then materialises them one block at a time:
allocate, initialise, and under ZeRO-3 shard (the block's full tensors are freed as soon as its shards
exist), so a rank never holds more than its part of the model plus one block.

Initial values do not depend on the layout: each block is initialised under a generator seeded from the
run's seed and the block's name (``seeded_init``), so with the same ``seed_everything(seed)`` every
``(pipeline_parallel_size, data_parallel_size, zero_stage, schedule)`` (a single process included) starts
from the same weights, and a run can move to another layout and reproduce. A block is initialised by the
LightningModule's ``init_block(name, block)`` when it defines one, else by each submodule's
``reset_parameters()`` (as Lightning does).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Generator, Iterable

import torch
from torch import nn

from lightning_hybrid.strategies._params import attributes_kept

__all__ = ["block_seed", "has_meta_tensors", "materialize", "materialize_module", "seeded_init", "tied_on_meta"]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def tied_on_meta(module: nn.Module) -> list[list[str]]:
    """Names of meta parameters shared by several names (tied weights): materialising blocks one at a time
    would give each name its own tensor, so they are refused (on the whole module, the same on every rank)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.is_meta:
            names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def block_seed(name: str, seed: int | None = None) -> int:
    """The seed of block ``name``: the run's seed (``seed_everything``) mixed with the name, layout-free."""
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@contextlib.contextmanager
def seeded_init(name: str, seed: int | None = None) -> Generator[None, None, None]:
    """Random initialisation of block ``name`` inside draws from its own stream (the global one is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(block_seed(name, seed))  # the CPU stream only: accelerators untouched
        yield


def materialize(
    blocks: Iterable[tuple[str, nn.Module]],
    *,
    device: torch.device,
    seed: int,
    init_block: Callable[[str, nn.Module], None] | None,
    then: Callable[[str, nn.Module], None] | None = None,
    loaded: bool = False,
) -> int:
    """Allocate and initialise each meta ``(name, block)`` in turn on ``device``; ``then(name, block)`` right
    after (e.g. split and shard it) before the next one. Returns how many blocks were materialised.

    ``loaded``: every parameter and persistent buffer will be overwritten (``init_from``), so a submodule
    without ``reset_parameters()`` is left as allocated unless it has non-persistent buffers."""
    count = 0
    for name, block in blocks:
        if not has_meta_tensors(block):
            continue
        # initial values are computed on the CPU, whatever the device: the same numbers everywhere
        with attributes_kept(block):  # to_empty makes new parameters: the user's marks go on them
            block.to_empty(device="cpu")
        with seeded_init(name, seed), torch.no_grad():
            if init_block is not None:
                init_block(name, block)
            else:
                _reset(name, block, loaded=loaded)
        block.to(device)
        if then is not None:
            then(name, block)
        count += 1
    return count


def _reset(name: str, block: nn.Module, *, loaded: bool) -> None:
    missing = []
    for sub_name, sub in block.named_modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(sub, "reset_parameters", None)  # the convention Lightning's materialisation uses too
        if callable(reset):
            reset()
        elif not loaded or _has_unsaved_buffers(sub):
            missing.append(f"{name}.{sub_name}" if sub_name else name)
    if missing:
        raise TypeError(
            f"cannot initialise {missing[:3]} after building on the meta device: they have parameters or buffers"
            " but no reset_parameters(). Define reset_parameters() on them, or init_block(name, block) on the"
            " LightningModule."
        )


def _has_unsaved_buffers(module: nn.Module) -> bool:
    saved = {k for k in module.state_dict(keep_vars=True) if "." not in k}
    return any(name not in saved for name, _ in module.named_buffers(recurse=False))


def materialize_module(
    module: nn.Module,
    *,
    device: torch.device,
    seed: int,
    then: Callable[[str, nn.Module], None] | None,
    loaded: bool = False,
    agree_on: torch.device | None = None,
) -> None:
    """Materialise what is left of a meta-built LightningModule: each block of ``module.layers`` (those this
    rank kept), then every other child with meta tensors. Anything still on meta then is an error.

    ``agree_on``: the device of an agreement over the world: a failure on any rank's blocks raises the same
    ``ValueError`` on every rank (each rank materialises different blocks under a pipeline)."""
    if agree_on is None:
        _materialize_module(module, device=device, seed=seed, then=then, loaded=loaded)
        return
    from lightning_hybrid._agree import agreed_problem

    problem = None
    try:
        _materialize_module(module, device=device, seed=seed, then=then, loaded=loaded)
    except Exception as exc:  # this rank's blocks only: the others must not wait for it in a collective
        problem = f"{type(exc).__name__}: {exc}"
    problem = agreed_problem(problem, device=agree_on)
    if problem:
        raise ValueError(f"materialising the meta-built module failed: {problem}")


def _materialize_module(
    module: nn.Module, *, device: torch.device, seed: int, then: Callable[[str, nn.Module], None] | None, loaded: bool
) -> None:
    init_block = getattr(module, "init_block", None)  # the documented, optional hook of the module
    init_block = init_block if callable(init_block) else None
    layers = module.layers if isinstance(getattr(module, "layers", None), nn.Module) else None
    blocks = [(f"layers.{name}", block) for name, block in layers.named_children()] if layers is not None else []
    others = [(name, child) for name, child in module.named_children() if child is not layers]
    materialize(blocks, device=device, seed=seed, init_block=init_block, then=then, loaded=loaded)
    materialize(others, device=device, seed=seed, init_block=init_block, loaded=loaded)
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    # tensors kept as plain attributes (torchmetrics states, caches) have no initialiser to call
    left += [
        f"{name}.{attr}" if name else attr
        for name, sub in module.named_modules()
        for attr, value in vars(sub).items()
        if isinstance(value, torch.Tensor) and value.is_meta
    ]
    if left:
        raise TypeError(
            f"{type(module).__name__} still has tensors on the meta device after materialisation ({left[:3]}):"
            " build parameters inside modules (blocks of `self.layers` or submodules), and metrics and other"
            " tensor attributes outside `torch.device('meta')` / `Trainer.init_module(empty_init=True)`, e.g. in"
            " configure_model()."
        )
