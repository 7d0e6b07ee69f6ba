"""A Hugging Face model's own tensor-parallel plan (``config.base_model_tp_plan``) as torch's parallel styles for
each block of the cut: ``CausalLM.tensor_parallel_plan``.

transformers names each decoder layer's projections (``layers.*.self_attn.q_proj: colwise``, ...); within a
:class:`~lightning_hybrid.models._hf_cut.DecoderBlock` they are ``layer.self_attn.q_proj``. Attention needs
nothing else: transformers' attention reads the head count from the projection's width (``view(..., -1,
head_dim)``) and repeats key/value heads by their ratio, which a split by whole heads keeps. The head is split
by vocabulary with its logits gathered (transformers' ``lm_head: colwise_gather_output``); the token embedding
stays whole, as transformers keeps it, unless it is tied to the head: then it is split by vocabulary too
(``RowwiseParallel``), so the tied parameter is one slice on each rank. A key naming a module a layer does not
have is passed over, as transformers passes it over (Qwen2-MoE's ``mlp.gate_proj`` in its sparse layers, whose
experts then stay whole on every rank); a layer none of whose modules the plan names is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_hybrid.models._hf_cut import DecoderBlock, Head, TokenEmbedding
from lightning_hybrid.strategies.tensor.plan import plan_targets

__all__ = ["hf_tensor_parallel_plan"]

# transformers' style names -> torch's styles (the ones whose meaning torch's styles state exactly)
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
}
_WHOLE = {"replicate"}  # kept whole on every tensor-parallel rank


def hf_tensor_parallel_plan(
    config: Any, block: nn.Module, size: int, passed_over: set[str] | None = None
) -> dict[str, ParallelStyle]:
    """The plan of one block of a cut Hugging Face model for ``size`` tensor-parallel ranks; the plan's keys this
    block has no module for are added to ``passed_over``."""
    kind = getattr(config, "model_type", type(config).__name__)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"tensor_parallel_size={size}: the {kind} config has no base_model_tp_plan, so it does not say how its"
            " layers split. Use tensor_parallel_size=1 (pipeline and ZeRO), or subclass CausalLM and return your"
            " own plan from tensor_parallel_plan(name, block)."
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if heads is not None and heads % size:
            raise ValueError(
                f"tensor_parallel_size={size} must divide the {kind} config's {field} ({heads}): each rank holds"
                " whole attention heads. Choose a divisor of it."
            )
    if isinstance(block, TokenEmbedding):
        tied = getattr(config, "tie_word_embeddings", False)
        return {"embed_tokens": RowwiseParallel(input_layouts=Replicate())} if tied else {}
    if isinstance(block, Head):
        return {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    if not isinstance(block, DecoderBlock):
        raise ValueError(f"tensor_parallel_size={size}: {kind} blocks of type {type(block).__name__} have no plan.")
    out: dict[str, ParallelStyle] = {}
    absent, fits = [], 0
    for key, style in plan.items():
        if not key.startswith("layers.*."):
            continue  # outside the decoder layers (transformers names none there for the families cut here)
        name = "layer." + key[len("layers.*.") :]
        if not plan_targets(block, name):
            # as transformers applies its plan: a key no module of this layer has is passed over (a sparse MoE
            # layer has no mlp.gate_proj, its dense layers do): that part stays whole on every rank, exactly
            absent.append(name)
            continue
        fits += 1
        if style in _WHOLE:
            continue
        if style not in STYLES:
            raise ValueError(
                f"tensor_parallel_size={size}: the {kind} plan splits {key} as {style!r}, which the pack does not"
                f" translate into torch's parallel styles (it knows {sorted(STYLES)}). Use tensor_parallel_size=1,"
                " or return your own plan from a CausalLM subclass's tensor_parallel_plan(name, block)."
            )
        out[name] = STYLES[style]()
    if passed_over is not None:
        passed_over.update(absent)
    if absent and not fits:  # not one key fits: the plan does not describe this model's layers at all
        inside = ", ".join(n for n, _ in block.named_modules() if n)
        raise ValueError(
            f"tensor_parallel_size={size}: the {kind} config's base_model_tp_plan names none of this decoder"
            f" layer's modules ({', '.join(absent)}; the layer has {inside}). Use tensor_parallel_size=1, or return"
            " your own plan from a CausalLM subclass's tensor_parallel_plan(name, block)."
        )
    return out
