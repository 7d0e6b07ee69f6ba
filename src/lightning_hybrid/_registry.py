"""Registration of the pack's strategy names with Lightning's registry (idempotent)."""

from __future__ import annotations

__all__ = ["register_strategies"]


def register_strategies() -> list[str]:
    """Register ``"hybrid"`` and its presets and ``"deepspeed_pipeline"``; safe to call any number of times.
    Returns the names."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_hybrid.strategies.deepspeed.strategy import DeepSpeedPipelineStrategy
    from lightning_hybrid.strategies.hybrid import HybridParallelStrategy

    HybridParallelStrategy.register_strategies(StrategyRegistry)
    DeepSpeedPipelineStrategy.register_strategies(StrategyRegistry)
    return sorted(name for name in StrategyRegistry if name.startswith(("hybrid", "deepspeed_pipeline")))
