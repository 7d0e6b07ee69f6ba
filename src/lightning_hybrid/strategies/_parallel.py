"""What both engines' strategies say of their layout, written once: the request and the resolved layout, this
rank's coordinates in it, which samples it reads, and the record its checkpoints carry."""

from __future__ import annotations

from typing import Any, TypeVar, Union

from lightning_hybrid.strategies._layout import Layout, LayoutRequest
from lightning_hybrid.strategies._same_batch import CHECKED_BATCHES, check_replica_batches, seed_workers_by_replica

__all__ = ["ParallelLayout", "known"]

T = TypeVar("T")


def known(value: Union[T, None], when: str) -> T:
    """``value``, once it exists; before, a RuntimeError that says ``when`` it will."""
    if value is None:
        raise RuntimeError(when)
    return value


class ParallelLayout:
    """Mixed into a strategy that sets ``_request`` in its constructor and ``_layout`` in ``setup_environment``
    (with ``_counted``, its counted-loss weighting or None, and ``global_rank``)."""

    _request: LayoutRequest
    _layout: Union[Layout, None]
    _counted: Any
    engine_label: str  # what checkpoints record as the engine that wrote them

    @property
    def layout_request(self) -> LayoutRequest:
        """The sizes asked for, before the world size is known (:attr:`layout` is what they resolved to)."""
        return self._request

    @property
    def layout(self) -> Layout:
        """The resolved layout, known once the processes are initialised (``setup_environment``)."""
        return known(self._layout, "The layout is known once the processes are initialised (setup_environment).")

    @property
    def pipeline_rank(self) -> int:
        return self.layout.coordinates(self.global_rank)[0]  # type: ignore[attr-defined]

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank)[1]  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same samples (the first stage the inputs, the last the targets):
        # the data is split over the data-parallel ranks only
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.data_parallel_rank}

    def process_dataloader(self, dataloader: object) -> object:
        # a replica's stages and peers: workers seeded alike, so they draw the same augmentations
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        seed_workers_by_replica(dataloader, self.data_parallel_rank, self.root_device)  # type: ignore[attr-defined]
        return dataloader

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        layout = self.layout
        if batch_idx < CHECKED_BATCHES and layout.pipeline_parallel_size * layout.tensor_parallel_size > 1:
            check_replica_batches(batch, replicas=layout.model_parallel_groups(), device=self.root_device)  # type: ignore[attr-defined]

    def exact_window_means(self) -> bool:
        """Whether each step is the exact mean over its window's counted elements (``pipeline_loss_count``)."""
        return self._counted is not None

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint is written with (informational: any layout and either engine reads it)."""
        return self.layout.record(engine=self.engine_label, tied_parameters=self.tied_record())

    def tied_record(self) -> list[Any]:
        """Where the checkpoint stores parameters tied across stages (none unless the engine keeps ties)."""
        return []
