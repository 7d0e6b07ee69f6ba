"""Lightning strategies of lightning-hybrid."""

from lightning_hybrid.checkpoint.pretrained import PretrainedWeights
from lightning_hybrid.strategies._layout import PipelineSplit, ZeroConfig
from lightning_hybrid.strategies._materialize import block_seed, seeded_init
from lightning_hybrid.strategies.deepspeed.strategy import DeepSpeedPipelineStrategy
from lightning_hybrid.strategies.hybrid import HybridParallelStrategy

__all__ = [
    "DeepSpeedPipelineStrategy",
    "HybridParallelStrategy",
    "PipelineSplit",
    "PretrainedWeights",
    "ZeroConfig",
    "block_seed",
    "seeded_init",
]
