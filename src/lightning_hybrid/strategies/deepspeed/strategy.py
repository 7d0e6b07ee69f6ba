"""DeepSpeedPipelineStrategy: DeepSpeed's pipeline engine behind the pack's pipeline model contract.

The LightningModule is the one HybridParallelStrategy takes (blocks in ``self.layers``, ``pipeline_loss``,
optional ``pipeline_batch``); switching engines is switching the strategy block of the YAML. ``setup`` builds a
``deepspeed.pipe.PipelineModule`` from this rank's blocks, merges the DeepSpeed config with what Lightning
owns (``deepspeed/config.py``) and initialises the ``PipelineEngine``; each training batch is one
``train_batch`` (forward, backward, gradient reduction, clipping and the optimizer step of DeepSpeed's
1F1B schedule), each validation batch one ``eval_batch``. Checkpoints are the pack's sharded folders
(``deepspeed/state.py``), never DeepSpeed's own files.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_hybrid._agree import agreed_problem, raise_agreed
from lightning_hybrid._lightning_compat import is_mock_optimizer, process_group_backend, syncs_batchnorm
from lightning_hybrid._skip import skip_schedulers_when
from lightning_hybrid._torch_compat import note_failed_fit, wait_for_gloo_at_exit
from lightning_hybrid.checkpoint.pretrained import PretrainedWeights, as_pretrained_weights
from lightning_hybrid.strategies._checks import agreed_setup
from lightning_hybrid.strategies._layout import Layout, LayoutRequest
from lightning_hybrid.strategies._parallel import ParallelLayout, known
from lightning_hybrid.strategies._state import ShardedCheckpointIO
from lightning_hybrid.strategies.deepspeed import state as ds_state
from lightning_hybrid.strategies.deepspeed.batch import loader_micro_batch
from lightning_hybrid.strategies.deepspeed.build import PipeOptions, build_pipeline, start_engine
from lightning_hybrid.strategies.deepspeed.checks import optimizer_problem, refuse_unsupported
from lightning_hybrid.strategies.deepspeed.compat import keep_torch_collectives
from lightning_hybrid.strategies.deepspeed.config import (
    EngineRequest,
    check_zero_stage,
    load_config,
)
from lightning_hybrid.strategies.deepspeed.step import EngineStep
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss, counted_loss
from lightning_hybrid.strategies.zero.buffers import ReplicaBuffers
from lightning_hybrid.strategies.zero.sharded_state import refuse_whole_state

__all__ = ["DeepSpeedPipelineStrategy"]


class DeepSpeedPipelineStrategy(ParallelLayout, EngineStep, ShardedCheckpointIO, DDPStrategy):
    """DeepSpeed's ``PipelineEngine`` (1F1B pipeline x data parallel, ZeRO-0/1) driven from Lightning's loop.

    Takes the same LightningModule as :class:`HybridParallelStrategy`: its blocks, in order, in
    ``self.layers``; ``pipeline_loss(output, target)`` returning the micro-batch mean; optionally
    ``pipeline_batch(batch) -> (inputs, target)``. Each batch of the DataLoader is cut into
    ``num_microbatches`` micro-batches that DeepSpeed's 1F1B schedule runs; the optimizer steps once per batch.

    Lightning owns, and writes into the DeepSpeed config: the micro-batch size and accumulation (batch size /
    ``num_microbatches``), ``gradient_clipping`` (``Trainer(gradient_clip_val=...)``, 0 when unset: DeepSpeed's
    silent default of 1.0 never applies), fp16 / bf16 (``Trainer(precision=...)``; fp16 uses DeepSpeed's
    loss scaler), the ZeRO stage, and the optimizer and LR scheduler ``configure_optimizers`` returns (or
    an optimizer named in the config when it returns none). A config key that disagrees fails at set-up
    with both values. Gradient clipping uses the norm over every stage (DeepSpeed's fp32 ZeRO-0 pipeline path
    would clip all stages by the first stage's norm).

    Checkpoints are the pack's sharded folders: they load into this strategy at any layout, into
    :class:`HybridParallelStrategy` and through ``consolidate_checkpoint``, and work with
    ``FaultTolerantCheckpoint``. ``AccumulationScheduler`` and ``AdaptiveLossScalingPrecision`` are refused
    (the engine accumulates the micro-batches and scales the loss itself); parameters tied across blocks
    are refused (use HybridParallelStrategy, which keeps them exact).

    Args:
        pipeline_parallel_size: pipeline stages (one per rank); ``"auto"`` puts one on each node.
        num_microbatches: micro-batches per batch (DeepSpeed's gradient accumulation steps); default: one per
            stage.
        data_parallel_size: replicas of the pipeline; ``"auto"`` (the default) or ``None``: the rest of the
            world.
        zero_stage: 0 or 1 (DeepSpeed refuses ZeRO-2/3 with a pipeline).
        tensor_parallel_size: 1; DeepSpeed's pipeline engine has no tensor parallelism (above 1 is refused,
            pointing to HybridParallelStrategy).
        config: a DeepSpeed config (a dict or the path of a JSON file) for everything Lightning does not own.
        partition_method: how DeepSpeed balances blocks over stages: ``"parameters"``, ``"uniform"`` or
            ``"type:REGEX"``.
        activation_checkpoint_interval: recompute activations in backward every this many blocks (0: off).
        init_from: start from pretrained weights, as HybridParallelStrategy's ``init_from`` (a ``torch.save``
            state_dict, ``.safetensors`` files, a checkpoint of this pack, or a :class:`PretrainedWeights` with
            a key map); each rank reads only its stage's tensors. A checkpoint resumed with ``ckpt_path``
            overrides them.
        process_group_backend: ``"nccl"`` / ``"gloo"``; chosen from the device by default.
        timeout: collective timeout.

    The sizes take the same spellings and defaults as :class:`HybridParallelStrategy`'s (one
    ``LayoutRequest``), so a LightningCLI strategy block of common arguments trains under either engine with
    only its ``class_path`` changed.

    Example::

        trainer = Trainer(
            strategy=DeepSpeedPipelineStrategy(pipeline_parallel_size=4, num_microbatches=8, zero_stage=1),
            accelerator="gpu", devices=8, precision="bf16-mixed",
        )
    """

    strategy_name = "deepspeed_pipeline"
    reads_pretrained_weights = True  # a module's ``pretrained_weights`` is its init_from when none is given
    engine_label = "deepspeed"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, Literal["auto"]] = 1,
        num_microbatches: Union[int, None] = None,
        data_parallel_size: Union[int, Literal["auto"], None] = "auto",
        zero_stage: Literal[0, 1] = 0,
        tensor_parallel_size: int = 1,
        config: Union[dict[str, Any], str, os.PathLike, None] = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        # PretrainedWeights first and a dict beside it: LightningCLI's parser then builds the object from YAML
        init_from: Union[PretrainedWeights, dict[str, Any], str, os.PathLike, None] = None,
        process_group_backend: Union[str, None] = None,
        timeout: Union[timedelta, None] = default_pg_timeout,
    ) -> None:
        check_zero_stage(zero_stage)
        self._request = LayoutRequest(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            zero_stage=zero_stage,
            num_microbatches=num_microbatches,
            tensor_parallel_size=tensor_parallel_size,  # above 1: refused, with what to use
            engine="deepspeed",
        )
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._user_config = load_config(config)  # a bad path or JSON fails here, on every rank
        self._pipe = PipeOptions(partition_method, activation_checkpoint_interval)
        init_from = as_pretrained_weights(init_from)  # raises a ValueError naming what is wrong
        self._init_from: Union[PretrainedWeights, None] = init_from
        self._layout: Union[Layout, None] = None
        self._counted: Union[CountedLoss, None] = None  # a loss averaged over pipeline_loss_count elements
        self._batch_count = 0.0
        self._groups_at_setup: list[int] = []
        self._used: set[int] = set()
        self._watched: list[nn.Parameter] = []
        self._loading = False
        self._pretrained: Any = None  # init_from's source and plan, until DeepSpeed's master copy is filled
        self._buffers: Union[ReplicaBuffers, None] = None
        self._engine: Any = None
        self._slots: list[ds_state.Slot] = []
        self._stepping = False  # the engine was built with an optimizer (for fit)
        self._prepared_module: Union[nn.Module, None] = None
        self._shape_key: Any = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if "deepspeed_pipeline" not in strategy_registry:
            strategy_registry.register(
                "deepspeed_pipeline",
                cls,
                description="DeepSpeed's pipeline engine, one stage per node, ZeRO-0",
                pipeline_parallel_size="auto",
            )

    # ------------------------------------------------------------------------------------------ layout

    @property
    def engine(self) -> Any:
        """DeepSpeed's ``PipelineEngine`` (after ``setup``)."""
        return known(self._engine, "The DeepSpeed engine is built in setup().")

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (and its fp32 partitions) must exist before a checkpoint loads into it

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer state into DeepSpeed's partitions itself

    def engine_name(self) -> str:
        return "DeepSpeed"

    def engine_micro_batches(self) -> int:
        """Micro-batches DeepSpeed's engine accumulates per optimizer step (``StepsInsideTrainingStep``)."""
        return self.layout.num_microbatches

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group (gloo on CPU, NCCL on GPU)
        wait_for_gloo_at_exit()  # a finished job exits 0, also when gloo's workers are late (see the function)
        self._layout = self._request.resolve(world_size=self.world_size, num_nodes=self.num_nodes)
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))  # PipelineModule and the engine read it
        import deepspeed

        if self.root_device.type == "cpu":
            keep_torch_collectives()
        deepspeed.init_distributed(dist_backend=process_group_backend(self), verbose=False)  # wraps ours
        rank_zero_info(f"DeepSpeedPipelineStrategy: {self.layout.describe()}")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ValueError(
                "DeepSpeedPipelineStrategy does not predict (DeepSpeed's eval_batch hands back only the last stage's"
                " outputs, one micro-batch list at a time); load the checkpoint with consolidate_checkpoint into"
                " the unsplit module, or predict with HybridParallelStrategy."
            )
        # every check reads what every rank has: each fails on all ranks with the same message, none waits
        if syncs_batchnorm(self):
            raise ValueError(
                "Trainer(sync_batchnorm=True) is not applied inside DeepSpeed's pipeline engine; remove it."
            )
        self._check_trainer(trainer, module)
        if self._prepared_module is module and fitting and not self._stepping:
            raise RuntimeError(
                "DeepSpeedPipelineStrategy built its engine for validate/test, without an optimizer, and cut the"
                " module into this rank's stage: fit a freshly built module with a new Trainer, or call fit before"
                " validate/test on one Trainer."
            )
        if self._prepared_module is not module:
            pipe = self._build_pipeline(module)
            self._prepared_module = module
            self._engine = self._initialize(trainer, module, pipe, fitting)
            self._stepping = fitting
            problem = None
            try:
                self._slots = ds_state.slots(module, self._engine) if fitting else []
                if self._pretrained is not None:
                    # DeepSpeed made its fp32 master copy from the bf16/fp16 parameters: fill it from the source
                    ds_state.fill_masters(self._slots, *self._pretrained)
                self._pretrained = None
            except ValueError as exc:
                problem = str(exc)
            raise_agreed(problem, ValueError, device=self.root_device)
            self._groups_at_setup = [len(o.param_groups) for o in self.optimizers] if fitting else []
            if fitting:
                self._watch_unused(module)
                refuse_whole_state(ds_state.client_optimizer(self._engine), module, self.layout.zero_stage)
            self._buffers = ReplicaBuffers(module, self._data_parallel_group())
        self.barrier()
        if not isinstance(self.precision_plugin, ds_state.EnginePrecision):
            self.precision_plugin = ds_state.EnginePrecision(self.precision_plugin.precision, lambda: self._engine)

    def _check_trainer(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        plugin = self.precision_plugin
        if isinstance(plugin, ds_state.EnginePrecision):  # checked at the first set-up
            plugin = Precision()
            plugin.precision = self.precision_plugin.precision
        refuse_unsupported(
            trainer,
            module,
            plugin,
            self,
            zero_stage=self.layout.zero_stage,
            num_microbatches=self.layout.num_microbatches,
            device=self.root_device,
        )

    def _build_pipeline(self, module: pl.LightningModule) -> nn.Module:
        self._counted = counted_loss(module, self.root_device)
        pipe, self._pretrained = build_pipeline(
            module,
            num_stages=self.layout.pipeline_parallel_size,
            stage=self.pipeline_rank,
            options=self._pipe,
            init_from=self._init_from or getattr(module, "pretrained_weights", None),
            loss_fn=self._loss,
            device=self.root_device,
        )
        return pipe

    def _initialize(self, trainer: pl.Trainer, module: pl.LightningModule, pipe: nn.Module, fitting: bool) -> Any:
        optimizer = None
        if fitting:
            # configure_optimizers sees this rank's stage only: a failure on one stage fails every rank
            agreed_setup("configure_optimizers", lambda: self.setup_optimizers(trainer), device=self.root_device)
            if len(self.optimizers) > 1:
                raise ValueError(
                    "DeepSpeedPipelineStrategy steps one optimizer; configure_optimizers returned several."
                )
            optimizer = self.optimizers[0] if self.optimizers else None
            if is_mock_optimizer(optimizer):  # configure_optimizers returned None: the config's
                optimizer = None
        precision = self.precision_plugin.precision
        problem = optimizer_problem(
            optimizer, zero_stage=self.layout.zero_stage, precision=precision, stage=self.pipeline_rank
        )
        problem = agreed_problem(problem, device=self.root_device)  # a stage's own groups: every rank fails
        if problem:
            raise ValueError(problem)
        request = EngineRequest(
            micro_batch_size=loader_micro_batch(
                trainer, self._user_config.get("train_micro_batch_size_per_gpu"), self.layout.num_microbatches
            ),
            num_microbatches=self.layout.num_microbatches,
            data_parallel_size=self.layout.data_parallel_size,
            zero_stage=self.layout.zero_stage,
            gradient_clip_val=trainer.gradient_clip_val,
            precision=precision,
            client_optimizer=optimizer is not None or not fitting,
        )
        engine = start_engine(pipe, optimizer, self._user_config, request, fitting=fitting)
        if fitting:
            if optimizer is None:  # built by DeepSpeed from the config: Lightning checkpoints it as its own
                self.optimizers = [ds_state.client_optimizer(engine)]
            # Lightning steps its LR schedulers after every step; DeepSpeed's fp16 skips some
            skip_schedulers_when(trainer, lambda: not engine.was_step_applied())
        return engine

    @override
    def on_exception(self, exception: BaseException) -> None:
        note_failed_fit(exception)  # the exit code, should a thread still in a collective keep the exit from finalising
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        # Strategy.teardown would move the module and the optimizer state to the CPU, away from DeepSpeed's flat
        # buffers (which a later validate()/test() on this Trainer reuses); a refused meta-built module cannot
        # move at all. The engine keeps them where they are.
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self.cluster_environment.teardown()
