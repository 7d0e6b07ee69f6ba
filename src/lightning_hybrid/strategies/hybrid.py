"""HybridParallelStrategy: pipeline parallelism x ZeRO-1/2/3 inside each stage, as a Lightning Strategy.

The strategy only connects Lightning's hooks to the techniques, each in its own module. ``setup_environment``
resolves the layout and builds its mesh (``_layout``); ``setup`` hands the module to
``_recipe.prepare_module``, which applies the techniques once, in order: find tied parameters
(``contract``, ``pipeline/tied``), cut this rank's pipeline stages (``pipeline/split``), read pretrained
weights by slice (``checkpoint/pretrained``), shard for ZeRO-3 (``zero/fully_sharded``), build the schedule
and its runner (``pipeline/runner``) and the gradient synchronisation of the ZeRO stage (``zero/stages``).
The step hooks are in ``hybrid_step``, the checkpoint hooks in ``hybrid_checkpoint``; checkpoints are
sharded folders any layout reads (``_state`` and ``lightning_hybrid.checkpoint``)."""

from __future__ import annotations

import logging
import os
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
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid._lightning_compat import (
    attach_device_mesh,
    init_processes,
    lightning_optimizers,
    share_zero_grad,
    syncs_batchnorm,
)
from lightning_hybrid._torch_compat import note_failed_fit, wait_for_gloo_at_exit
from lightning_hybrid.checkpoint.pretrained import PretrainedWeights, as_pretrained_weights
from lightning_hybrid.checkpoint.tied_names import CheckpointNames
from lightning_hybrid.plugins._clipping import mesh_aware_precision
from lightning_hybrid.strategies._checks import agreed_setup, refuse_averaging
from lightning_hybrid.strategies._layout import DP_AXIS, PP_AXIS, PRESETS, TP_AXIS, Layout, LayoutRequest, ScheduleName
from lightning_hybrid.strategies._parallel import ParallelLayout, known
from lightning_hybrid.strategies._recipe import prepare_module
from lightning_hybrid.strategies._state import (
    ShardedCheckpointIO,
)
from lightning_hybrid.strategies._user_code import user_gradient_code
from lightning_hybrid.strategies.hybrid_checkpoint import HybridCheckpoints
from lightning_hybrid.strategies.hybrid_step import HybridStep
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss
from lightning_hybrid.strategies.pipeline.partition import PipelineSplit
from lightning_hybrid.strategies.pipeline.runner import PipelineRunner
from lightning_hybrid.strategies.tensor.check import PlanCheck
from lightning_hybrid.strategies.tensor.local import same_random_streams, whole_on_every_rank
from lightning_hybrid.strategies.tensor.peers import WholeOnPeers
from lightning_hybrid.strategies.tensor.plan import SequenceCheck
from lightning_hybrid.strategies.zero.buffers import ReplicaBuffers
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.grad_sync import GradientSync, named_parameters

__all__ = ["HybridParallelStrategy"]

log = logging.getLogger(__name__)


class HybridParallelStrategy(ParallelLayout, HybridCheckpoints, HybridStep, ShardedCheckpointIO, ModelParallelStrategy):
    """Pipeline parallelism across ranks x ZeRO-1/2/3 sharding inside each stage's data-parallel group.

    The ranks form a ``(pipeline_parallel, data_parallel[, tensor_parallel])`` device mesh, innermost ranks
    adjacent, so tensor- and data-parallel groups stay inside a node. With ``pipeline_parallel_size > 1`` the
    LightningModule must follow the pipeline contract: its blocks, in order, in ``self.layers``; a
    ``pipeline_loss(output, target)`` returning the micro-batch mean; optionally ``pipeline_batch(batch) ->
    (inputs, target)``. With ``pipeline_parallel_size=1`` any LightningModule works (DDP-like or ZeRO).

    Args:
        pipeline_parallel_size: number of pipeline ranks; ``"auto"`` puts one pipeline rank on each node.
        data_parallel_size: ranks that replicate (or shard) each stage; ``"auto"`` (or ``None``) takes the rest
            of the world.
        tensor_parallel_size: ranks that split each block's matrices (the innermost mesh dimension, so keep it
            within a node); the module says how with ``tensor_parallel_plan(name, block)``.
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
    reads_pretrained_weights = True  # a module's ``pretrained_weights`` is its init_from when none is given
    materializes_meta_blocks = True  # a meta-built module: each rank materialises its own blocks only
    engine_label = "torch"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, Literal["auto"]] = 1,
        data_parallel_size: Union[int, Literal["auto"], None] = "auto",
        tensor_parallel_size: int = 1,
        zero_stage: Literal[0, 1, 2, 3] = 0,
        schedule: ScheduleName = "1f1b",
        num_microbatches: Union[int, None] = None,
        stages_per_rank: Union[int, None] = None,
        split: Union[PipelineSplit, None] = None,
        activation_checkpointing: bool = False,
        zero: Union[ZeroConfig, None] = None,
        # PretrainedWeights first and a dict beside it: LightningCLI's parser then builds the object from YAML
        init_from: Union[PretrainedWeights, dict[str, Any], str, os.PathLike, None] = None,
        process_group_backend: Union[str, None] = None,
        timeout: Union[timedelta, None] = default_pg_timeout,
    ) -> None:
        # what can be checked without the world size fails here, on every rank, before any process group
        self._request = LayoutRequest(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stage=zero_stage,
            schedule=schedule,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            tensor_parallel_size=tensor_parallel_size,
        )
        super().__init__(
            data_parallel_size=self._request.data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        prepare_elastic_restart()  # a torchrun-restarted worker needs a clean store for its process group
        self._split = split
        self._activation_checkpointing = activation_checkpointing
        if zero is not None and not isinstance(zero, ZeroConfig):
            raise ValueError(f"zero must be a ZeroConfig(...), got {zero!r}.")
        self._zero_config = zero or ZeroConfig()
        init_from = as_pretrained_weights(init_from)  # raises a ValueError naming what is wrong
        self._init_from: Union[PretrainedWeights, None] = init_from
        self._pretrained_bytes_read = 0
        self._layout: Union[Layout, None] = None
        self._mesh: Union[DeviceMesh, None] = None
        self._runner: Union[PipelineRunner, None] = None  # with a pipeline only
        self._sync: Union[GradientSync, None] = None
        self._prepared: dict[int, Optimizer] = {}  # optimizers whose step's gradients are ready (_prepare_step)
        self._reduced: set[int] = set()  # optimizers whose window was reduced at a backward's end (_reduce_window)
        self._window_closing = False  # the backward that runs closes the accumulation window
        self._counted: Union[CountedLoss, None] = None  # a loss averaged over pipeline_loss_count elements
        self._skips: Union[tuple[Any, Tensor, bool], None] = None  # a micro-batch's skip agreement, pending
        self._gathered_with_gradients = False  # this training_step called all_gather(sync_grads=True)
        self._flag_group: Union[dist.ProcessGroup, None] = None  # gloo, over this rank's data-parallel peers
        self._sync_batchnorm = False  # the module holds nn.SyncBatchNorm layers (set in setup)
        self._buffers: Union[ReplicaBuffers, None] = None  # running statistics kept as DDP keeps them
        self._training_started = False  # a checkpoint loaded after this is a roll-back, not a resume
        self._checkpoint_names = CheckpointNames()  # where checkpoints store tied parameters
        self._prepared_module: Union[nn.Module, None] = None
        self._whole_on_peers: Union[WholeOnPeers, None] = None  # tensor parallelism: checked after first steps
        self._plan_check: Union[PlanCheck, None] = None  # ... with each kind of split block against itself whole
        self._sequences: Union[SequenceCheck, None] = None  # ... and the lengths sequence parallelism scatters

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, kwargs in PRESETS:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    # ------------------------------------------------------------------------------------------ layout

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        """The ``(pipeline_parallel, data_parallel[, tensor_parallel])`` mesh, known once the processes are
        initialised."""
        return known(self._mesh, "The device mesh is known once the processes are initialised (setup_environment).")

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        return self.device_mesh[PP_AXIS].get_group()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self.device_mesh[DP_AXIS].get_group()

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

    def gradient_layout(self) -> tuple[int, bool]:
        """(ranks holding each gradient element the optimizer steps with, whether every backward already
        averaged the gradients over the replicas); see :class:`GradientSync`."""
        sync = self._gradient_sync
        return sync.gradient_holders(), sync.averaged_every_backward

    def current_gradients(self, module: nn.Module) -> list[Tensor]:
        """This rank's part of the gradient accumulated so far in the window (see :class:`GradientSync`)."""
        return self._gradient_sync.current_gradients(module)

    def step_gradients(self, optimizer: Optimizer) -> list[Tensor]:
        """This rank's part of the gradients ``optimizer`` steps with, each element counted on
        ``gradient_layout()[0]`` ranks (see :class:`GradientSync`)."""
        return self._gradient_sync.step_gradients(self._unwrap(optimizer))

    def reductions_started(self) -> dict[str, int]:
        """Bucket reductions of the data-parallel gradients so far: started while backward still computed
        (``during_backward``) and started when it ended (``at_end``). ZeRO-3's are FSDP2's (not counted)."""
        return self._gradient_sync.reductions_started()

    def tied_record(self) -> list[Any]:
        return self._checkpoint_names.to_json()

    @property
    def _gradient_sync(self) -> GradientSync:
        return known(self._sync, "The gradient synchronisation is chosen in setup().")

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        init_processes(self)
        wait_for_gloo_at_exit()  # a finished job exits 0, also when gloo's workers are late (see the function)
        # same inputs on every rank -> the same verdict everywhere: bad sizes fail on all ranks, no hang
        self._layout = lay = self._request.resolve(world_size=self.world_size, num_nodes=self.num_nodes)
        self._mesh = lay.build_mesh(self.root_device.type)
        if self._flag_group is None and lay.data_parallel_size > 1:
            # the skip agreement over each data-parallel group on the host (gloo): on GPUs it never waits for the
            # device (an NCCL flag would sync the host with the compute stream at every micro-batch)
            self._flag_group = lay.host_data_parallel_group()
        assert self.lightning_module is not None
        attach_device_mesh(self.lightning_module, self._mesh)
        rank_zero_info(f"HybridParallelStrategy: {lay.describe()}")

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
            self._sync_batchnorm = any(isinstance(m, nn.SyncBatchNorm) for m in module.modules())
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
            self._gradient_sync.attach(
                [self._unwrap(o) for o in self.optimizers],
                named_parameters(module),
                user_gradient_code(trainer, module),
            )
            share_zero_grad(lightning_optimizers(self))
        self._connect_precision()
        self.setup_precision_plugin()
        self._training_started = False

    @property
    def optimizers(self) -> list[Optimizer]:
        return ModelParallelStrategy.optimizers.fget(self)  # type: ignore[attr-defined]

    @optimizers.setter
    def optimizers(self, optimizers: list[Optimizer]) -> None:
        # Lightning wraps the optimizers again whenever they are set (the precision plugin's connect does):
        # each new wrapper gets the ZeRO-1/2 zero_grad of its optimizer (what self.optimizers() is under manual
        # optimization; Lightning's wrapper would otherwise call the optimizer class's own zero_grad)
        ModelParallelStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        share_zero_grad(lightning_optimizers(self))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._training_started = True
        if self.layout.tensor_parallel_size > 1:
            group, module = self.device_mesh[TP_AXIS].get_group(), self.lightning_module
            same_random_streams(group)
            whole = {id(p) for p in whole_on_every_rank(module, TP_AXIS)}
            named = [(n, p) for n, p in module.named_parameters() if id(p) in whole and p.requires_grad]
            self._whole_on_peers = WholeOnPeers(named, group, self.root_device, self._plan_check)
            if self._plan_check is not None:  # the blocks compared under training's autocast
                self._plan_check.forward_context = self.precision_plugin.forward_context

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
            init_from=self._init_from or getattr(module, "pretrained_weights", None),
            agreed_seed=lambda: self.broadcast(int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))),
        )
        self.model = prepared.module
        self._runner, self._sync = prepared.runner, prepared.sync
        self._counted, self._plan_check, self._sequences = prepared.counted, prepared.plan_check, prepared.sequences
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

    @override
    def on_exception(self, exception: BaseException) -> None:
        note_failed_fit(exception)  # the exit code, should a thread still in a collective keep the exit from finalising
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        # the split module and its schedule stay: a later validate()/test() on this Trainer reuses them
        if self._runner is not None:
            self._runner.reset()
        super().teardown()
