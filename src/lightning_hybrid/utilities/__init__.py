"""Helpers that work on lightning-hybrid checkpoints outside a Trainer."""

from lightning_hybrid.utilities.consolidate import consolidate_checkpoint

__all__ = ["consolidate_checkpoint"]
