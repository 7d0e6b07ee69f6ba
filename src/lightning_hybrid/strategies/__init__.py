"""Lightning strategies of lightning-hybrid."""

from lightning_hybrid.strategies._layout import PipelineSplit, ZeroConfig
from lightning_hybrid.strategies.hybrid import HybridParallelStrategy

__all__ = ["HybridParallelStrategy", "PipelineSplit", "ZeroConfig"]
