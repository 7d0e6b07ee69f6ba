"""DeepSpeedPipelineStrategy: DeepSpeed's pipeline engine behind the pack's pipeline model contract.

The LightningModule is the one HybridParallelStrategy takes (blocks in ``self.layers``, ``pipeline_loss``,
optional ``pipeline_batch``); switching engines is switching the strategy block of the YAML. ``setup`` builds a
``deepspeed.pipe.PipelineModule`` from this rank's blocks, merges the DeepSpeed config with what Lightning
owns (``_deepspeed_config``) and initialises the ``PipelineEngine``; each training batch is one
``train_batch`` (forward, backward, gradient reduction, clipping and the optimizer step of DeepSpeed's
1F1B schedule), each validation batch one ``eval_batch``. Checkpoints are the pack's sharded folders
(``_deepspeed_state``), never DeepSpeed's own files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer, _MockOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree, agreed_problem
from lightning_hybrid._skip import skip_schedulers_when
from lightning_hybrid._torch_compat import wait_for_gloo_at_exit
from lightning_hybrid.checkpoint._sharded import LAYOUT_KEY, read_meta
from lightning_hybrid.checkpoint.pretrained import PretrainedWeights
from lightning_hybrid.contract import micro_batches
from lightning_hybrid.strategies._checks import agreed_setup
from lightning_hybrid.strategies._state import ShardedCheckpointIO, checkpoint_folder
from lightning_hybrid.strategies.deepspeed import state as ds_state
from lightning_hybrid.strategies.deepspeed.batch import loader_micro_batch, shapes
from lightning_hybrid.strategies.deepspeed.build import build_pipeline, start_engine
from lightning_hybrid.strategies.deepspeed.checks import optimizer_problem, refuse_unsupported
from lightning_hybrid.strategies.deepspeed.config import (
    EngineRequest,
    check_arguments,
    load_config,
    resolve_sizes,
)
from lightning_hybrid.strategies.pipeline.counted_loss import CountedLoss, counted_loss
from lightning_hybrid.strategies.zero.buffers import ReplicaBuffers

__all__ = ["DeepSpeedPipelineStrategy"]


class DeepSpeedPipelineStrategy(ShardedCheckpointIO, DDPStrategy):
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
        num_microbatches: micro-batches per batch (DeepSpeed's gradient accumulation steps); default: two per
            stage.
        data_parallel_size: replicas of the pipeline; default: the rest of the world.
        zero_stage: 0 or 1 (DeepSpeed refuses ZeRO-2/3 with a pipeline).
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

    Example::

        trainer = Trainer(
            strategy=DeepSpeedPipelineStrategy(pipeline_parallel_size=4, num_microbatches=8, zero_stage=1),
            accelerator="gpu", devices=8, precision="bf16-mixed",
        )
    """

    strategy_name = "deepspeed_pipeline"

    def __init__(
        self,
        *,
        pipeline_parallel_size: Union[int, Literal["auto"]],
        num_microbatches: Union[int, None] = None,
        data_parallel_size: Union[int, None] = None,
        zero_stage: Literal[0, 1] = 0,
        config: Union[dict[str, Any], str, os.PathLike, None] = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        init_from: Union[str, os.PathLike, PretrainedWeights, None] = None,
        process_group_backend: Union[str, None] = None,
        timeout: Union[timedelta, None] = default_pg_timeout,
    ) -> None:
        check_arguments(pipeline_parallel_size, num_microbatches, data_parallel_size, zero_stage,
                         partition_method, activation_checkpoint_interval)  # fmt: skip
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._pipeline_request = pipeline_parallel_size
        self._num_microbatches_request = num_microbatches
        self._data_parallel_request = data_parallel_size
        self._zero_stage = zero_stage
        self._user_config = load_config(config)  # a bad path or JSON fails here, on every rank
        self._partition_method = partition_method
        self._activation_checkpoint_interval = activation_checkpoint_interval
        if init_from is not None and not isinstance(init_from, PretrainedWeights):
            init_from = PretrainedWeights(init_from)  # raises a ValueError naming what is wrong
        self._init_from: Union[PretrainedWeights, None] = init_from
        self._pp = self._dp = self._m = 0
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
        if self._engine is None:
            raise RuntimeError("The DeepSpeed engine is built in setup().")
        return self._engine

    @property
    def pipeline_rank(self) -> int:
        return self.global_rank // self._dp  # DeepSpeed numbers ranks stage * dp + data index

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank % self._dp

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same samples (the first stage the inputs, the last the targets)
        return {"num_replicas": self._dp, "rank": self.data_parallel_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (and its fp32 partitions) must exist before a checkpoint loads into it

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer state into DeepSpeed's partitions itself

    def exact_window_means(self) -> bool:
        """Whether each step is the exact mean over its window's counted elements (``pipeline_loss_count``)."""
        return self._counted is not None

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint is written with (informational: any layout and either engine can load it)."""
        return {
            "engine": "deepspeed",
            "pipeline_parallel_size": self._pp,
            "data_parallel_size": self._dp,
            "zero_stage": self._zero_stage,
            "schedule": "1f1b",
            "num_stages": self._pp,
            "tied_parameters": [],
        }

    @property
    def engine_name(self) -> str:
        return "DeepSpeed"

    @property
    def engine_micro_batches(self) -> int:
        """Micro-batches DeepSpeed's engine accumulates per optimizer step (``StepsInsideTrainingStep``)."""
        return self._m

    # ------------------------------------------------------------------------------------------ set-up

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the default process group (gloo on CPU, NCCL on GPU)
        wait_for_gloo_at_exit()  # a finished job exits 0, also when gloo's workers are late (see the function)
        self._pp, self._dp, self._m = resolve_sizes(
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            pipeline_parallel_size=self._pipeline_request,
            data_parallel_size=self._data_parallel_request,
            num_microbatches=self._num_microbatches_request,
        )
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))  # PipelineModule and the engine read it
        import deepspeed

        if self.root_device.type == "cpu":
            # DeepSpeed would JIT-compile a shared-memory collective with ninja; torch's gloo is used instead
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=self._get_process_group_backend(), verbose=False)  # wraps ours
        rank_zero_info(
            f"DeepSpeedPipelineStrategy: pipeline_parallel_size={self._pp}, data_parallel_size={self._dp},"
            f" zero_stage={self._zero_stage}, num_microbatches={self._m}"
        )

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
        if self._layer_sync is not None:
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
            problem = agreed_problem(problem, device=self.root_device)
            if problem:
                raise ValueError(problem)
            self._groups_at_setup = [len(o.param_groups) for o in self.optimizers] if fitting else []
            if fitting:
                self._watch_unused(module)
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
            zero_stage=self._zero_stage,
            num_microbatches=self._m,
            device=self.root_device,
        )

    def _build_pipeline(self, module: pl.LightningModule) -> nn.Module:
        self._counted = counted_loss(module, self.root_device)
        pipe, self._pretrained = build_pipeline(
            module,
            num_stages=self._pp,
            stage=self.pipeline_rank,
            partition_method=self._partition_method,
            activation_checkpoint_interval=self._activation_checkpoint_interval,
            init_from=self._init_from,
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
            if isinstance(optimizer, _MockOptimizer):  # configure_optimizers returned None: the config's
                optimizer = None
        precision = self.precision_plugin.precision
        problem = optimizer_problem(
            optimizer, zero_stage=self._zero_stage, precision=precision, stage=self.pipeline_rank
        )
        problem = agreed_problem(problem, device=self.root_device)  # a stage's own groups: every rank fails
        if problem:
            raise ValueError(problem)
        request = EngineRequest(
            micro_batch_size=loader_micro_batch(
                trainer, self._user_config.get("train_micro_batch_size_per_gpu"), self._m
            ),
            num_microbatches=self._m,
            data_parallel_size=self._dp,
            zero_stage=self._zero_stage,
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

    # ----------------------------------------------------------------------------------------- training

    def _micro_batches(self, batch: Any, mode: str) -> list[tuple[Any, Any]]:
        assert self.lightning_module is not None
        chunks = micro_batches(self.lightning_module, batch, self._m, self.root_device)
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
        return module.pipeline_loss(output, target) * (share * self._m * self._dp)

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
        self._batch_count = total / self._pp

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
    def optimizer_step(
        self,
        optimizer: Union[Optimizer, LightningOptimizer],
        closure: Callable[[], Any],
        model: Union[pl.LightningModule, nn.Module, None] = None,
        **kwargs: Any,
    ) -> Any:
        return closure()  # training_step's train_batch reduced, clipped and stepped

    # --------------------------------------------------------------------------------------- evaluation

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

    # -------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ds_state.model_state(self.lightning_module, self._slots, partitioned=self._stepping)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._stepping:
            return {}
        return ds_state.optimizer_state(ds_state.client_optimizer(self.engine), self._slots)

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, os.PathLike], weights_only: Union[bool, None] = None
    ) -> dict[str, Any]:
        # read with the pack's safe reader whatever `weights_only` says: a checkpoint never runs code
        path = checkpoint_folder(self, checkpoint_path)
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizer = ds_state.client_optimizer(self.engine) if fitting else None
        self._loading = True  # loading creates the optimizer state by a zero-gradient step: no training step
        try:
            ds_state.load_sharded(
                path, module, self._slots, optimizer, strict=module.strict_loading, device=self.root_device
            )
        finally:
            self._loading = False
        meta = read_meta(path)
        written = meta.get(LAYOUT_KEY)
        if written:
            rank_zero_info(f"Resumed from {path} (written with {written}) onto {self.checkpoint_layout()}")
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint loaded the optimizer state in place

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
