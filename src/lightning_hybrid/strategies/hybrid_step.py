"""One training step of HybridParallelStrategy: Lightning's step hooks over the pipeline and the gradient sync.

training_step runs the pipeline schedule (or Lightning's own step without a pipeline), weighs counted
losses, and refuses a step some replicas skip where that would hang; backward hands the schedule's
gradients back; the step is prepared once (groups added on some stages aligned, groups adopted, gradients
reduced with the window's correction) before clipping or the optimizer needs it, and optimizer_step
closes it. Validation, test and predict run the schedule's forward on every stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._lightning_compat import skips_backward
from lightning_hybrid.contract import contract_batch
from lightning_hybrid.strategies._state import (
    align_added_groups,
)
from lightning_hybrid.strategies.pipeline.counted_loss import weighted
from lightning_hybrid.strategies.tensor.local import loss_context, plain_loss
from lightning_hybrid.strategies.tensor.plan import UnevenSequence


class HybridStep:
    """HybridParallelStrategy's step hooks (uses its layout, runner and gradient sync)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            self._settle_skips()  # a previous micro-batch's agreement that no backward settled
            with loss_context(self.layout.tensor_parallel_size), self._sequences_agreed():
                output = plain_loss(super().training_step(*args, **kwargs))
            self._agree_on_skips(output)
            return output if self._counted is None else self._weigh_by_count(output, args[0])
        module = self.lightning_module
        assert module is not None
        sync = self._gradient_sync
        # the schedule runs forward AND backward here; gradients Lightning's zero_grad could reach wait in the
        # runner until backward()
        sync.hold_gradients(False)
        sync.before_backward()
        with self.precision_plugin.train_step_context(), loss_context(self.layout.tensor_parallel_size):
            loss = self._runner.train_step(
                args[0],
                accumulation=module.trainer.accumulate_grad_batches,
                set_aside=sync.optimizer_holds_model_parameters,
            )
        sync.after_backward()
        sync.hold_gradients(True)  # until backward(): Lightning's zero_grad must not discard them
        if self._counted is not None:
            self._counted.window += self._runner.last_count  # over every replica already
        module.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    @contextmanager
    def _sequences_agreed(self) -> Iterator[None]:
        """Sequence parallelism at dp>1: the step's sequence-length checks agree over the replicas (which ones:
        see ``SequenceCheck``); a step in which none did agrees at its end."""
        check, size = self._sequences, self.layout.tensor_parallel_size
        if check is None:
            yield
            return
        check.arm(self._flag_group)
        try:
            yield
        except UnevenSequence as problem:
            check.settle(problem, size)
            raise
        except BaseException:
            check.disarm()
            raise
        check.settle(None, size)

    def _agree_on_skips(self, output: Any) -> None:
        """A training_step that returned no loss (Lightning skips its backward) on some replicas only: the others'
        backward starts collectives the skipping replica never joins (the bucket reductions of ZeRO-0/1/2,
        FSDP2's under ZeRO-3), so they would wait forever or pair the wrong messages. It is refused on every rank
        by one flag per micro-batch at dp>1, all-reduced asynchronously on the host (a gloo group of the
        data-parallel peers, also on GPUs, so no device sync): a skipping replica waits for it at once, a
        replica with a loss once its backward has ended, so the agreement adds no point where the replicas wait
        for each other (a synchronous flag after the forward of every micro-batch cost ZeRO-0 about 4% of its
        step with 4 micro-batches on 2 CPU processes). A skipping replica that learns the others did not skip
        first joins the reductions their backward starts, as a backward that produced no gradient would (ZeRO-0/
        1/2 start every bucket by a backward's end, in one order); then every rank raises the same message.
        Every replica waits at once, before any backward, where that backward communicates in ways a skipping
        replica cannot join: ZeRO-3 (FSDP2 gathers parameters), ``nn.SyncBatchNorm`` modules, an
        ``all_gather(..., sync_grads=True)`` in this training_step, a counted loss's first batch (its count is
        agreed next), and no backward at all (``StochasticWeightAveraging``'s BatchNorm epoch). What this cannot
        see, a collective of the model's own between training_step and the end of backward (an expert layer's
        all-to-all, ``torch.distributed.nn`` functions, a synced ``self.log`` in ``on_before_backward``), hangs
        there as under Lightning's DDP."""
        module = self.lightning_module
        if self.layout.data_parallel_size == 1 or module is None or not module.automatic_optimization:
            return
        loss = output.get("loss") if isinstance(output, dict) else output
        skipped = not isinstance(loss, Tensor)
        at_once = (
            self.layout.zero_stage == 3
            or (self._counted is not None and self._counted.reference is None)
            or self._gathered_with_gradients
            or self._sync_batchnorm
            or skips_backward(module.trainer)
        )
        self._gathered_with_gradients = False
        flags = torch.tensor([float(skipped), -float(skipped)], dtype=torch.float64)  # on the host, over gloo
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._flag_group, async_op=True)
        self._skips = (work, flags, skipped and not at_once)
        if skipped or at_once:
            self._settle_skips()

    def _settle_skips(self) -> None:
        """Wait for the pending skip agreement, if any; raise on every rank when only some replicas skipped."""
        if self._skips is None:
            return
        (work, flags, join), self._skips = self._skips, None
        work.wait()
        most, least = flags.tolist()
        if most == -least:
            return
        if join:
            self._gradient_sync.after_backward()  # the reductions the others' backward starts, with nothing
        raise RuntimeError(
            "training_step returned no loss on some data-parallel replicas only; each replica's backward takes"
            f" part in the gradient reductions (zero_stage={self.layout.zero_stage}), so the others would wait in"
            " them forever. Skip a batch on every replica alike (decide it from an all-reduced flag), or return a"
            " loss of zero (`loss * 0`) on the replicas that have nothing to learn from it."
        )

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        # with gradients its backward communicates too (see _agree_on_skips); over the world only, so that every
        # data-parallel peer counts the same gathers
        if sync_grads and group in (None, dist.group.WORLD):
            self._gathered_with_gradients = True
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _weigh_by_count(self, output: Any, batch: Any) -> Any:
        """No pipeline, a counted loss: the rank's mean stays the value (as under DDP); backward sees it weighted
        by the batch's count (Lightning's division by the accumulation undone), corrected when the window closes."""
        counted, module = self._counted, self.lightning_module
        assert counted is not None and module is not None
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):  # training_step returned nothing to step with (Lightning skips it)
            return output
        n = counted.count(contract_batch(module, batch)[1])
        counted.agree_reference(n, self.layout.data_parallel_size, group=self.data_parallel_group)
        counted.window += n
        if n == 0:
            # nothing counted on this rank (all padding): its mean is 0/0; it adds nothing to the window and
            # reports 0. The zero backpropagates zeros to one parameter, so Lightning's backward still runs
            anchor = next(p for p in module.parameters() if p.requires_grad)
            loss = (anchor.to_local() if isinstance(anchor, DTensor) else anchor).sum() * 0.0
        else:
            loss = weighted(loss, counted.weight(n) * module.trainer.accumulate_grad_batches)
        return {**output, "loss": loss} if isinstance(output, dict) else loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Union[Optimizer, None], *args: Any, **kwargs: Any) -> Tensor:
        # Strategy.backward's steps, with the pipeline's hand-over in place of autograd, and the ZeRO-2 hand-off
        # of what backward's hooks did not reduce before on_after_backward sees the gradients
        module = self.lightning_module
        assert module is not None
        self._unprepare()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        sync = self._gradient_sync
        if self._runner is None:
            sync.before_backward()
            with loss_context(self.layout.tensor_parallel_size):  # the backward of a vocabulary-parallel loss
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            sync.after_backward()
            self._settle_skips()  # the reductions are done: the agreement arrived long ago
        else:
            sync.hold_gradients(False)
            self._runner.backward()  # the schedule ran backward in training_step
        sync.average_outside()
        # user code reads the gradients next (on_after_backward, manual optimization): reduced now, so that it
        # sees the replicas' mean, as under DDP; what it changes is settled before the step
        if sync.user.manual or (self._window_closing and sync.user.after_backward):
            optimizers = (
                [self._unwrap(optimizer)] if optimizer is not None else [self._unwrap(o) for o in self.optimizers]
            )
            for opt in optimizers:
                self._reduce_window(opt)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Union[Optimizer, LightningOptimizer],
        closure: Callable[[], Any],
        model: Union[pl.LightningModule, nn.Module, None] = None,
        **kwargs: Any,
    ) -> Any:
        optimizer, sync = self._unwrap(optimizer), self._gradient_sync

        module = self.lightning_module
        # automatic optimization: the closure's backward closes the window, ZeRO-0/1 reduce during it (manual
        # optimization's backward passes are the user's: the step reduces)
        closes = module is not None and module.automatic_optimization

        def closure_then_reduce() -> Any:
            sync.window_closes(closes)
            self._window_closing = closes
            try:
                out = closure()
            finally:
                sync.window_closes(False)
                self._window_closing = False
            self._prepare_step(optimizer)
            return out

        try:
            result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
            sync.after_step(optimizer)
        finally:
            sync.end_step(optimizer)
            self._prepared.pop(id(optimizer), None)
            self._reduced.discard(id(optimizer))
        if self._buffers is not None:
            self._buffers.broadcast()
        if self._whole_on_peers is not None:  # tensor-parallel peers' whole parameters still equal
            self._whole_on_peers.after_step()
        return result

    def _prepare_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """The window's last backward ran: groups added since the last step join (ZeRO-1/2 flatten them), the
        gradients are reduced, and from here to the end of the step ZeRO-1/2's param groups hold the chunks
        this rank steps (what the precision plugin unscales and clips). Once per step: inside the closure,
        or earlier when manual optimization clips its gradients before ``optimizer.step()``."""
        optimizer = self._unwrap(optimizer)
        if id(optimizer) in self._prepared:
            return
        if id(optimizer) in self._reduced:
            self._gradient_sync.settle(optimizer)  # what user code changed since the reduction
        else:
            self._reduce_window(optimizer)
        self._gradient_sync.begin_step(optimizer)
        self._prepared[id(optimizer)] = optimizer

    def _reduce_window(self, optimizer: Optimizer) -> None:
        """Groups added on some stages aligned, added groups adopted, the window's gradients reduced (with a
        counted loss's correction)."""
        sync = self._gradient_sync
        if self.layout.pipeline_parallel_size > 1:  # a group added on some stages only: empty on the others
            align_added_groups(optimizer, device=self.root_device)
        sync.adopt_param_groups(optimizer, reduce_follows=True)
        sync.reduce(optimizer, scale=self._window_correction())
        self._reduced.add(id(optimizer))

    def _prepare_for_clip(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """Manual optimization clips before ``optimizer.step()``: the step's gradients are made ready first.
        Automatic optimization clips inside the step, after its closure made them ready (a clip called from
        another hook keeps Lightning's meaning: the gradients as they are)."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            self._prepare_step(optimizer)

    def _unprepare(self) -> None:
        """A backward after the step's gradients were made ready (LBFGS evaluates its closure again; a manual
        loop clipped and then ran another backward): they are made ready again when next needed."""
        for optimizer in self._prepared.values():
            self._gradient_sync.end_step(optimizer)
        self._prepared.clear()
        self._reduced.clear()

    def _window_correction(self) -> Union[float, None]:
        """A counted loss: the factor that turns the replicas' mean gradient into the window's exact mean."""
        if self._counted is None:
            return None
        if self._runner is not None:  # the pipeline's loss all-reduce already counted every replica
            window, self._counted.window = self._counted.window, 0.0
        else:
            window = self._counted.global_window(self.data_parallel_group)
        return self._counted.factor(self.layout.data_parallel_size, window=window)

    def _pipelined_eval_step(self, hook: str, metric: str, batch: Any, batch_idx: int) -> Any:
        assert self._runner is not None and self.lightning_module is not None
        user_hook = getattr(self.lightning_module, f"pipeline_{hook}", None)  # optional in the contract
        with self.precision_plugin.val_step_context():
            loss, result = self._runner.eval_step(
                batch, batch_idx, user_hook=user_hook if callable(user_hook) else None
            )
        if result is None:
            self.lightning_module.log(metric, loss, prog_bar=True, sync_dist=False)
            return loss
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with loss_context(self.layout.tensor_parallel_size):
            if self._runner is None:
                return plain_loss(super().validation_step(*args, **kwargs))
            return self._pipelined_eval_step("validation_step", "val_loss", args[0], _batch_idx(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with loss_context(self.layout.tensor_parallel_size):
            if self._runner is None:
                return plain_loss(super().test_step(*args, **kwargs))
            return self._pipelined_eval_step("test_step", "test_loss", args[0], _batch_idx(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._runner.predict(args[0])  # the last stage's outputs, on every pipeline rank


def _batch_idx(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
