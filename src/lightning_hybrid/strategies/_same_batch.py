"""Every rank of one data-parallel replica reads the same batch: checked, and worker seeds keyed to make it so.

A replica's pipeline stages (the first feeds the inputs, the last computes the loss on the targets) and its
tensor-parallel peers (each computes its slice of the same activations) must see one batch. The sampler gives
them the same indices (``distributed_sampler_kwargs``), but randomness applied after the index (an
augmentation, a masking) follows each process's generator: Lightning seeds dataloader workers by the
*global* rank (``seed_everything(workers=True)``), and a dataset that draws from the main process's
generator draws what each stage's model left in it. Stage 0 would then train on one crop and the last stage
score the targets of another, with nothing raised.

So the strategies seed a replica's workers alike (:func:`seed_workers_by_replica`), and the first
:data:`CHECKED_BATCHES` batches of every epoch are compared across each replica's ranks
(:func:`check_replica_batches`): a fingerprint of every tensor in the batch, gathered over the world, so every
rank reaches the same verdict and raises the same message naming the ranks that differ. The fingerprint is
exact (integer sums of the elements' bits), so nodes with other thread counts or devices agree on one batch.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch import Tensor

__all__ = ["CHECKED_BATCHES", "check_replica_batches", "fingerprint", "seed_workers_by_replica"]

CHECKED_BATCHES = 2  # the first batches of every epoch: randomness keyed on the rank shows from the first


def seed_workers_by_replica(dataloader: object, data_parallel_rank: int, device: torch.device) -> None:
    """Dataloader workers draw alike on every rank of a replica and apart across replicas.

    A worker's seed is the loader's base seed (drawn from ``loader.generator``, by default each process's
    generator, which the stages of a pipeline have advanced differently) plus, under
    ``seed_everything(workers=True)``, Lightning's mix of the *global* rank. A loader with workers and no
    generator of its own gets one seeded by a number rank 0 draws and broadcasts, offset by the data-parallel
    rank; Lightning's seeding is keyed on the data-parallel rank. A ``generator`` or ``worker_init_fn`` the user
    set stays (the batch check then tells whether they agree)."""
    if getattr(dataloader, "num_workers", 0) > 0 and getattr(dataloader, "generator", False) is None:
        drawn = torch.randint(2**62, (1,), dtype=torch.int64).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(drawn, src=0)
        seed = (int(drawn.item()) + 1_000_003 * data_parallel_rank) % 2**62
        dataloader.generator = torch.Generator().manual_seed(seed)  # type: ignore[attr-defined]
    if int(os.environ.get("PL_SEED_WORKERS", "0")) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=data_parallel_rank)  # type: ignore[attr-defined]


def fingerprint(batch: Any, device: torch.device) -> Tensor:
    """Four int64 numbers that differ, but for a vanishing chance, between two batches that differ: the count of
    tensors, their shapes and dtypes, the sum of the elements' bits as integers, and that sum weighted by
    position (a reordering shows). Integer sums wrap and are exact in any order: the same batch gives the same
    numbers on any device and thread count. Read in chunks (bounded memory); a sparse, nested or quantized
    tensor is counted only."""
    out = torch.zeros(4, dtype=torch.int64, device=device)
    start = 0
    for tensor in _tensors(batch):
        out[0] += 1
        if tensor.layout != torch.strided or tensor.is_nested or tensor.is_quantized:
            continue  # counted, not compared (a jagged shape holds process-local ids)
        # the shape and dtype too (crc32: the same in every process, unlike hash() of a str): zeros(2, 3) is not
        # zeros(3, 2)
        out[1] += tensor.numel() + zlib.crc32(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        bits = _as_integers(tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1))
        for chunk in bits.split(_CHUNK):
            values = chunk.to(torch.int64)
            positions = torch.arange(start + 1, start + 1 + values.numel(), dtype=torch.int64, device=values.device)
            start += values.numel()
            out[2:] += torch.stack([values.sum(), (values * positions).sum()]).to(device)
    return out


_CHUNK = 2**22  # elements per read: a few tens of MB of int64 at a time, whatever the batch
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_integers(flat: Tensor) -> Tensor:
    """The elements' bits as integers of the same width (complex: its real and imaginary parts)."""
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INTEGER_OF_SIZE[flat.element_size()])


def _tensors(batch: Any) -> Iterator[Tensor]:
    """The tensors of a batch, depth first: mappings (a BatchEncoding), sequences, dataclasses (frozen too)."""
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _tensors(getattr(batch, field.name))


def check_replica_batches(batch: Any, *, replicas: list[list[int]], device: torch.device) -> None:
    """Raise on every rank, with the same message, when the ranks of one replica (``replicas``: each replica's
    global ranks) hold different batches. A collective over the world: every rank calls it for the same batch."""
    mine = fingerprint(batch, device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    seen = torch.stack(rows).cpu()
    differing = [
        (ranks[0], other) for ranks in replicas for other in ranks[1:] if not torch.equal(seen[other], seen[ranks[0]])
    ]
    if differing:
        pairs = ", ".join(f"rank {other} against rank {first}" for first, other in differing[:4])
        raise RuntimeError(
            f"The ranks of one data-parallel replica (its pipeline stages and tensor-parallel peers) read different"
            f" batches ({pairs}{', ...' if len(differing) > 4 else ''}): each computes its part of one replica's"
            " step, so the results would be silently wrong. The sampler gives them the same indices; randomness"
            " after the index differs: key it on the data-parallel rank"
            " (`trainer.strategy.distributed_sampler_kwargs['rank']`), not the global rank; a dataset drawing from"
            " the main process's generator (`torch.rand` in `__getitem__` with num_workers=0) should draw from its"
            " own generator seeded by the sample index, or run in dataloader workers (the strategy seeds a replica's"
            " workers alike)."
        )
