"""Hugging Face causal LMs through ``lightning_hybrid.models.CausalLM``, as shapes of the matrix (their rows
follow the model shapes of ``shapes``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from shapes import Shape, TokenMean
from torch import Tensor
from torch.utils.data import TensorDataset


class HFCausalLM(TokenMean):
    """A ``transformers`` causal LM through ``lightning_hybrid.models.CausalLM``: its blocks as the layers
    (each builds its causal mask and rotary table), labels with ignored positions, the loss a mean over
    the counted tokens. AdamW only (the per-family cost is the set-up)."""

    family = "llama"
    fields: dict[str, Any] = {}
    optimizers_tested = ("adamw",)
    eps = 1e-6  # as GPT2: zero-gradient elements (an unused expert's rounding noise) stay small

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoConfig

        from lightning_hybrid.models import CausalLM

        base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
                "tie_word_embeddings": False}  # fmt: skip
        fields = self.fields if self.family == "gpt2" else {**base, **self.fields}
        lm = CausalLM(AutoConfig.for_model(self.family, **fields), attn_implementation="eager")
        self.layers = lm.layers

    def forward(self, x: Tensor) -> Tensor:
        out: Any = (x,)
        for block in self.layers:
            out = block(*out)
        return out

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(8)
        tokens = torch.randint(0, 32, (self.samples, 9), generator=g)
        target = tokens[:, 1:].clone()
        target[torch.rand(self.samples, 8, generator=g) < 0.25] = -100
        return TensorDataset(tokens[:, :-1], target)


class HFLlama(HFCausalLM):
    """Llama (grouped-query attention, rotary, RMSNorm, SwiGLU) through CausalLM."""


class HFQwen2(HFCausalLM):
    """Qwen2 (biases on q, k, v) through CausalLM."""

    family = "qwen2"


class HFMistral(HFCausalLM):
    """Mistral with a sliding window shorter than the sequence, through CausalLM."""

    family = "mistral"
    fields = {"sliding_window": 4}


class HFMixtral(HFCausalLM):
    """Mixtral (top-2 of 4 routed experts per token) through CausalLM."""

    family = "mixtral"
    fields = {"num_local_experts": 4, "num_experts_per_tok": 2}


class HFGPT2(HFCausalLM):
    """GPT-2 (input and output embeddings tied) through CausalLM."""

    family = "gpt2"
    # its attention's key bias has a zero gradient in exact arithmetic (as the GPT2 shape's): Adam turns rounding
    # noise into updates, and a rank's own micro-batch loss after a resume on another layout moved 1.3e-5
    loss_tolerance = 2e-5
    fields = {"vocab_size": 32, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip


HF_SHAPES: dict[str, Callable[[], Shape]] = {
    "causal-lm-llama": HFLlama,
    "causal-lm-qwen2": HFQwen2,
    "causal-lm-mistral": HFMistral,
    "causal-lm-mixtral": HFMixtral,
    "causal-lm-gpt2-tied": HFGPT2,
}
