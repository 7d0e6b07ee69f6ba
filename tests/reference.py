"""Independent single-process references: plain PyTorch loops, no Lightning and no lightning-hybrid."""

from __future__ import annotations

from typing import Any

import torch
from workers.common import ExactDataModule, build_model, global_batches


def reference_run(
    cfg: dict[str, Any], *, steps: int, accumulate: int = 1, clip: float | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the worker's model on the worker's global batches in one process.

    Returns the loss of every micro-step (global batch) and the final weights.
    """
    model = build_model(cfg)
    data = ExactDataModule(block_size=model.hparams.block_size, **cfg.get("data", {}))
    optimizer = model.configure_optimizers()
    if isinstance(optimizer, dict):
        optimizer = optimizer["optimizer"]
    batches = iter(global_batches(data.train_set, data.global_batch, data.seed))
    losses: list[float] = []
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            loss = model.pipeline_loss(model(x), y)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
