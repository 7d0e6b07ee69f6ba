"""A LightningModule that runs Hugging Face GPT-2's blocks under the pipeline contract (blocks in ``self.layers``),
built on the meta device, and the key map that loads a ``save_pretrained`` GPT-2 checkpoint into it."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from lightning_hybrid.optim import LAMB


def gpt2_config(**overrides: Any) -> GPT2Config:
    kwargs = {
        "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0,
        "attn_implementation": "sdpa",
    }  # fmt: skip
    return GPT2Config(**{**kwargs, **overrides})


class Embed(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class PipelinedGPT2(L.LightningModule):
    """GPT-2 as ``layers = [Embed, GPT2Block x n_layer, Head]``; the head is a separate tensor (tied in the
    checkpoint: ``transformer.wte.weight`` feeds both)."""

    def __init__(self, *, n_layer: int = 2, lr: float = 0.0, **config: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = gpt2_config(n_layer=n_layer, **config)
        self.layers: nn.Sequential | None = None

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        with torch.device("meta"):  # nothing allocated: the strategy materialises this rank's blocks only
            self.layers = nn.Sequential(
                Embed(self.config),
                *(GPT2Block(self.config, layer_idx=i) for i in range(self.config.n_layer)),
                Head(self.config),
            )

    def forward(self, idx: Tensor) -> Tensor:
        return self.layers(idx)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return self.pipeline_loss(self(inputs), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TiedGPT2(PipelinedGPT2):
    """Hugging Face's ``GPT2LMHeadModel`` as a user would take it (input and output embeddings tied: one
    Parameter), its own modules regrouped into ``layers = [Embed, GPT2Block x n_layer, Head]``."""

    def __init__(self, *, n_layer: int = 2, block_size: int = 16, lr: float = 0.01, optimizer: str = "sgd") -> None:
        super().__init__(n_layer=n_layer, lr=lr, n_positions=block_size)
        self.save_hyperparameters()
        hf = GPT2LMHeadModel(self.config)
        assert hf.lm_head.weight is hf.transformer.wte.weight, "GPT-2 ties its embeddings by default"
        embed, head = Embed.__new__(Embed), Head.__new__(Head)
        nn.Module.__init__(embed)
        nn.Module.__init__(head)
        embed.wte, embed.wpe = hf.transformer.wte, hf.transformer.wpe
        head.ln_f, head.lm_head = hf.transformer.ln_f, hf.lm_head
        self.layers = nn.Sequential(embed, *hf.transformer.h, head)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "lamb":
            return LAMB(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return super().configure_optimizers()


def gpt2_key_map(n_layer: int) -> dict[str, Any]:
    """Hugging Face GPT-2 names -> PipelinedGPT2 names (block i of ``transformer.h`` is ``layers.i+1``)."""
    head = n_layer + 1
    return {
        "transformer.wte.": ["layers.0.wte.", f"layers.{head}.lm_head."],  # tied: one tensor, two names
        "transformer.wpe.": "layers.0.wpe.",
        **{f"transformer.h.{i}.": f"layers.{i + 1}." for i in range(n_layer)},
        "transformer.ln_f.": f"layers.{head}.ln_f.",
    }
