"""Tensor parallelism: each block split over the tensor-parallel ranks by the module's plan (torch's parallel
styles, applied with ``parallelize_module``); see :mod:`.plan` and :mod:`.local`."""

from lightning_hybrid.strategies.tensor.local import TensorSlice, tensor_slice, tensor_slices
from lightning_hybrid.strategies.tensor.plan import TensorPlans, plan_blocks

__all__ = ["TensorPlans", "TensorSlice", "plan_blocks", "tensor_slice", "tensor_slices"]
