"""Optimizers for large-batch training that stay exact under every layout, and the ZeRO allow-list."""

from lightning_hybrid.optim._shardable import register_elementwise
from lightning_hybrid.optim.layerwise import LAMB, LARS, LayerwiseOptimizer, TensorPartition

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer", "TensorPartition", "register_elementwise"]
