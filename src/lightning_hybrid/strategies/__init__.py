"""Lightning strategies of lightning-hybrid."""

from lightning_hybrid.checkpoint.pretrained import PretrainedWeights
from lightning_hybrid.strategies._materialize import block_seed, seeded_init
from lightning_hybrid.strategies.deepspeed.strategy import DeepSpeedPipelineStrategy
from lightning_hybrid.strategies.hybrid import HybridParallelStrategy
from lightning_hybrid.strategies.pipeline.partition import PipelineSplit
from lightning_hybrid.strategies.zero.config import ZeroConfig

__all__ = [
    "DeepSpeedPipelineStrategy",
    "HybridParallelStrategy",
    "PipelineSplit",
    "PretrainedWeights",
    "ZeroConfig",
    "block_seed",
    "seeded_init",
]
