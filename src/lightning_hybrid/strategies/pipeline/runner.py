"""Running a pipeline schedule inside Lightning's training and evaluation steps.

Lightning's automatic optimisation runs ``training_step`` -> ``zero_grad`` -> ``backward``. A pipeline
schedule runs forward *and* backward inside ``training_step``. Each micro-batch's loss is divided by the
number of micro-batches and by the accumulation count before its backward, so the gradients accumulate to
exactly what Lightning's own backward of the step's mean loss would give. When Lightning's ``zero_grad``
can reach the model's gradients (the optimizer holds the model's parameters: ZeRO-0 and ZeRO-3), the
runner sets the earlier gradients aside during the schedule and adds the new ones back in ``backward``;
under ZeRO-1/2 the gradients accumulate in flat buffers, which the strategy holds through that zero_grad.

The loss exists on the last stage only: one all-reduce gives every rank the step's mean loss (fp32:
a bf16 value broadcast into an fp32 buffer arrives as 0.0 over gloo), averaged over the data-parallel
replicas, so the progress bar, loggers and callbacks see the true loss on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._protocols import PipelineLossScaling
from lightning_hybrid.contract import contract_batch
from lightning_hybrid.strategies._layout import Layout, last_stage_rank
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss
from lightning_hybrid.strategies.pipeline.failures import PipelineFailures
from lightning_hybrid.strategies.pipeline.split import build_schedule
from lightning_hybrid.strategies.tensor.local import plain_loss

__all__ = ["PipelineRunner", "pipeline_loss_scaling"]


class PipelineRunner:
    """One rank's view of the pipeline: its stages, the schedule, and the hand-over around ``zero_grad``.

    Args:
        module: the (already cut) LightningModule: ``pipeline_loss`` and optional ``pipeline_batch``.
        layout: the job's layout.
        stage_ids, stage_modules: this rank's stages, in schedule order.
        device, group: where the stages run and the pipeline's process group.
        loss_scaling: the precision plugin's per-micro-batch loss scaling (fp16), or ``None``.
        counted: the module's loss is a mean over ``pipeline_loss_count(target)`` elements: micro-batches are
            weighted by their count (see ``counted_loss``), or ``None`` (plain means, equal weights).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: Layout,
        stage_ids: list[int],
        stage_modules: list[nn.Module],
        device: torch.device,
        group: dist.ProcessGroup,
        loss_scaling: PipelineLossScaling | None,
        counted: CountedLoss | None = None,
    ) -> None:
        self.module, self.layout, self.device, self.group = module, layout, device, group
        self.counted = counted
        self.inferring = False  # the stages are inferring shapes: nothing they run is a micro-batch
        self._saved_buffers: list[tuple[Tensor, Tensor]] | None = None
        self.last_count = 0.0  # elements of the last batch, over every replica (counted losses)
        self._parts: list[tuple[Tensor, Tensor]] = []  # (mean, count) of each micro-batch on the last stage
        self.stage_ids, self.stage_modules = stage_ids, stage_modules
        self.loss_scaling = loss_scaling
        self.holds_last_stage = (layout.num_stages - 1) in stage_ids
        self.schedule, self.stages = build_schedule(
            layout=layout,
            stage_ids=stage_ids,
            stage_modules=stage_modules,
            device=device,
            group=group,
            loss_fn=self._loss,
            inference=(self._inference_begins, self._inference_ends),
        )
        self._pending: list[Tensor | None] | None = None
        self._divisor = 1  # micro-batches x accumulation count of the step being run
        self.failures = PipelineFailures(stages=stage_ids)  # a failure on some stages, raised on every rank

    def parameters(self) -> list[nn.Parameter]:
        return [p for stage in self.stage_modules for p in stage.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------ step

    def _inference_begins(self) -> None:
        """The stages infer their shapes by running on a copy of the first micro-batch or on uninitialised
        tensors: their buffers (BatchNorm's running statistics) are put back afterwards, and the loss function
        and the gradient hooks know that what runs is no micro-batch."""
        if self._saved_buffers is None:
            self._saved_buffers = [(b, b.clone()) for m in self.stage_modules for b in m.buffers()]
        self.inferring = True

    @torch.no_grad()
    def _inference_ends(self) -> None:
        self.inferring = False
        for b, saved in self._saved_buffers or []:
            b.copy_(saved)
        self._saved_buffers = None

    def _loss(self, output: Any, target: Tensor) -> Tensor:
        if self.inferring:  # shapes only: the user's loss never sees the placeholder tensors
            return _zero_from(output)
        if self.counted is not None:
            n = self.counted.count(target)
            if n == 0:  # nothing counted in this micro-batch (all padding): it adds nothing, and no 0/0
                return _zero_from(output)
        mean = plain_loss(self.module.pipeline_loss(output, target))  # a vocabulary-parallel loss: a DTensor
        if self.counted is not None:
            self._parts.append((mean.detach().double(), torch.tensor(n, dtype=torch.float64, device=mean.device)))
            loss = mean * self.counted.weight(n)  # the window's correction replaces the division
        else:
            loss = mean / self._divisor
        return self.loss_scaling.scale_pipeline_loss(loss) if self.loss_scaling is not None else loss

    def split_batch(self, batch: Any) -> tuple[Any, Tensor]:
        inputs, target = contract_batch(self.module, batch)
        size = inputs.shape[0] if isinstance(inputs, Tensor) else inputs[0].shape[0]
        m = self.layout.num_microbatches
        if size % m:
            raise ValueError(
                f"The per-replica batch size ({size}) must be divisible by num_microbatches ({m}): pipeline"
                " micro-batches must be equal. Change the DataLoader's batch_size, num_microbatches, or use"
                " drop_last=True."
            )
        return inputs, target

    def run(self, batch: Any, *, train: bool, accumulation: int = 1) -> tuple[Tensor, Any, Tensor]:
        """One pipelined step: (mean loss on every rank, the last stage's output or None, target)."""
        inputs, target = self.split_batch(batch)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        losses: list[Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        self._divisor = self.layout.num_microbatches * accumulation
        if self.counted is not None and self.counted.reference is None:
            # every rank holds the batch: the typical count of one micro-batch, agreed once
            units = dist.get_world_size() * self.layout.num_microbatches
            self.counted.agree_reference(self.counted.count(target), units, group=None)
        self._parts = []
        self.failures.watch()
        try:
            output = run(*args, target=target, losses=losses)
        except Exception as exc:
            raise self.failures.failed(exc) from exc
        finally:
            divisor, self._divisor = self._divisor, 1
        if self.counted is not None:
            return self._counted_mean(), output if self.holds_last_stage else None, target
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.holds_last_stage and losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
            if self.loss_scaling is not None:
                loss = self.loss_scaling.unscale_pipeline_loss(loss)
            loss = loss * divisor  # the micro-batches' mean of the losses themselves
        try:
            dist.all_reduce(loss)  # one value per replica's last stage (x its tensor-parallel ranks): the mean
        except Exception as exc:  # a stage of another replica failed
            raise self.failures.failed(exc) from exc
        loss = loss / (self.layout.data_parallel_size * self.layout.tensor_parallel_size)
        return loss, output if self.holds_last_stage else None, target

    def _counted_mean(self) -> Tensor:
        """The batch's mean over its counted elements on every rank (one all-reduce of the last stages' sums
        and counts); keeps the batch's count over every replica in ``last_count``."""
        both = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.holds_last_stage and self._parts:
            means, counts = zip(*self._parts)
            both[0] = (torch.stack(means) * torch.stack(counts)).sum()
            both[1] = torch.stack(counts).sum()
        dist.all_reduce(both)
        self._parts = []
        self.last_count = float(both[1]) / self.layout.tensor_parallel_size  # tensor-parallel ranks count alike
        return (both[0] / both[1].clamp_min(1.0)).float()

    def train_step(self, batch: Any, *, accumulation: int, set_aside: bool) -> Tensor:
        """Run forward and backward of a step (its loss divided by ``accumulation``, as Lightning divides).

        With ``set_aside`` the new gradients wait in the runner until :meth:`backward`, out of reach of
        Lightning's ``zero_grad``; otherwise they accumulate into ``.grad`` in place."""
        if not set_aside:
            return self.run(batch, train=True, accumulation=accumulation)[0]
        params = self.parameters()
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self.run(batch, train=True, accumulation=accumulation)[0]
        self._pending = [p.grad for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        return loss

    @torch.no_grad()
    def backward(self) -> None:
        """Add the step's gradients set aside by :meth:`train_step` to ``.grad``."""
        if self._pending is None:
            return  # they accumulated in place
        for p, new in zip(self.parameters(), self._pending):
            if new is not None:
                p.grad = new if p.grad is None else p.grad + new
        self._pending = None

    def reset(self) -> None:
        self._pending = None
        self.failures.close()
        self.failures = PipelineFailures(stages=self.stage_ids)

    # ------------------------------------------------------------------------------------ evaluation

    def last_stage_output_everywhere(self, output: Any) -> Tensor:
        """The last stage's output on every pipeline rank (metrics update, and sync, everywhere)."""
        if isinstance(output, DTensor):  # logits split by vocabulary: gathered on the last stage's ranks first
            output = output.full_tensor()
        obj = [None if output is None else output.detach().cpu()]
        dist.broadcast_object_list(obj, group=self.group, group_src=last_stage_rank(self.layout))
        return obj[0].to(self.device)

    def eval_step(self, batch: Any, batch_idx: int, *, user_hook: Callable[..., Any] | None) -> tuple[Tensor, Any]:
        """Evaluate one batch: (mean loss, ``user_hook(output, target, batch_idx)`` when the module has it)."""
        loss, output, target = self.run(batch, train=False)
        if user_hook is None:
            return loss, None
        return loss, user_hook(self.last_stage_output_everywhere(output), target, batch_idx)

    def predict(self, batch: Any) -> Tensor:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        output = self.schedule.eval(inputs)
        return self.last_stage_output_everywhere(output if self.holds_last_stage else None)


def _zero_from(output: Any) -> Tensor:
    """A zero that backpropagates zeros into ``output`` (a tensor or a tuple of tensors)."""
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,)) if isinstance(t, Tensor)]
    return sum((t.float().sum() * 0.0 for t in tensors), torch.zeros((), device=tensors[0].device))


def pipeline_loss_scaling(plugin: Precision) -> PipelineLossScaling | None:
    """The plugin that scales each micro-batch loss of an fp16 pipeline (its skip decision must be one for all
    stages), or ``None`` when the precision does not scale losses. Raises for an fp16 plugin that cannot."""
    if plugin.precision not in ("16-mixed", "16"):
        return None
    if isinstance(plugin, PipelineLossScaling):
        return plugin
    raise ValueError(
        "fp16 loss scaling with a pipeline needs one skip decision for all stages and a plugin that scales each"
        f" micro-batch loss; {type(plugin).__name__} does neither. Use"
        " plugins=[lightning_hybrid.plugins.AdaptiveLossScalingPrecision(precision='16-mixed')] or"
        " precision='bf16-mixed'."
    )
