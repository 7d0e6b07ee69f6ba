"""Helpers that work on lightning-hybrid checkpoints outside a Trainer."""

from lightning_hybrid.utilities.consolidate import consolidate_checkpoint
from lightning_hybrid.utilities.export_pretrained import export_pretrained

__all__ = ["consolidate_checkpoint", "export_pretrained"]
