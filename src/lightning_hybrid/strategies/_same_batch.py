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
rank reaches the same verdict and raises the same message naming the ranks that differ.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning_utilities.core.apply_func import apply_to_collection
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
    """Four float64 numbers that differ, but for a vanishing chance, between two batches that differ: the count
    of tensors, of elements, their sum, and their sum weighted by position (a reordering shows)."""
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    out = torch.zeros(4, dtype=torch.float64, device=device)
    start = 0
    for tensor in tensors:
        flat = torch.nan_to_num(tensor.detach().reshape(-1).to(torch.float64), nan=0.5, posinf=1.5, neginf=-1.5)
        weights = torch.arange(start + 1, start + 1 + flat.numel(), dtype=torch.float64, device=flat.device).sin()
        start += flat.numel()
        out += torch.stack([flat.new_ones(()), flat.new_tensor(flat.numel()), flat.sum(), (flat * weights).sum()]).to(
            device
        )
    return out


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
