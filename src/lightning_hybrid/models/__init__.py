"""Models the pack trains as they come: Hugging Face ``transformers`` causal LMs under the pipeline contract."""

from lightning_hybrid.models.causal_lm import CausalLM

__all__ = ["CausalLM"]
