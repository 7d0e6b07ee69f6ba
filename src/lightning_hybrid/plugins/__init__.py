"""Precision plugins of lightning-hybrid."""

from lightning_hybrid.plugins._loss_scale import LossScaleConfig
from lightning_hybrid.plugins.adaptive_loss_scaling import AdaptiveLossScalingPrecision

__all__ = ["AdaptiveLossScalingPrecision", "LossScaleConfig"]
