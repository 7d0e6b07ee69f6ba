"""HybridParallelStrategy's checkpoints: the model and optimizer state in the layout-free, name-keyed form, and
a sharded checkpoint of any layout loaded into this one (_state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid.strategies._state import (
    load_sharded_checkpoint,
    model_state,
    optimizer_state,
)


class HybridCheckpoints:
    """HybridParallelStrategy's checkpoint hooks (uses its gradient sync and checkpoint names)."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return model_state(self.lightning_module, self._gradient_sync, self._checkpoint_names)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return optimizer_state(
            self.lightning_module, self._unwrap(optimizer), self._gradient_sync, self._checkpoint_names
        )

    def read_sharded_checkpoint(self, path: Path, module: pl.LightningModule, *, fitting: bool) -> dict[str, Any]:
        optimizers = [self._unwrap(o) for o in self.optimizers] if fitting else []
        meta = load_sharded_checkpoint(
            path,
            module,
            optimizers,
            self._gradient_sync,
            self._checkpoint_names,
            strict=module.strict_loading,
            device=self.root_device,
            # param groups added during the checkpoint's run come back (a resume, not a roll-back inside a run)
            restore_groups=not self._training_started,
        )
        return meta
