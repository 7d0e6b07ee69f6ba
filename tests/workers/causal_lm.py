"""Worker: train a Hugging Face causal LM through ``lightning_hybrid.models.CausalLM`` in a given layout.

Config keys: family + config (transformers config fields), attn, folder (build from a save_pretrained folder
instead), strategy (train_gpt's spec), steps, lr, global_batch, out, save (a checkpoint path written at the
end), resume (a checkpoint to resume from), skip (global batches the
resumed run has trained already: Lightning restarts a custom batch sampler's epoch). Each rank reports every
step's loss as the strategy returned it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from common import GlobalBatchSampler, rank, run_worker, write_report
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset
from train_gpt import make_strategy

from lightning_hybrid.models import CausalLM


class PaddedRows(Dataset):
    """``n`` rows of length ``t``: random ids, each row padded on the right or the left (or not), a few labels
    ignored; the same rows in every process (the reference included)."""

    def __init__(self, n: int = 64, t: int = 12, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, t), generator=g)
        self.mask = torch.ones(n, t, dtype=torch.long)
        for i in range(n):
            real = int(torch.randint(3, t + 1, (1,), generator=g))
            if i % 3 == 1:
                self.mask[i, real:] = 0  # right padding
            elif i % 3 == 2:
                self.mask[i, : t - real] = 0  # left padding
        self.labels = self.ids.masked_fill(self.mask == 0, -100)
        self.labels[torch.rand(n, t, generator=g) < 0.1] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Data(L.LightningDataModule):
    def __init__(self, global_batch: int, skip: int = 0) -> None:
        super().__init__()
        self.global_batch, self.skip = global_batch, skip
        self.rows = PaddedRows()

    def train_dataloader(self) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        r, size = kwargs.get("rank", 0), kwargs.get("num_replicas", 1)
        return DataLoader(
            self.rows, batch_sampler=GlobalBatchSampler(len(self.rows), self.global_batch, r, size, skip=self.skip)
        )


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
        layout = getattr(trainer.strategy, "layout", None)
        if getattr(layout, "pipeline_parallel_size", 1) == 1 and torch.distributed.is_initialized():
            # without a pipeline each rank reports its own batch's mean (as under DDP): the global batch's mean
            # over its counted tokens, computed here
            n = float((pl_module.pipeline_batch(batch)[1] != -100).sum())
            both = torch.tensor([loss * n, n], dtype=torch.float64)
            torch.distributed.all_reduce(both)
            loss = float(both[0] / both[1])
        self.losses.append(loss)


def build(cfg: dict[str, Any]) -> CausalLM:
    if cfg.get("folder"):
        return CausalLM(cfg["folder"], attn_implementation=cfg.get("attn"), lr=cfg["lr"])
    from transformers import AutoConfig

    config = AutoConfig.for_model(cfg["family"], **cfg["config"])
    torch.manual_seed(cfg.get("seed", 0))
    return CausalLM(config, attn_implementation=cfg.get("attn"), lr=cfg["lr"])


def main(cfg: dict[str, Any]) -> None:
    model = build(cfg)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(__import__("os").environ.get("WORLD_SIZE", "1")),
        strategy=make_strategy(cfg["strategy"]),
        max_steps=cfg["steps"],
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=Data(cfg["global_batch"], cfg.get("skip", 0)), ckpt_path=cfg.get("resume"))
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
    read = getattr(trainer.strategy, "pretrained_bytes_read", None)
    # the elements of the parameters this rank stores (a DTensor's local part): what tensor parallelism splits
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    report = {"rank": rank(), "losses": losses.losses, "step": trainer.global_step, "read": read, "held": held}
    check = getattr(trainer.strategy, "_plan_check", None)  # the blocks compared with themselves run whole
    report["plan_checked"] = check.checked if check is not None else []
    write_report(cfg["out"], report)


if __name__ == "__main__":
    run_worker(main)
