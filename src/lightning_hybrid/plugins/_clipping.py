"""Gradient clipping by the norm of the whole model, however it is split over stages and shards.

Lightning's precision plugins clip with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's local
parameters. Under a pipeline each rank holds only its stages, and under ZeRO only its shard, so that norm
is partial and ranks would clip by different factors. A strategy that splits the model gives the plugin
a ``grad_norm_fn`` that reduces the squared norm over the right ranks; everything else is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["GradNormFn", "MeshAwareClippingMixin", "mesh_aware_precision"]

GradNormFn = Callable[[Iterable[Tensor]], Tensor]
PrepareFn = Callable[[Optimizer], None]


class MeshAwareClippingMixin:
    """Mixin for a ``Precision`` plugin: clip by the global gradient norm when a strategy provides one."""

    grad_norm_fn: GradNormFn | None = None
    # makes the optimizer's gradients the ones it steps with (reduced over the replicas, this rank's shard);
    # idempotent within a step: under manual optimization ``clip_gradients`` runs before ``optimizer.step()``
    prepare_fn: PrepareFn | None = None

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: float | int = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val and self.prepare_fn is not None:
            self.prepare_fn(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)  # type: ignore[misc]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        if self.grad_norm_fn is None:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
            return
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]  # type: ignore[attr-defined]
        total = self.grad_norm_fn(grads)
        # same arithmetic as torch.nn.utils.clip_grad_norm_, so an unsplit run clips identically
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))


class _MeshAwarePrecision(MeshAwareClippingMixin, Precision):
    """fp32 / true-precision training with mesh-aware clipping."""


class _MeshAwareMixedPrecision(MeshAwareClippingMixin, MixedPrecision):
    """Lightning's ``MixedPrecision`` with mesh-aware clipping."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        MeshAwareClippingMixin.clip_grad_by_norm(self, optimizer, clip_val)


def mesh_aware_precision(
    plugin: Precision, grad_norm_fn: GradNormFn, prepare_fn: PrepareFn | None = None
) -> Precision | None:
    """The plugin to use in place of ``plugin`` so that clipping sees the global norm.

    Returns ``plugin`` itself when it already understands ``grad_norm_fn``, an equivalent mesh-aware copy of
    Lightning's stock ``Precision`` / ``MixedPrecision``, or ``None`` for a plugin it does not know.
    """
    if isinstance(plugin, MeshAwareClippingMixin):
        plugin.grad_norm_fn, plugin.prepare_fn = grad_norm_fn, prepare_fn
        return plugin
    new: Precision
    if type(plugin) is Precision:
        new = _MeshAwarePrecision()
    elif type(plugin) is MixedPrecision:
        new = _MeshAwareMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    else:
        return None
    new.grad_norm_fn, new.prepare_fn = grad_norm_fn, prepare_fn  # type: ignore[attr-defined]
    return new
