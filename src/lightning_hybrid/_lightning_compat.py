"""The only place lightning-hybrid touches private Lightning names (checked on lightning 2.6.6).

Each is used exactly as Lightning's own code uses it; a rename in a future release breaks here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.data import sized_len

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

__all__ = [
    "LastCheckpointLookup",
    "attach_device_mesh",
    "averaging_callbacks",
    "dump_checkpoint",
    "epoch_finished_at_restore",
    "grad_scaler",
    "group_adding_callbacks",
    "hooks_before_optimizer_step",
    "fit_data_source",
    "init_processes",
    "limit_training_batches",
    "is_mock_optimizer",
    "lightning_optimizers",
    "move_batch_counter",
    "process_group_backend",
    "recount_training_batches",
    "restart_train_iterator",
    "restored_batches",
    "share_zero_grad",
    "skips_backward",
    "syncs_batchnorm",
    "train_dataloaders",
]


class LastCheckpointLookup(ModelCheckpoint):
    """A ``ModelCheckpoint`` that answers ``fit(ckpt_path="last")`` through :meth:`resolve_last`.

    lightning 2.6.6 resolves "last" in ``_CheckpointConnector._parse_ckpt_path`` by calling the private
    ``ModelCheckpoint._find_last_checkpoints(trainer)`` of every ``ModelCheckpoint`` callback and loading the
    newest candidate (by modification time); there is no public hook for it.
    """

    def resolve_last(self, trainer: pl.Trainer) -> set[str]:
        """Paths Lightning may load for ``ckpt_path="last"`` (ModelCheckpoint's own rule by default)."""
        return super()._find_last_checkpoints(trainer)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        return self.resolve_last(trainer)


def dump_checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
    """The full checkpoint dict ``trainer.save_checkpoint`` would write (lightning 2.6.6)."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def train_dataloaders(trainer: pl.Trainer) -> list[Any]:
    """The fit loop's processed training dataloaders, as they will be iterated (lightning 2.6.6)."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """Re-create the training iterator ``FitLoop.setup_data`` made (it prefetches one batch) (lightning 2.6.6)."""
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` (lightning 2.6.6: its dataset is a
    ``_DatasetSamplerWrapper`` holding it as ``_sampler``), or None."""
    return getattr(getattr(sampler, "dataset", None), "_sampler", None)


def epoch_finished_at_restore(trainer: pl.Trainer) -> bool:
    """Whether the restored loop state ended its epoch: the checkpoint was written at the epoch's last batch
    (lightning 2.6.6 restores ``is_last_batch`` with the epoch loop's batch progress)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def restored_batches(trainer: pl.Trainer) -> int:
    """Batches of the epoch Lightning counts as started: at a restore, those trained; during a batch, its index + 1
    (lightning 2.6.6: the epoch loop's progress)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def move_batch_counter(trainer: pl.Trainer, batches: int) -> None:
    """Set the restored epoch's batch counter to ``batches`` (lightning 2.6.6: the epoch loop's ``batch_progress``;
    its ready/started/processed/completed keep their offsets, which tell where in a batch the checkpoint was
    written, and the totals move by the same amount). Runs before the epoch loop's ``reset``, which reads it."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = batches - progress.current.ready
    for tracker in (progress.current, progress.total):
        tracker.ready += shift
        tracker.started += shift
        tracker.processed += shift
        tracker.completed += shift


def limit_training_batches(trainer: pl.Trainer, batches: int) -> None:
    """End every epoch of this fit after ``batches`` training batches. Restarts the training iterator."""
    _set_training_batches(trainer, lambda loader: batches)


def recount_training_batches(trainer: pl.Trainer) -> None:
    """Recount the training batches per epoch after a loader's batch size changed (only without a
    ``limit_train_batches``). Restarts the training iterator."""
    _set_training_batches(trainer, lambda loader: sized_len(loader) or float("inf"))


def _set_training_batches(trainer: pl.Trainer, limit: Callable[[Any], Union[int, float]]) -> None:
    """Each training loader's batches per epoch, as ``limit_train_batches`` sets them in ``setup_data`` (lightning
    2.6.6: the combined loader's per-loader ``limits`` and ``FitLoop.max_batches``, set once there), and the
    validation interval that is a fraction of the epoch."""
    loop = trainer.fit_loop
    combined = loop._combined_loader
    if combined is None:
        return
    combined.limits = [limit(loader) for loader in combined.flattened]
    restart_train_iterator(trainer)  # the combined loader's length is its current iterator's, made with the limits
    batches = sized_len(combined)
    loop.max_batches = batches if batches is not None else float("inf")
    interval = trainer.val_check_interval
    if isinstance(interval, float) and isinstance(trainer.val_check_batch, int) and batches is not None:
        trainer.val_check_batch = max(1, int(batches * interval))


def init_processes(strategy: ModelParallelStrategy) -> None:
    """Device set-up, seeding and the default process group, as ``ModelParallelStrategy.setup_environment`` does
    them before it builds its own (data, tensor) mesh (lightning 2.6.6: ``_setup_distributed``)."""
    strategy._setup_distributed()


def attach_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``mesh`` what ``LightningModule.device_mesh`` returns in ``configure_model`` (lightning 2.6.6)."""
    module._device_mesh = mesh


def hooks_before_optimizer_step(plugin: Precision, model: pl.LightningModule, optimizer: Optimizer) -> None:
    """What a precision plugin runs between the closure and ``optimizer.step()``: the
    ``on_before_optimizer_step`` hooks and gradient clipping (lightning 2.6.6: ``Precision._after_closure``)."""
    plugin._after_closure(model, optimizer)


def averaging_callbacks(trainer: pl.Trainer) -> list[str]:
    """Names of the callbacks that keep a whole copy of the unsplit module and pair its parameters with the
    module's by position (``StochasticWeightAveraging`` deep-copies it in ``setup``, before any strategy cuts or
    shards it)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [type(c).__name__ for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]  # type: ignore[attr-defined]


def group_adding_callbacks(trainer: pl.Trainer) -> list[str]:
    """Names of the callbacks that add param groups during training (``BaseFinetuning`` and its subclasses)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    return [type(c).__name__ for c in trainer.callbacks if isinstance(c, BaseFinetuning)]  # type: ignore[attr-defined]


def syncs_batchnorm(strategy: Any) -> bool:
    """Whether the Trainer asked the strategy to convert BatchNorm layers (``Trainer(sync_batchnorm=True)``
    sets ``Strategy._layer_sync``; lightning 2.6.6)."""
    return getattr(strategy, "_layer_sync", None) is not None


def skips_backward(trainer: pl.Trainer) -> bool:
    """Whether the training loop skips every backward now (``StochasticWeightAveraging``'s BatchNorm epoch sets
    ``fit_loop._skip_backward``; lightning 2.6.6)."""
    return bool(trainer.fit_loop._skip_backward)


def grad_scaler(plugin: Precision) -> Any:
    """The torch ``GradScaler`` of Lightning's fp16 plugins (``MixedPrecision``, ``FSDPPrecision``), else None:
    such a plugin already skips steps with non-finite gradients. Both keep it in the public attribute ``scaler``."""
    from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision

    return plugin.scaler if isinstance(plugin, (MixedPrecision, FSDPPrecision)) else None


def share_zero_grad(wrappers: Iterable[Any]) -> None:
    """Lightning's ``LightningOptimizer`` copied its optimizer's attributes when it was made: the ``zero_grad``
    ZeRO-1/2's ``FlatShardedOptimizer`` set on an optimizer since then is given to its wrapper too (what
    ``self.optimizers()`` returns under manual optimization). lightning 2.6.6's wrapper copies them in ``__init__``."""
    for wrapper in wrappers:
        own = vars(wrapper.optimizer).get("zero_grad")
        if own is not None:
            wrapper.zero_grad = own


def lightning_optimizers(strategy: Any) -> list[Any]:
    """The ``LightningOptimizer`` wrappers a strategy made of its optimizers (``Strategy._lightning_optimizers``)."""
    return strategy._lightning_optimizers


def process_group_backend(strategy: Any) -> str:
    """The backend ``DDPStrategy`` chose for its process group (``DDPStrategy._get_process_group_backend``)."""
    return strategy._get_process_group_backend()


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the stand-in Lightning sets when ``configure_optimizers`` returned None."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    return isinstance(optimizer, _MockOptimizer)


def fit_data_source(trainer: pl.Trainer) -> Any:
    """The training data source of the fit loop (``fit_loop._data_source``: ``is_defined()``, ``dataloader()``),
    where Lightning's own DeepSpeed strategy reads the batch size before training."""
    return trainer.fit_loop._data_source
