"""The only place lightning-hybrid imports private Lightning names (checked on lightning 2.6.6).

Each is used exactly as Lightning's own strategies use it; a rename in a future release breaks here, once.
"""

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import (  # lightning 2.6.6
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME  # lightning 2.6.6: "meta.pt"
from lightning.fabric.utilities.seed import reset_seed  # public in spirit; re-seeds from PL_GLOBAL_SEED

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "_METADATA_FILENAME",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "dump_checkpoint",
    "reset_seed",
    "restart_train_iterator",
    "train_dataloaders",
]


def dump_checkpoint(trainer: "pl.Trainer") -> dict[str, Any]:
    """The full checkpoint dict ``trainer.save_checkpoint`` would write (lightning 2.6.6)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def train_dataloaders(trainer: "pl.Trainer") -> list[Any]:
    """The fit loop's processed training dataloaders, as they will be iterated (lightning 2.6.6)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def restart_train_iterator(trainer: "pl.Trainer") -> None:
    """Re-create the training iterator ``FitLoop.setup_data`` made (it prefetches one batch) (lightning 2.6.6)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)
