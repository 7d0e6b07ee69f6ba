"""HybridParallelStrategy: pipeline parallelism x ZeRO-1/2/3 inside each stage, as a Lightning Strategy.

The strategy only connects Lightning's hooks to the techniques, each in its own module. ``setup_environment``
builds the (pipeline, data) mesh; ``setup`` hands the module to ``_recipe.prepare_module``, which applies
the techniques once, in order: find tied parameters (``_tied``), cut this rank's pipeline stages
(``_pipeline``), read pretrained weights by slice (``_init_from``), shard for ZeRO-3 (``_fsdp``), build the
schedule and its runner (``_pipeline_runner``) and the gradient synchronisation of the ZeRO stage
(``_grad_sync``). Checkpoints are sharded folders any layout reads (``_state`` and
``lightning_hybrid.checkpoint``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree
from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid._lightning_compat import attach_device_mesh, init_processes, share_zero_grad, syncs_batchnorm
from lightning_hybrid._torch_compat import wait_for_gloo_at_exit
from lightning_hybrid.checkpoint._sharded import LAYOUT_KEY
from lightning_hybrid.checkpoint.pretrained import PretrainedWeights
from lightning_hybrid.contract import contract_batch
from lightning_hybrid.plugins._clipping import mesh_aware_precision
from lightning_hybrid.strategies._checks import agreed_setup, refuse_averaging
from lightning_hybrid.strategies._layout import (
    PRESETS,
    Layout,
    PipelineSplit,
    ScheduleName,
    ZeroConfig,
    check_choices,
    resolve_layout,
)
from lightning_hybrid.strategies._recipe import DP_AXIS, PP_AXIS, prepare_module
from lightning_hybrid.strategies._state import (
    ShardedCheckpointIO,
    align_added_groups,
    checkpoint_folder,
    load_sharded_checkpoint,
    model_state,
    optimizer_state,
)
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss, weighted
from lightning_hybrid.strategies.pipeline.runner import PipelineRunner
from lightning_hybrid.strategies.pipeline.tied import CheckpointNames
from lightning_hybrid.strategies.zero.buffers import ReplicaBuffers
from lightning_hybrid.strategies.zero.grad_sync import GradientSync, named_parameters

__all__ = ["HybridParallelStrategy"]

log = logging.getLogger(__name__)


class HybridParallelStrategy(ShardedCheckpointIO, ModelParallelStrategy):
    """Pipeline parallelism across ranks x ZeRO-1/2/3 sharding inside each stage's data-parallel group.

    The ranks form a ``(pipeline_parallel, data_parallel)`` device mesh with data-parallel ranks adjacent,
    so a data-parallel group stays inside a node. With ``pipeline_parallel_size > 1`` the LightningModule
    must follow the pipeline contract: its blocks, in order, in ``self.layers``; a
    ``pipeline_loss(output, target)`` returning the micro-batch mean; optionally ``pipeline_batch(batch) ->
    (inputs, target)``. With ``pipeline_parallel_size=1`` any LightningModule works (DDP-like or ZeRO).

    Args:
        pipeline_parallel_size: number of pipeline ranks; ``"auto"`` puts one pipeline rank on each node.
        data_parallel_size: ranks that replicate (or shard) each stage; ``"auto"`` takes the rest of the world.
        zero_stage: sharding inside each data-parallel group: 0 replicates, 1 shards optimizer state, 2 also
            gradients, 3 also parameters (FSDP2).
        schedule: the torch pipeline schedule.
        num_microbatches: micro-batches each per-replica batch is cut into (default: one per stage). The
            per-replica batch size must be divisible by it.
        stages_per_rank: virtual stages per rank for the interleaved/looped/V schedules (default 2).
        split: how the blocks are cut into stages (balanced by parameter count unless given).
        activation_checkpointing: recompute each block's activations in backward to save memory.
        zero: advanced ZeRO settings (ZeRO-2 gradient reduction, ZeRO-3 resharding); see :class:`ZeroConfig`.
        init_from: start from pretrained weights: a path (a ``torch.save`` state_dict, a ``.safetensors`` file,
            a folder of ``.safetensors`` shards, a sharded checkpoint of this pack) or a
            :class:`PretrainedWeights` with a key map. Each rank reads only the tensors (under ZeRO-3 the
            rows) it holds; keys that do not fit fail on every rank before step 0. A checkpoint resumed with
            ``ckpt_path`` overrides them.
        process_group_backend: ``"nccl"`` / ``"gloo"``; chosen from the device by default.
        timeout: collective timeout.

    Example::

        trainer = Trainer(
            strategy=HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=2, schedule="1f1b"),
            accelerator="gpu", devices=8, num_nodes=2,
        )
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, Literal["auto"]] = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        zero_stage: Literal[0, 1, 2, 3] = 0,
        schedule: ScheduleName = "1f1b",
        num_microbatches: Union[int, None] = None,
        stages_per_rank: Union[int, None] = None,
        split: Union[PipelineSplit, None] = None,
        activation_checkpointing: bool = False,
        zero: Union[ZeroConfig, None] = None,
        init_from: Union[str, os.PathLike, PretrainedWeights, None] = None,
        process_group_backend: Union[str, None] = None,
        timeout: Union[timedelta, None] = default_pg_timeout,
    ) -> None:
        # what can be checked without the world size fails here, on every rank, before any process group
        check_choices(schedule=schedule, zero_stage=zero_stage)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        prepare_elastic_restart()  # a torchrun-restarted worker needs a clean store for its process group
        self._pipeline_parallel_size = pipeline_parallel_size
        self._data_parallel_request = data_parallel_size
        self._zero_stage = zero_stage
        self._schedule_name = schedule
        self._num_microbatches = num_microbatches
        self._stages_per_rank = stages_per_rank
        self._split = split
        self._activation_checkpointing = activation_checkpointing
        if zero is not None and not isinstance(zero, ZeroConfig):
            raise ValueError(f"zero must be a ZeroConfig(...), got {zero!r}.")
        self._zero_config = zero or ZeroConfig()
        if init_from is not None and not isinstance(init_from, PretrainedWeights):
            init_from = PretrainedWeights(init_from)  # raises a ValueError naming what is wrong
        self._init_from: Union[PretrainedWeights, None] = init_from
        self._pretrained_bytes_read = 0
        self._layout: Union[Layout, None] = None
        self._mesh: Union[DeviceMesh, None] = None
        self._runner: Union[PipelineRunner, None] = None  # with a pipeline only
        self._sync: Union[GradientSync, None] = None
        self._prepared: dict[int, Optimizer] = {}  # optimizers whose step's gradients are ready (_prepare_step)
        self._counted: Union[CountedLoss, None] = None  # a loss averaged over pipeline_loss_count elements
        self._buffers: Union[ReplicaBuffers, None] = None  # running statistics kept as DDP keeps them
        self._training_started = False  # a checkpoint loaded after this is a roll-back, not a resume
        self._checkpoint_names = CheckpointNames()  # where checkpoints store tied parameters
        self._prepared_module: Union[nn.Module, None] = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, kwargs in PRESETS:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    # ------------------------------------------------------------------------------------------ layout

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the processes are initialised (setup_environment).")
        return self._layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The ``(pipeline_parallel, data_parallel)`` mesh, known once the processes are initialised."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is known once the processes are initialised (setup_environment).")
        return self._mesh

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        return self.device_mesh[PP_AXIS].get_group()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.device_mesh[DP_AXIS].get_group()

    @property
    def pipeline_rank(self) -> int:
        return self.device_mesh[PP_AXIS].get_local_rank()

    @property
    def data_parallel_rank(self) -> int:
        return self.device_mesh[DP_AXIS].get_local_rank()

    @property
    def is_pipelined(self) -> bool:
        return self._layout is not None and self._layout.pipeline_parallel_size > 1

    @property
    def pipeline_runner(self) -> Union[PipelineRunner, None]:
        """This rank's stages, schedule and their runner (``None`` without a pipeline)."""
        return self._runner

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (where outputs and the loss exist)."""
        return self._runner is None or self._runner.holds_last_stage

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every pipeline rank of one replica must see the same samples: split data over the dp axis only
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.data_parallel_rank}

    def gradient_layout(self) -> tuple[int, bool]:
        """(ranks holding each gradient element the optimizer steps with, whether every backward already
        averaged the gradients over the replicas); see :class:`GradientSync`."""
        sync = self._gradient_sync
        return sync.gradient_holders(), sync.averaged_every_backward

    def current_gradients(self, module: nn.Module) -> list[Tensor]:
        """This rank's part of the gradient accumulated so far in the window (see :class:`GradientSync`)."""
        return self._gradient_sync.current_gradients(module)

    def exact_window_means(self) -> bool:
        """Whether each step is the exact mean over its window's counted elements (``pipeline_loss_count``)."""
        return self._counted is not None

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint is written with (informational: any layout can load it)."""
        lay = self.layout
        return {
            "pipeline_parallel_size": lay.pipeline_parallel_size,
            "data_parallel_size": lay.data_parallel_size,
            "zero_stage": lay.zero_stage,
            "schedule": lay.schedule,
            "num_stages": lay.num_stages,
            "tied_parameters": self._checkpoint_names.to_json(),
        }

    @property
    def _gradient_sync(self) -> GradientSync:
        if self._sync is None:
            raise RuntimeError("The gradient synchronisation is chosen in setup().")
        return self._sync

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        init_processes(self)
        wait_for_gloo_at_exit()  # a finished job exits 0, also when gloo's workers are late (see the function)
        # same inputs on every rank -> the same verdict everywhere: bad sizes fail on all ranks, no hang
        self._layout = lay = resolve_layout(
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            pipeline_parallel_size=self._pipeline_parallel_size,
            data_parallel_size=self._data_parallel_request,
            zero_stage=self._zero_stage,
            schedule=self._schedule_name,
            stages_per_rank=self._stages_per_rank,
            num_microbatches=self._num_microbatches,
        )
        # row-major (pp, dp): data-parallel peers get adjacent global ranks, i.e. the same node
        self._mesh = init_device_mesh(
            self.root_device.type,
            (lay.pipeline_parallel_size, lay.data_parallel_size),
            mesh_dim_names=(PP_AXIS, DP_AXIS),
        )
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, self._mesh)
        pipeline = f", schedule={lay.schedule}, stages={lay.num_stages}, num_microbatches={lay.num_microbatches}"
        rank_zero_info(
            f"HybridParallelStrategy: pipeline_parallel_size={lay.pipeline_parallel_size},"
            f" data_parallel_size={lay.data_parallel_size}, zero_stage={lay.zero_stage}"
            + (pipeline if lay.pipeline_parallel_size > 1 else "")
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        # fit -> validate -> test reuse one Trainer and call setup() again: split and shard only once
        if self._prepared_module is not module:
            self._prepare(module)
            self._prepared_module = module
        self.barrier()
        if syncs_batchnorm(self):
            # Lightning's SyncBatchNorm would reduce over the whole world (stages included) and is never applied
            # by a strategy that does not wrap the module in DDP: refused instead of silently ignored
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not applied by HybridParallelStrategy; BatchNorm keeps Lightning"
                " DDP's default (batch statistics per replica, running statistics of the first replica). Remove"
                " it, or convert the layers yourself with torch.nn.SyncBatchNorm.convert_sync_batchnorm(module,"
                " process_group=<the data-parallel group>) in configure_model (GPU only in torch 2.13)."
            )
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_averaging(trainer, self.layout)
            if self._runner is not None and not module.automatic_optimization:
                raise ValueError(
                    f"{type(module).__name__} uses manual optimization; under a pipeline the strategy runs the"
                    " schedule (forward and backward of every micro-batch) in place of training_step, so the"
                    " training_step's own backward and optimizer calls would never run. Use automatic"
                    " optimization, or pipeline_parallel_size=1."
                )
            # configure_optimizers sees this rank's stage only: a failure on one stage fails every rank
            agreed_setup("configure_optimizers", lambda: self.setup_optimizers(trainer), device=self.root_device)
            if self._counted is not None and (not module.automatic_optimization or len(self.optimizers) > 1):
                raise ValueError(
                    f"{type(module).__name__} defines pipeline_loss_count: the strategy weighs each batch's loss by"
                    " its count and corrects the window's gradient before the step, which needs automatic"
                    " optimization with one optimizer. Remove pipeline_loss_count (and normalise the loss"
                    " yourself), or use one optimizer with automatic_optimization=True."
                )
            self._gradient_sync.attach([self._unwrap(o) for o in self.optimizers], named_parameters(module))
            share_zero_grad(self._lightning_optimizers)
        self._connect_precision()
        self.setup_precision_plugin()
        self._training_started = False

    @property
    def optimizers(self) -> list[Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        # Lightning wraps the optimizers again whenever they are set (the precision plugin's connect does):
        # each new wrapper gets the ZeRO-1/2 zero_grad of its optimizer (what self.optimizers() is under manual
        # optimization; Lightning's wrapper would otherwise call the optimizer class's own zero_grad)
        ModelParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        share_zero_grad(self._lightning_optimizers)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._training_started = True

    def _prepare(self, module: pl.LightningModule) -> None:
        """The recipe (``_recipe.prepare_module``), once per module."""
        prepared = prepare_module(
            module,
            layout=self.layout,
            mesh=self.device_mesh,
            device=self.root_device,
            precision_plugin=self.precision_plugin,
            zero=self._zero_config,
            split=self._split,
            activation_checkpointing=self._activation_checkpointing,
            init_from=self._init_from,
            agreed_seed=lambda: self.broadcast(int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))),
        )
        self.model = prepared.module
        self._runner, self._sync = prepared.runner, prepared.sync
        self._counted = prepared.counted
        self._buffers = ReplicaBuffers(prepared.module, self.data_parallel_group)
        self._checkpoint_names = prepared.checkpoint_names
        self._pretrained_bytes_read = prepared.pretrained_bytes_read

    @property
    def pretrained_bytes_read(self) -> int:
        """Bytes this rank read from ``init_from`` (its stages' tensors; under ZeRO-3 its rows); 0 without."""
        return self._pretrained_bytes_read

    def _connect_precision(self) -> None:
        scaler = self.precision_plugin.scaler if type(self.precision_plugin) is MixedPrecision else None
        if scaler is not None and self.layout.zero_stage >= 1 and self.layout.data_parallel_size > 1:
            # torch's GradScaler finds overflow in this rank's shard only: ranks would skip different steps
            raise ValueError(
                f"precision='16-mixed' uses torch's GradScaler, which looks for overflow in this rank's shard only;"
                f" under zero_stage={self.layout.zero_stage} the ranks would skip different steps and scale"
                " differently. Use plugins=[lightning_hybrid.plugins.AdaptiveLossScalingPrecision(precision="
                "'16-mixed')], whose skip decision is agreed, or precision='bf16-mixed'."
            )
        plugin = mesh_aware_precision(self.precision_plugin, self._gradient_sync.grad_norm, self._prepare_for_clip)
        if plugin is None:
            if self.layout.world_size > 1:
                rank_zero_info(
                    f"{type(self.precision_plugin).__name__} clips gradients by the local norm; with a pipeline or"
                    " ZeRO shards that norm is partial."
                )
            return
        self.precision_plugin = plugin

    @staticmethod
    def _unwrap(optimizer: Union[Optimizer, LightningOptimizer]) -> Optimizer:
        return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

    # ----------------------------------------------------------------------------------------- training

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            output = super().training_step(*args, **kwargs)
            self._refuse_skip_on_some_ranks(output)
            return output if self._counted is None else self._weigh_by_count(output, args[0])
        module = self.lightning_module
        assert module is not None
        sync = self._gradient_sync
        # the schedule runs forward AND backward here; gradients Lightning's zero_grad could reach wait in the
        # runner until backward()
        sync.hold_gradients(False)
        with self.precision_plugin.train_step_context():
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

    def _refuse_skip_on_some_ranks(self, output: Any) -> None:
        """A training_step that returned no loss (Lightning skips its backward) on some replicas only: under
        ZeRO-3 the others would wait forever in FSDP2's reduce-scatter, which every replica's backward takes
        part in. One flag agreed per micro-batch, under ZeRO-3 at dp>1 only (ZeRO-0/1/2 reduce when the window
        closes, on every rank: a replica that skipped contributes no gradient, as a loss of zero would)."""
        module = self.lightning_module
        if self.layout.zero_stage != 3 or self.layout.data_parallel_size == 1 or module is None:
            return
        if not module.automatic_optimization:
            return
        loss = output.get("loss") if isinstance(output, dict) else output
        skipped = 0.0 if isinstance(loss, Tensor) else 1.0
        most, least = agree([skipped, -skipped], op="max", device=self.root_device, group=self.data_parallel_group)
        if most != -least:
            raise RuntimeError(
                "training_step returned no loss on some data-parallel replicas only; under zero_stage=3 each"
                " replica's backward takes part in FSDP2's reduce-scatter, so the others would wait in it forever."
                " Skip a batch on every replica alike (decide it from an all-reduced flag), or return a loss of"
                " zero (`loss * 0`) on the replicas that have nothing to learn from it."
            )

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
        if self._runner is None:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            self._gradient_sync.after_backward()
        else:
            self._gradient_sync.hold_gradients(False)
            self._runner.backward()  # the schedule ran backward in training_step
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

        def closure_then_reduce() -> Any:
            out = closure()
            self._prepare_step(optimizer)
            return out

        try:
            result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
            sync.after_step(optimizer)
        finally:
            sync.end_step(optimizer)
            self._prepared.pop(id(optimizer), None)
        if self._buffers is not None:
            self._buffers.broadcast()
        return result

    def _prepare_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """The window's last backward ran: groups added since the last step join (ZeRO-1/2 flatten them), the
        gradients are reduced, and from here to the end of the step ZeRO-1/2's param groups hold the chunks
        this rank steps (what the precision plugin unscales and clips). Once per step: inside the closure,
        or earlier when manual optimization clips its gradients before ``optimizer.step()``."""
        optimizer = self._unwrap(optimizer)
        if id(optimizer) in self._prepared:
            return
        sync = self._gradient_sync
        if self.layout.pipeline_parallel_size > 1:  # a group added on some stages only: empty on the others
            align_added_groups(optimizer, device=self.root_device)
        sync.adopt_param_groups(optimizer)
        sync.reduce(optimizer, scale=self._window_correction())
        sync.begin_step(optimizer)
        self._prepared[id(optimizer)] = optimizer

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

    def _window_correction(self) -> Union[float, None]:
        """A counted loss: the factor that turns the replicas' mean gradient into the window's exact mean."""
        if self._counted is None:
            return None
        if self._runner is not None:  # the pipeline's loss all-reduce already counted every replica
            window, self._counted.window = self._counted.window, 0.0
        else:
            window = self._counted.global_window(self.data_parallel_group)
        return self._counted.factor(self.layout.data_parallel_size, window=window)

    # --------------------------------------------------------------------------------------- evaluation

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
        if self._runner is None:
            return super().validation_step(*args, **kwargs)
        return self._pipelined_eval_step("validation_step", "val_loss", args[0], _batch_idx(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            return super().test_step(*args, **kwargs)
        return self._pipelined_eval_step("test_step", "test_loss", args[0], _batch_idx(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            return self._runner.predict(args[0])  # the last stage's outputs, on every pipeline rank

    # -------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return model_state(self.lightning_module, self._gradient_sync, self._checkpoint_names)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return optimizer_state(
            self.lightning_module, self._unwrap(optimizer), self._gradient_sync, self._checkpoint_names
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, os.PathLike], weights_only: Union[bool, None] = None
    ) -> dict[str, Any]:
        # payloads are read with weights_only=True whatever `weights_only` says: a checkpoint never runs code
        path = checkpoint_folder(self, checkpoint_path)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [self._unwrap(o) for o in self.optimizers] if fitting else []
        meta = load_sharded_checkpoint(
            path,
            module,
            optimizers,
            self._gradient_sync,
            self._checkpoint_names,
            strict=module.strict_loading,
            device=self.root_device,
            # param groups added during the checkpoint's run come back (a resume, not a roll-back inside a run)
            restore_groups=not self._training_started,
        )
        written = meta.get(LAYOUT_KEY)
        if written:
            rank_zero_info(f"Resumed from {path} (written with {written}) onto {self.layout}")
        return meta

    @override
    def teardown(self) -> None:
        # the split module and its schedule stay: a later validate()/test() on this Trainer reuses them
        if self._runner is not None:
            self._runner.reset()
        super().teardown()


def _batch_idx(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
