"""The only place lightning-hybrid imports private Lightning names (checked on lightning 2.6.6).

Each is used exactly as Lightning's own strategies use it; a rename in a future release breaks here, once.
"""

from lightning.fabric.utilities.distributed import (  # lightning 2.6.6
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.load import _METADATA_FILENAME  # lightning 2.6.6: "meta.pt"
from lightning.fabric.utilities.seed import reset_seed  # public in spirit; re-seeds from PL_GLOBAL_SEED

__all__ = [
    "_METADATA_FILENAME",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "reset_seed",
]
