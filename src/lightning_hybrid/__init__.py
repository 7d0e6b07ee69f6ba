"""lightning-hybrid: hybrid pipeline x ZeRO parallelism and failure-aware training for PyTorch Lightning.

Importing the package registers the ``"hybrid"`` strategy names with Lightning, so
``Trainer(strategy="hybrid")`` and LightningCLI's ``--trainer.strategy=hybrid`` resolve.
"""

from lightning_hybrid._registry import register_strategies
from lightning_hybrid.strategies import HybridParallelStrategy

__version__ = "0.1.0"

__all__ = ["HybridParallelStrategy", "__version__", "register_strategies"]

register_strategies()
