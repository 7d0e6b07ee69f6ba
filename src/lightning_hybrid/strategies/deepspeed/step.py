"""One batch through DeepSpeed's engine from Lightning's hooks, and the checkpoint hooks.

training_step cuts the batch into micro-batches (the pipeline contract's reading) and calls the engine's
train_batch (forward, backward, reduction, clipping, step); backward and optimizer_step only run
Lightning's closure. Parameters no rank used and param groups added after set-up are refused on every rank
(the engine would step them differently from one process). Validation and test run eval_batch.
Checkpoints: the engine's parameters and optimizer state in the pack's layout-free form (state)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree, agreed_problem
from lightning_hybrid.checkpoint._sharded import read_meta
from lightning_hybrid.contract import micro_batches
from lightning_hybrid.strategies.deepspeed import state as ds_state
from lightning_hybrid.strategies.deepspeed.batch import shapes
from lightning_hybrid.strategies.deepspeed.config import precision_kind


class EngineStep:
    """DeepSpeedPipelineStrategy's step and checkpoint hooks (uses its engine, sizes and slots)."""

    def _micro_batches(self, batch: Any, mode: str) -> list[tuple[Any, Any]]:
        assert self.lightning_module is not None
        chunks = micro_batches(self.lightning_module, batch, self.layout.num_microbatches, self.root_device)
        # DeepSpeed's bf16 / fp16 engine holds the stages' weights in that dtype: floating inputs are cast to it
        # (as Lightning's DeepSpeedStrategy casts its batches); targets stay as they are, for the loss
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision_kind(self.precision_plugin.precision))
        if dtype is not None:
            chunks = [(_cast(inputs, dtype), target) for inputs, target in chunks]
        key = (mode, shapes(chunks[0]))
        if key != self._shape_key:  # new shapes, or train <-> eval: the stages agree on new buffers
            self.engine.reset_activation_shape()
            self._shape_key = key
        return chunks

    def _loss(self, output: Any, target: Any) -> Tensor:
        """The micro-batch loss DeepSpeed backpropagates. A counted loss (``pipeline_loss_count``): the
        micro-batch's mean weighted by its share of the batch's elements, times what DeepSpeed divides by
        (micro-batches, replicas), so the step's gradient and loss are the batch's exact mean."""
        module = self.lightning_module
        assert module is not None
        if self._counted is None:
            return module.pipeline_loss(output, target)
        n = self._counted.count(target)
        if n == 0:  # nothing counted in this micro-batch (all padding): it adds nothing, and no 0/0
            return (
                output.float().sum() * 0.0 if isinstance(output, Tensor) else sum(o.float().sum() * 0.0 for o in output)
            )
        share = n / max(self._batch_count, 1.0)
        return module.pipeline_loss(output, target) * (
            share * self.layout.num_microbatches * self.layout.data_parallel_size
        )

    def _watch_unused(self, module: pl.LightningModule) -> None:
        """DeepSpeed steps every element of its flat partitions (ZeRO-1) and gives every parameter a zero gradient
        before its gradient reduction (ZeRO-0, also with one replica): a parameter no rank produced a gradient
        for (BERT's pooler, an expert no token reached) would move under weight decay and momentum, where one
        process leaves it alone. Checked before each step (agreed), refused before the update."""
        self._used: set[int] = set()
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: self._used.add(id(p)))
        self._watched = params
        ds_state.client_optimizer(self.engine).register_step_pre_hook(self._refuse_unused)

    def _refuse_unused(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._loading:
            return
        unused = {id(p) for p in self._watched if id(p) not in self._used}
        self._used = set()
        # a replica may have used what this one did not: only a parameter no replica used counts
        flags = torch.tensor([float(id(p) in unused) for p in self._watched], device=self.root_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._data_parallel_group())
        names = [
            n
            for n, p in self.lightning_module.named_parameters()
            for f, q in zip(flags.tolist(), self._watched)
            if q is p and f
        ]
        problem = f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" if names else None
        problem = agreed_problem(problem, device=self.root_device)
        if problem:
            raise RuntimeError(
                f"Parameters got no gradient on any replica in this step ({problem}): DeepSpeed would still step them"
                " (its gradient reduction zero-fills missing gradients; ZeRO-1 steps every element of its"
                " partitions), so they would move where one process leaves them alone. Freeze them, or use"
                " HybridParallelStrategy, which steps only what some replica used."
            )

    def _refuse_added_groups(self) -> None:
        """A param group added after set-up (``BackboneFinetuning`` unfreezing a backbone) is not in DeepSpeed's
        partitions or reductions: its parameters would train apart on every replica. Agreed, before the step."""
        added = [len(o.param_groups) - n for o, n in zip(self.optimizers, self._groups_at_setup)]
        (changed,) = agree([float(any(added))], device=self.root_device)
        if changed:
            raise RuntimeError(
                "A param group was added to the optimizer after DeepSpeedPipelineStrategy set it up (a callback such"
                " as BackboneFinetuning): DeepSpeed's engine would not reduce or partition it. Put every parameter in"
                " the optimizer from the start, or use HybridParallelStrategy, which shards added groups."
            )

    def _data_parallel_group(self) -> Any:
        import deepspeed.comm as ds_comm  # noqa: F401  (the engine's groups exist once it is built)

        return self.engine.grid.get_data_parallel_group()

    def _count_batch(self, chunks: list[tuple[Any, Any]]) -> None:
        """A counted loss: the batch's elements over every replica, before DeepSpeed runs it (every stage holds
        the batch: the world's sum counts each replica once per stage)."""
        if self._counted is None:
            return
        local = sum(self._counted.count(target) for _, target in chunks)
        (total,) = agree([local], op="sum", device=self.root_device)
        self._batch_count = total / self.layout.pipeline_parallel_size

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        chunks = self._micro_batches(args[0], "train")
        self._refuse_added_groups()
        self._count_batch(chunks)
        loss = self.engine.train_batch(data_iter=iter(chunks))
        if self._buffers is not None:
            self._buffers.broadcast()  # running statistics: the first replica's on every replica, as under DDP
        loss = loss.detach().float().reshape(())  # the step's mean loss, the same on every rank
        module.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Union[Optimizer, None], *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # train_batch ran backward

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # training_step's train_batch reduced, clipped and stepped

    def _eval(self, metric: str, batch: Any) -> Tensor:
        module = self.lightning_module
        assert module is not None
        chunks = self._micro_batches(batch, "eval")
        self._count_batch(chunks)
        loss = self.engine.eval_batch(iter(chunks), num_micro_batches=len(chunks))
        loss = loss.detach().float().reshape(())  # the mean over micro-batches and replicas, on every rank
        module.log(metric, loss, prog_bar=True, sync_dist=False)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("val_loss", args[0])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_loss", args[0])

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ds_state.model_state(self.lightning_module, self._slots, partitioned=self._stepping)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._stepping:
            return {}
        return ds_state.optimizer_state(ds_state.client_optimizer(self.engine), self._slots)

    def read_sharded_checkpoint(self, path: Path, module: pl.LightningModule, *, fitting: bool) -> dict[str, Any]:
        optimizer = ds_state.client_optimizer(self.engine) if fitting else None
        self._loading = True  # loading creates the optimizer state by a zero-gradient step: no training step
        try:
            ds_state.load_sharded(
                path, module, self._slots, optimizer, strict=module.strict_loading, device=self.root_device
            )
        finally:
            self._loading = False
        return read_meta(path)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint loaded the optimizer state in place


def _cast(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast(t, dtype) for t in inputs)
    return inputs
