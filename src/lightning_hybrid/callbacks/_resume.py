"""What exact mid-epoch resume needs besides the model: a data order that can start mid-epoch, and RNG state.

``ResumableSampler`` yields exactly what ``torch.utils.data.DistributedSampler`` yields for the same
``seed``, ``epoch`` and world (so swapping one for the other changes nothing), and can start an epoch after
the first ``consumed`` positions of the epoch's global order. The position is counted in the global order,
not per rank, so a run resumed on a different number of data-parallel ranks continues with exactly the
samples not yet seen. Per-rank state (RNG streams) is restored from the rank that had the same role
(``counterpart_rank``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["ResumableSampler", "capture_rng", "counterpart_rank", "cuda_state_for", "restore_rng"]


class ResumableSampler(Sampler[int]):
    """A ``DistributedSampler`` equivalent whose epoch can begin part-way through.

    Args:
        num_samples_total: length of the dataset.
        num_replicas: data-parallel world size.
        rank: this rank's data-parallel index.
        shuffle: permute the indices each epoch (seeded by ``seed + epoch``).
        seed: base seed, shared by every rank.
        drop_last: drop the tail so every rank gets the same count, instead of padding by repetition.
    """

    def __init__(
        self,
        num_samples_total: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.n = num_samples_total
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, consumed global positions)
        if drop_last and self.n % num_replicas:
            self.num_samples = math.ceil((self.n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(self.n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None  # the resumed epoch is over

    def resume_at(self, epoch: int, consumed: int | None) -> None:
        """Iterations over ``epoch`` skip the first ``consumed`` positions of its global order (every iterator made
        until the epoch changes: a loader with workers draws its indices when its iterator is made, and the
        training iterator may be made again before the first batch); ``None``: start epochs at 0."""
        self._resume = (epoch, consumed) if consumed is not None else None

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's order over all ranks, padded or cut to a multiple of ``num_replicas``."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.n, generator=g).tolist()
        else:
            indices = list(range(self.n))
        if self.drop_last:
            return indices[: self.total_size]
        pad = self.total_size - len(indices)
        if pad <= len(indices):
            return indices + indices[:pad]
        return indices + (indices * math.ceil(pad / len(indices)))[:pad]

    def __iter__(self) -> Iterator[int]:
        order = self.global_order(self.epoch)
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        # positions are dealt round-robin from `start`; with start a multiple of the world (a whole number of
        # global batches) rank r gets exactly the positions DistributedSampler would have given it
        return iter(order[start + self.rank :: self.num_replicas])

    def __len__(self) -> int:
        # the full epoch, also when resuming: Lightning counts the resumed batches into the epoch's length
        return self.num_samples


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams (torch, accelerator, numpy, python) as tensors and plain values."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available():
        # this process's own device only: a restart may see fewer or more GPUs (another node, another
        # CUDA_VISIBLE_DEVICES), and each process restores the stream of the device it runs on
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        cuda = cuda_state_for(state["cuda"], device)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def cuda_state_for(saved: Any, device: int) -> torch.Tensor | None:
    """The saved CUDA generator state this process restores on its device ``device``: the saved process's own
    device's state (a tensor). Checkpoints of earlier versions hold one state per GPU the saving process saw,
    by index: the entry of ``device`` when it exists, else None (the stream starts from the seed; a process
    that sees fewer GPUs than the one that saved never fails on it)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if isinstance(saved, (list, tuple)) and 0 <= device < len(saved):
        return saved[device]
    return None


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def counterpart_rank(rank: int, layout: dict[str, Any] | None, saved: dict[str, Any] | None) -> int | None:
    """The rank of the checkpoint's world that had this rank's role (pipeline stage, data-parallel replica,
    tensor-parallel rank: ranks are numbered row-major by both engines), whose per-rank state (RNG streams) this
    rank restores; None when the checkpoint's world had no such role (more replicas now). Without both layout
    records (Lightning's strategies: every rank is a replica) the role is the rank itself."""
    if not layout or not saved:
        return rank
    sizes = [(int(r.get("pipeline_parallel_size", 1)), int(r.get("data_parallel_size", 1)),
              int(r.get("tensor_parallel_size", 1))) for r in (layout, saved)]  # fmt: skip
    (_, dp, tp), (old_pp, old_dp, old_tp) = sizes
    stage, replica, t = rank // (dp * tp), (rank // tp) % dp, rank % tp
    if stage >= old_pp or replica >= old_dp or t >= old_tp:
        return None
    return (stage * old_dp + replica) * old_tp + t
