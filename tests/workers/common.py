"""Shared by the worker scripts and the in-process references: data order, model build, reports."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, CharDataModule
from torch.utils.data import DataLoader, Dataset, Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Step ``s`` uses global batch ``order[s*B:(s+1)*B]``; data-parallel rank ``r`` takes its contiguous slice.

    Every layout therefore sees the same global batches, so runs on different layouts (and a plain
    single-process reference) can be compared exactly.
    """

    def __init__(self, n: int, global_batch: int, dp_rank: int, dp_size: int, seed: int = 0, skip: int = 0) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} not divisible by {dp_size}")
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        self.global_batch, self.dp_rank, self.dp_size, self.skip = global_batch, dp_rank, dp_size, skip

    def __len__(self) -> int:
        return len(self.order) // self.global_batch - self.skip

    def __iter__(self):
        per = self.global_batch // self.dp_size
        for s in range(self.skip, self.skip + len(self)):
            base = s * self.global_batch + self.dp_rank * per
            yield self.order[base : base + per]


def global_batches(dataset, global_batch: int, seed: int = 0):
    """The global batches a single process sees (the reference for every layout)."""
    sampler = GlobalBatchSampler(len(dataset), global_batch, 0, 1, seed)
    return DataLoader(dataset, batch_sampler=sampler)


class Augmented(Dataset):
    """Each sample with one random token replaced (an augmentation): drawn in dataloader workers from the
    generator Lightning seeds (``in_workers``), or from one seeded by the global rank (``by_global_rank``)."""

    def __init__(self, base: Dataset, vocab_size: int, how: str) -> None:
        self.base, self.vocab_size, self.how = base, vocab_size, how

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        g = torch.Generator().manual_seed(1000 * rank() + i) if self.how == "by_global_rank" else None
        x = x.clone()
        x[int(torch.randint(len(x), (1,), generator=g))] = int(torch.randint(self.vocab_size, (1,), generator=g))
        return x, y


class ExactDataModule(CharDataModule):
    """CharDataModule whose loaders split each global batch over the data-parallel ranks in a fixed order."""

    def __init__(
        self,
        *,
        global_batch: int = 8,
        seed: int = 0,
        skip: int = 0,
        augment: str | None = None,
        shorter: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.global_batch, self.seed, self.skip, self.augment = global_batch, seed, skip, augment
        # {"replica": r, "batch": b}: that data-parallel replica's b-th training batch is one position shorter
        # (as per-batch padding makes sequence lengths differ between replicas)
        self.shorter = shorter

    def _dp(self) -> tuple[int, int]:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)

    def train_dataloader(self) -> DataLoader:
        rank, size = self._dp()
        data = self.train_set if self.augment is None else Augmented(self.train_set, self.vocab_size, self.augment)
        return DataLoader(
            data,
            batch_sampler=GlobalBatchSampler(len(self.train_set), self.global_batch, rank, size, self.seed, self.skip),
            num_workers=1 if self.augment == "in_workers" else 0,
            collate_fn=_Shorter(self.shorter["batch"]) if self.shorter and self.shorter["replica"] == rank else None,
        )

    def val_dataloader(self) -> DataLoader:
        rank, size = self._dp()
        return DataLoader(
            self.val_set,
            batch_sampler=GlobalBatchSampler(len(self.val_set), self.global_batch, rank, size, self.seed),
        )


class _Shorter:
    """Collates as usual, the ``at``-th batch one position shorter."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def __call__(self, samples: list[Any]) -> Any:
        x, y = torch.utils.data.default_collate(samples)
        self.seen += 1
        return (x[:, :-1], y[:, :-1]) if self.seen - 1 == self.at else (x, y)


def build_model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(cfg.get("seed", 0))
    if cfg.get("model_class") == "hf_gpt2_tied":  # Hugging Face's GPT-2 with its tied embeddings
        if __package__:  # imported as workers.common by a test; as common by a worker script
            from workers.hf_gpt2 import TiedGPT2
        else:
            from hf_gpt2 import TiedGPT2

        return TiedGPT2(**cfg.get("model", {}))
    classes = {
        "gpt_weight_penalty": WeightPenaltyGPT,
        "gpt_norms_outside_the_plan": NormsOutsideThePlanGPT,
        "gpt_fused_qkv": FusedQKVGPT,
    }
    model_class = classes.get(cfg.get("model_class", ""), GPT)
    return model_class(
        **{
            "vocab_size": 64,
            "n_layer": 4,
            "d_model": 32,
            "n_head": 2,
            "block_size": 16,
            **cfg.get("model", {}),
        }
    )


class WeightPenaltyGPT(GPT):
    """The loss reads two weights as attributes outside their modules' calls (a squared-weight penalty, as a
    user writes it): one a tensor-parallel split would hold as a slice, one every rank holds whole."""

    def pipeline_loss(self, output, target):
        from torch.distributed.tensor import DTensor

        penalty = 0.0
        for weight in (self.layers[1].attn.q.weight, self.layers[1].ln_1.weight):
            squares = (weight * weight).sum()
            penalty = penalty + (squares.full_tensor() if isinstance(squares, DTensor) else squares)
        return super().pipeline_loss(output, target) + 1e-2 * penalty


class NormsOutsideThePlanGPT(GPT):
    """A plan error no set-up check sees: sequence parallelism without SequenceParallel() on the norms, which then
    act on each rank's positions and get only their part of the gradient."""

    def tensor_parallel_plan(self, name, block):
        return {k: v for k, v in super().tensor_parallel_plan(name, block).items() if k not in ("ln_1", "ln_2")}


class FusedQKVGPT(GPT):
    """A plan error every peer computes alike: q, k and v in one Linear, split column-wise like separate ones.
    Each rank gets a slice across q and k (or k and v), not whole heads; the peers never differ."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for block in self.layers:
            if hasattr(block, "attn"):
                block.attn = FusedQKVAttention(block.attn)

    def tensor_parallel_plan(self, name, block):
        from torch.distributed.tensor.parallel import ColwiseParallel

        plan = super().tensor_parallel_plan(name, block)
        if "attn.q" in plan:
            plan = {k: v for k, v in plan.items() if k not in ("attn.q", "attn.k", "attn.v")}
            plan["attn.qkv"] = ColwiseParallel()
        return plan


class FusedQKVAttention(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        width = attn.q.in_features
        self.head_dim, self.proj = attn.head_dim, attn.proj
        self.qkv = torch.nn.Linear(width, 3 * width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_report(out: str | Path, report: dict[str, Any]) -> None:
    path = Path(out) / f"rank{rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(path)


def run_worker(main: Callable[[dict[str, Any]], None]) -> None:
    """``main(config)`` with the config file named on the command line; a failure is reported (each rank's
    message, for the test to compare) and raised again."""
    config = json.loads(Path(sys.argv[1]).read_text())
    try:
        main(config)
    except BaseException as exc:
        write_report(
            config["out"],
            {"rank": rank(), "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()},
        )
        raise
