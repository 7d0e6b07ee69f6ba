"""HybridParallelStrategy's checkpoints: the model and optimizer state in the layout-free, name-keyed form, and
a sharded checkpoint of any layout loaded into this one (_state)."""

from __future__ import annotations

import os
from typing import Any, Union

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid.checkpoint._sharded import LAYOUT_KEY
from lightning_hybrid.strategies._state import (
    checkpoint_folder,
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

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, os.PathLike], weights_only: Union[bool, None] = None
    ) -> dict[str, Any]:
        # payloads are read with weights_only=True whatever `weights_only` says: a checkpoint never runs code
        path = checkpoint_folder(self, checkpoint_path)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
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
        written = meta.get(LAYOUT_KEY)
        if written:
            rank_zero_info(f"Resumed from {path} (written with {written}) onto {self.layout}")
        return meta
