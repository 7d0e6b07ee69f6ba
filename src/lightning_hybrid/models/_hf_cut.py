"""A Hugging Face causal LM cut into pipeline blocks: ``[embedding, decoder layer x N, head]``, and its names.

``transformers`` says how its decoder-only models are cut: ``config.base_model_pp_plan`` is ``embed_tokens ->
layers -> norm`` (the tensors passed between them), then the model's ``lm_head``. Each block here takes and
returns plain tensors, as the pipeline contract asks: the first takes ``input_ids`` (and the batch's
``attention_mask``, all ones without one), then ``(hidden, attention_mask)`` pass between blocks, the 2-D
padding mask travelling with the hidden states, so that every decoder block builds the 4-D mask for its
attention implementation with ``transformers``' own mask functions (the causal mask is never left to a
default that differs between ``eager`` and ``sdpa``), and the rotary table from its position ids. Position
ids are ``0..T-1`` for every row, as ``model(**batch)`` uses them without a cache (left padding included).

The rotary module of each decoder block is kept out of the module tree (a parameter-free table, rebuilt from
the config on the host): nothing to materialise, initialise or checkpoint when the model is built on the
meta device.

GPT-2 has no plan; its cut is ``[wte + wpe, GPT2Block x N, ln_f + lm_head]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["FAMILIES", "HFCut", "cut_causal_lm"]

# The families whose base model's forward does nothing outside embed_tokens -> layers -> norm -> lm_head beyond
# what the blocks here rebuild (checked against ``model(**batch).loss`` in the tests), and how each picks a
# decoder layer's mask: always causal, sliding when ``config.sliding_window`` is set, or by ``layer_types``.
# Others (logit soft-capping, logit or embedding multipliers, per-layer rotary tables, linear attention) would
# train something else than the model: refused until checked.
FAMILIES = {
    "llama": "causal",
    "gemma": "causal",
    "qwen2": "layer_types",
    "qwen2_moe": "layer_types",
    "mistral": "sliding_window",
    "mixtral": "sliding_window",
    "phi3": "sliding_window",
}


class TokenEmbedding(nn.Module):
    """``embed_tokens`` (the family's own module: Gemma's scales its output)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.embed_tokens(input_ids), _mask(input_ids, attention_mask)


class DecoderBlock(nn.Module):
    """One decoder layer with what the base model's forward gives it: its 4-D mask and rotary table."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self._rotary = (rotary,)  # a tuple: not a submodule (host-side table, nothing to shard or save)
        self._sliding = sliding

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        positions, mask = _positions_and_mask(self.config, hidden, attention_mask, sliding=self._sliding)
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self._rotary[0](hidden, positions),
            use_cache=False,
        )
        return (out[0] if isinstance(out, tuple) else out), attention_mask


class Head(nn.Module):
    """The base model's final norm and the LM head: logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))


class GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.drop(self.wte(input_ids) + self.wpe(positions)), _mask(input_ids, attention_mask)


class GPT2Decoder(nn.Module):
    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        positions, mask = _positions_and_mask(self.config, hidden, attention_mask, sliding=False)
        out = self.block(hidden, None, mask, position_ids=positions, use_cache=False)
        return (out[0] if isinstance(out, tuple) else out), attention_mask


class GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(hidden))


def _positions_and_mask(config: Any, hidden: Tensor, attention_mask: Tensor, *, sliding: bool) -> tuple[Tensor, Any]:
    """Position ids ``0..T-1`` and the layer's mask for its attention implementation, as the base model's forward
    builds them without a cache (``transformers``' own mask functions)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    mask = make_mask(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None, position_ids=positions
    )
    return positions, mask


def _mask(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The padding mask that travels with the hidden states: all ones when the batch has none."""
    return torch.ones_like(input_ids) if attention_mask is None else attention_mask


@dataclass
class HFCut:
    """The blocks and how their names relate to the Hugging Face model's (``prefixes``: HF prefix -> the
    blocks' prefixes, in ``self.layers``; a tied input embedding feeds two)."""

    blocks: list[nn.Module]
    prefixes: dict[str, list[str]]
    init_weights: Callable[[nn.Module], None]


def cut_causal_lm(model: nn.Module) -> HFCut:
    """Cut a ``transformers`` causal LM into pipeline blocks (the model's own modules, not copies)."""
    config = model.config
    family = getattr(config, "model_type", None)
    if family == "gpt2":
        return _cut_gpt2(model)
    if family not in FAMILIES:
        raise ValueError(
            f"CausalLM has not been checked against transformers for model_type={family!r}: the families whose"
            f" loss it reproduces exactly are {', '.join(sorted([*FAMILIES, 'gpt2']))}. Other families may do work"
            " outside their decoder layers (logit soft-capping, logit or embedding multipliers, per-layer rotary"
            " tables) that the cut would drop. Write the blocks under the pipeline contract (README: the pipeline"
            " contract), or use pipeline_parallel_size=1 with the model as it is."
        )
    plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    expected = ("embed_tokens", "layers", "norm")
    if not plan or tuple(plan) != expected or base is None or not hasattr(model, "lm_head"):
        raise ValueError(
            f"CausalLM cannot cut {type(model).__name__}: its config has no base_model_pp_plan of the form"
            f" embed_tokens -> layers -> norm (found {dict(plan) if plan else None}) or it has no lm_head. Families"
            " with one (Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE, Phi-3, Gemma and others) and GPT-2 are"
            " supported; for another model, write the blocks under the pipeline contract (README: the pipeline"
            " contract) or use pipeline_parallel_size=1 with the model as it is."
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"CausalLM does not add the router's auxiliary loss of {type(model).__name__} yet: set"
            " output_router_logits=False in the config (the experts and router still train on the LM loss)."
        )
    if not hasattr(base, "rotary_emb"):
        raise ValueError(f"CausalLM cannot cut {type(model).__name__}: its base model has no rotary_emb.")
    with torch.device("cpu"):  # a host-side table, also when the model is built on the meta device
        rotary = type(base.rotary_emb)(config=config)
    n = len(base.layers)
    head = n + 1
    sliding = _sliding_layers(config, FAMILIES[family], n)
    blocks: list[nn.Module] = [TokenEmbedding(base.embed_tokens)]
    blocks += [DecoderBlock(layer, config, rotary, sliding[i]) for i, layer in enumerate(base.layers)]
    blocks.append(Head(base.norm, model.lm_head))
    prefix = f"{model.base_model_prefix}."
    prefixes = {
        f"{prefix}embed_tokens.": ["layers.0.embed_tokens."],
        **{f"{prefix}layers.{i}.": [f"layers.{i + 1}.layer."] for i in range(n)},
        f"{prefix}norm.": [f"layers.{head}.norm."],
        "lm_head.": [f"layers.{head}.lm_head."],
    }
    if model.lm_head.weight is base.embed_tokens.weight:  # a folder may also store lm_head.weight: the same values
        prefixes[f"{prefix}embed_tokens."].append(f"layers.{head}.lm_head.")
    return HFCut(blocks, prefixes, FamilyInit(model))


def _sliding_layers(config: Any, rule: str, n: int) -> list[bool]:
    """Which decoder layers attend through a sliding window, as the family's own forward decides."""
    if rule == "causal":
        return [False] * n
    if rule == "sliding_window":
        return [getattr(config, "sliding_window", None) is not None] * n
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"CausalLM: layer_types {unknown} of {config.model_type} are not supported (full and sliding)."
        )
    return [t == "sliding_attention" for t in types[:n]]


def _cut_gpt2(model: nn.Module) -> HFCut:
    t, config = model.transformer, model.config
    n = len(t.h)
    head = n + 1
    blocks: list[nn.Module] = [GPT2Embedding(t.wte, t.wpe, t.drop)]
    blocks += [GPT2Decoder(block, config) for block in t.h]
    blocks.append(GPT2Head(t.ln_f, model.lm_head))
    prefixes = {
        "transformer.wte.": ["layers.0.wte."],
        "transformer.wpe.": ["layers.0.wpe."],
        **{f"transformer.h.{i}.": [f"layers.{i + 1}.block."] for i in range(n)},
        "transformer.ln_f.": [f"layers.{head}.ln_f."],
        "lm_head.": [f"layers.{head}.lm_head."],
    }
    if model.lm_head.weight is t.wte.weight:
        prefixes["transformer.wte."].append(f"layers.{head}.lm_head.")
    return HFCut(blocks, prefixes, FamilyInit(model))


class FamilyInit:
    """The family's own ``_init_weights`` for one submodule, called on a shell that holds only the config (the
    cut must not keep the whole model alive: a pipeline stage frees the other stages' blocks). Picklable."""

    def __init__(self, model: nn.Module) -> None:
        self.cls, self.config = type(model), model.config

    def __call__(self, module: nn.Module) -> None:
        shell = self.cls.__new__(self.cls)
        object.__setattr__(shell, "config", self.config)
        self.cls._init_weights(shell, module)
