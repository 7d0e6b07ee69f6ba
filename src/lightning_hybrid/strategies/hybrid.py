"""HybridParallelStrategy: pipeline parallelism x ZeRO-1/2/3 inside each stage, as a Lightning Strategy."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid._lightning_compat import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    reset_seed,
)
from lightning_hybrid.checkpoint._sharded import (
    LAYOUT_KEY,
    read_meta,
    read_sharded,
    read_sharded_index,
    split_checkpoint,
    write_sharded,
)
from lightning_hybrid.plugins._clipping import mesh_aware_precision
from lightning_hybrid.strategies._layout import (
    SCHEDULES,
    Layout,
    PipelineSplit,
    ScheduleName,
    resolve_layout,
)
from lightning_hybrid.strategies._pipeline import build_schedule, check_pipeline_contract, split_module
from lightning_hybrid.strategies._zero import FlatShardedOptimizer

__all__ = ["HybridParallelStrategy"]

log = logging.getLogger(__name__)

PP_AXIS, DP_AXIS = "pipeline_parallel", "data_parallel"


class HybridParallelStrategy(ModelParallelStrategy):
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
        process_group_backend: Union[str, None] = None,
        timeout: Union[timedelta, None] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        prepare_elastic_restart()  # a torchrun-restarted worker needs a clean store for its process group
        # what can be checked without the world size fails here, on every rank, before any process group
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}. Choose one of: {', '.join(SCHEDULES)}.")
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
        self._pipeline_parallel_size = pipeline_parallel_size
        self._zero_stage = zero_stage
        self._schedule_name = schedule
        self._num_microbatches = num_microbatches
        self._stages_per_rank = stages_per_rank
        self._split = split
        self._activation_checkpointing = activation_checkpointing
        self._layout: Union[Layout, None] = None
        self._schedule: Any = None
        self._stage_ids: list[int] = []
        self._stage_modules: list[nn.Module] = []
        self._stage_ranges: list[range] = []
        self._sharded: dict[int, FlatShardedOptimizer] = {}
        self._pending_grads: Union[list[Union[Tensor, None]], None] = None
        self._prepared_module: Union[nn.Module, None] = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: list[tuple[str, str, dict[str, Any]]] = [
            ("hybrid", "Pipeline x ZeRO hybrid parallelism (defaults: no pipeline, ZeRO-0)", {}),
            ("hybrid_zero1", "Data parallel with ZeRO-1 (optimizer state sharded)", {"zero_stage": 1}),
            ("hybrid_zero2", "Data parallel with ZeRO-2 (+ gradients sharded)", {"zero_stage": 2}),
            ("hybrid_zero3", "Data parallel with ZeRO-3 (+ parameters sharded, FSDP2)", {"zero_stage": 3}),
            (
                "hybrid_pipeline",
                "One 1F1B pipeline stage per node, ZeRO-1 inside each node",
                {"pipeline_parallel_size": "auto", "zero_stage": 1},
            ),
        ]
        for name, description, kwargs in presets:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)

    # ------------------------------------------------------------------------------------------ layout

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the processes are initialised (setup_environment).")
        return self._layout

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
    def holds_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage (where outputs and the loss exist)."""
        return not self.is_pipelined or (self.layout.num_stages - 1) in self._stage_ids

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every pipeline rank of one replica must see the same samples: split data over the dp axis only
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def setup_environment(self) -> None:
        # Strategy.setup_environment (device set-up) without ModelParallelStrategy's 2-D mesh
        super(ModelParallelStrategy, self).setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

        # same inputs on every rank -> the same verdict everywhere: bad sizes fail on all ranks, no hang
        self._layout = resolve_layout(
            world_size=self.world_size,
            num_nodes=self.num_nodes,
            pipeline_parallel_size=self._pipeline_parallel_size,
            data_parallel_size=self._data_parallel_size,
            zero_stage=self._zero_stage,
            schedule=self._schedule_name,
            stages_per_rank=self._stages_per_rank,
            num_microbatches=self._num_microbatches,
        )
        # row-major (pp, dp): data-parallel peers get adjacent global ranks, i.e. the same node
        self._device_mesh = init_device_mesh(
            self.root_device.type,
            (self._layout.pipeline_parallel_size, self._layout.data_parallel_size),
            mesh_dim_names=(PP_AXIS, DP_AXIS),
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        lay = self._layout
        rank_zero_info(
            f"HybridParallelStrategy: pipeline_parallel_size={lay.pipeline_parallel_size},"
            f" data_parallel_size={lay.data_parallel_size}, zero_stage={lay.zero_stage}"
            + (
                f", schedule={lay.schedule}, stages={lay.num_stages}, num_microbatches={lay.num_microbatches}"
                if lay.pipeline_parallel_size > 1
                else ""
            )
        )

    # -------------------------------------------------------------------------------------------- setup

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        layout = self.layout

        # fit -> validate -> test reuse one Trainer and call setup() again: split and shard only once
        if self._prepared_module is not module:
            self._prepare_module(module)
            self._prepared_module = module
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if layout.zero_stage in (1, 2):
                names = {p: n for n, p in module.named_parameters()}
                self._sharded = {
                    id(opt): FlatShardedOptimizer(
                        opt, names=names, group=self.data_parallel_group, zero_stage=layout.zero_stage
                    )
                    for opt in self.optimizers
                }
        self._connect_precision()
        self.setup_precision_plugin()

    def _prepare_module(self, module: pl.LightningModule) -> None:
        """Cut the module into this rank's stages, move it, shard it and build the schedule (once)."""
        layout = self.layout
        if layout.pipeline_parallel_size > 1:
            check_pipeline_contract(module)
            self._check_pipeline_precision()
            self._stage_ids, self._stage_modules, self._stage_ranges = split_module(
                module,
                layout=layout,
                pp_rank=self.pipeline_rank,
                split=self._split,
                activation_checkpointing=self._activation_checkpointing,
            )
        elif self._activation_checkpointing:
            raise ValueError(
                "activation_checkpointing=True needs pipeline stages to wrap; with pipeline_parallel_size=1 use"
                " torch.utils.checkpoint inside the model."
            )

        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if layout.zero_stage == 3:
            self._apply_fully_shard(module)

        if layout.pipeline_parallel_size > 1:
            self._schedule = build_schedule(
                layout=layout,
                stage_ids=self._stage_ids,
                stage_modules=self._stage_modules,
                device=self.root_device,
                group=self.pipeline_group,
                loss_fn=self._pipeline_loss_fn,
            )
            names = ", ".join(
                f"{sid}:{r.start}-{r.stop - 1}" for sid, r in zip(self._stage_ids, self._stage_ranges_local)
            )
            log.info(f"[rank {self.global_rank}] pipeline stages (stage:blocks) {names}")

    @property
    def _stage_ranges_local(self) -> list[range]:
        return [self._stage_ranges[s] for s in self._stage_ids]

    def _check_pipeline_precision(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and not hasattr(self.precision_plugin, "scale_pipeline_loss"):
            raise ValueError(
                "fp16 loss scaling with a pipeline needs one skip decision for all stages; Lightning's"
                f" {type(self.precision_plugin).__name__} decides per rank. Use"
                " plugins=[lightning_hybrid.plugins.AdaptiveLossScalingPrecision(precision='16-mixed')] or"
                " precision='bf16-mixed'."
            )

    def _connect_precision(self) -> None:
        plugin = mesh_aware_precision(self.precision_plugin, self._global_grad_norm)
        if plugin is None:
            if self.layout.world_size > 1:
                rank_zero_info(
                    f"{type(self.precision_plugin).__name__} clips gradients by the local norm; with a pipeline or"
                    " ZeRO shards that norm is partial."
                )
            return
        self.precision_plugin = plugin

    def _apply_fully_shard(self, module: pl.LightningModule) -> None:
        """ZeRO-3 via FSDP2 on the data-parallel sub-mesh: each block is a unit, each stage (or module) the root."""
        mesh = self.device_mesh[DP_AXIS]
        policy = MixedPrecisionPolicy()
        if getattr(self.precision_plugin, "precision", None) == "bf16-mixed":
            # parameters gathered in bf16, gradients reduced in fp32: the usual FSDP mixed-precision recipe
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}
        if self.is_pipelined:
            for stage in self._stage_modules:
                for block in stage.blocks:
                    fully_shard(block, **kwargs)
                fully_shard(stage, **kwargs)
            return
        layers = getattr(module, "layers", None)
        units = list(layers.children()) if isinstance(layers, nn.Module) else list(module.children())
        for unit in units:
            if any(p.requires_grad for p in unit.parameters()):
                fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)

    # ----------------------------------------------------------------------------------------- training

    def _pipeline_loss_fn(self, output: Any, target: Tensor) -> Tensor:
        module = self.lightning_module
        assert module is not None
        loss = module.pipeline_loss(output, target)
        scale = getattr(self.precision_plugin, "scale_pipeline_loss", None)
        return scale(loss) if scale is not None else loss

    def _split_batch(self, batch: Any) -> tuple[Any, Tensor]:
        module = self.lightning_module
        fn = getattr(module, "pipeline_batch", None)
        inputs, target = fn(batch) if callable(fn) else (batch[0], batch[1])
        size = inputs.shape[0] if isinstance(inputs, Tensor) else inputs[0].shape[0]
        m = self.layout.num_microbatches
        if size % m:
            raise ValueError(
                f"The per-replica batch size ({size}) must be divisible by num_microbatches ({m}): pipeline"
                " micro-batches must be equal. Change the DataLoader's batch_size, num_microbatches, or use"
                " drop_last=True."
            )
        return inputs, target

    def _run_schedule(self, batch: Any, *, train: bool) -> tuple[Tensor, Any, Tensor]:
        """Run one pipelined step. Returns (mean loss on every rank, last-stage output or None, target)."""
        inputs, target = self._split_batch(batch)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        losses: list[Tensor] = []
        if train:
            output = self._schedule.step(*args, target=target, losses=losses)
        else:
            output = self._schedule.eval(*args, target=target, losses=losses)
        # the loss lives on the last stage only: one all-reduce shares it with every rank and averages it
        # over the data-parallel replicas (fp32 first: a bf16 value broadcast into fp32 arrives as 0 on gloo)
        loss = torch.zeros((), dtype=torch.float32, device=self.root_device)
        if self.holds_last_stage and losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
            unscale = getattr(self.precision_plugin, "unscale_pipeline_loss", None)
            if unscale is not None:
                loss = unscale(loss)
        dist.all_reduce(loss)
        loss = loss / self.layout.data_parallel_size
        return loss, output if self.holds_last_stage else None, target

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_pipelined:
            return super().training_step(*args, **kwargs)
        params = self._local_parameters()
        # The schedule runs forward AND backward here, but Lightning zeroes gradients between training_step
        # and backward(); set the previous gradients aside and hand the new ones back in backward().
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss, _, _ = self._run_schedule(args[0], train=True)
        self._pending_grads = [p.grad for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        module = self.lightning_module
        assert module is not None
        module.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Union[Optimizer, None], *args: Any, **kwargs: Any) -> Tensor:
        if not self.is_pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        assert module is not None and self._pending_grads is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # gradients of `loss / accumulate_grad_batches`, exactly as Lightning's backward would produce
        divisor = module.trainer.accumulate_grad_batches
        with torch.no_grad():
            for p, new in zip(self._local_parameters(), self._pending_grads):
                if new is None:
                    continue
                if divisor != 1:
                    new = new / divisor
                p.grad = new if p.grad is None else p.grad + new
        self._pending_grads = None
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
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._sharded.get(id(optimizer))

        def closure_then_sync() -> Any:
            out = closure()
            # gradients are complete once the window's last backward ran: reduce them before the hooks and
            # clipping in the precision plugin see them
            if sharded is not None:
                sharded.reduce_gradients()
            elif self.layout.zero_stage == 0:
                self._all_reduce_gradients(optimizer)
            return out

        result = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if sharded is not None:
            sharded.gather_parameters()
        return result

    @torch.no_grad()
    def _all_reduce_gradients(self, optimizer: Optimizer) -> None:
        """ZeRO-0: average gradients over the data-parallel group with one flat all-reduce."""
        dp = self.layout.data_parallel_size
        if dp == 1:
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat.div_(dp)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def _global_grad_norm(self, grads: Iterable[Tensor]) -> Tensor:
        """L2 norm of the gradient of the whole model (all stages, all shards); identical on every rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            total += local.detach().float().pow(2).sum()
        # ZeRO-0 replicas hold the same gradients: sum over stages only; shards are disjoint: sum over all
        group = self.pipeline_group if self.layout.zero_stage == 0 else None
        dist.all_reduce(total, group=group)
        return total.sqrt()

    def _local_parameters(self) -> list[nn.Parameter]:
        return [p for stage in self._stage_modules for p in stage.parameters() if p.requires_grad]

    # --------------------------------------------------------------------------------------- evaluation

    def _pipelined_eval_step(self, hook: str, metric_name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.val_step_context():
            loss, output, target = self._run_schedule(args[0], train=False)
        user_hook = getattr(module, f"pipeline_{hook}", None)
        if callable(user_hook):
            # the last stage's output reaches every pipeline rank, so metrics update (and sync) everywhere
            output = self._broadcast_from_last_stage(output)
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            return user_hook(output, target, batch_idx)
        module.log(metric_name, loss, prog_bar=True, sync_dist=False)
        return loss

    def _broadcast_from_last_stage(self, output: Any) -> Tensor:
        src = (self.layout.num_stages - 1) % self.layout.pipeline_parallel_size
        if SCHEDULES[self.layout.schedule].style == "v":
            src = 0
        obj = [None if output is None else output.detach().cpu()]
        dist.broadcast_object_list(obj, group=self.pipeline_group, group_src=src)
        return obj[0].to(self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_pipelined:
            return super().validation_step(*args, **kwargs)
        return self._pipelined_eval_step("validation_step", "val_loss", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_pipelined:
            return super().test_step(*args, **kwargs)
        return self._pipelined_eval_step("test_step", "test_loss", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.is_pipelined:
            return super().predict_step(*args, **kwargs)
        # predictions are the last stage's outputs, shared with every rank of the pipeline
        with self.precision_plugin.predict_step_context():
            inputs = args[0][0] if isinstance(args[0], (tuple, list)) else args[0]
            output = self._schedule.eval(inputs)
        return self._broadcast_from_last_stage(output if self.holds_last_stage else None)

    # -------------------------------------------------------------------------------------- checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = get_model_state_dict(self.lightning_module)
        for sharded in self._sharded.values():  # ZeRO-1/2: each replica saves its slice of the parameters
            state.update({k: v for k, v in sharded.parameter_state_dict().items() if k in state})
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._sharded.get(id(optimizer))
        if sharded is not None:
            return sharded.flat_state_dict()
        assert self.lightning_module is not None
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self.lightning_module, optimizer, options=options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes torch DCP)."
            )
        path = Path(self.broadcast(str(filepath)))  # one folder for every rank
        if path.is_file():
            raise FileExistsError(f"{path} is a file; a sharded checkpoint is a folder. Choose another path.")
        if self.is_global_zero:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier("HybridParallelStrategy.save_checkpoint")
        tensors, meta = split_checkpoint(checkpoint)
        meta[LAYOUT_KEY] = self.checkpoint_layout()
        write_sharded(path, tensors, meta if self.is_global_zero else None)
        self.barrier("HybridParallelStrategy.save_checkpoint.done")

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint is written with (informational: any layout can load it)."""
        lay = self.layout
        return {
            "pipeline_parallel_size": lay.pipeline_parallel_size,
            "data_parallel_size": lay.data_parallel_size,
            "zero_stage": lay.zero_stage,
            "schedule": lay.schedule,
            "num_stages": lay.num_stages,
        }

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Union[bool, None] = None) -> dict[str, Any]:
        # rank 0 resolves links (last.ckpt): every rank then reads the same folder, whatever its node caches
        path = Path(self.broadcast(str(Path(checkpoint_path).resolve())))
        module = self.lightning_module
        assert module is not None
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path} is not a sharded checkpoint written by HybridParallelStrategy (no .metadata file); it may"
                " be incomplete. Pass the checkpoint directory that `trainer.save_checkpoint` created."
            )
        saved = read_sharded_index(path).state_dict_metadata

        # the model: DCP reshards whatever layout wrote it into this rank's tensors (plain or DTensor)
        model_state = get_model_state_dict(module)
        missing = [k for k in model_state if f"state_dict.{k}" not in saved]
        if missing and module.strict_loading:
            raise KeyError(f"The checkpoint at {path} has no values for {missing[:5]} (strict_loading=True)")
        to_load: dict[str, Any] = {"state_dict": {k: v for k, v in model_state.items() if k not in missing}}

        optimizer_templates: dict[int, dict[str, Any]] = {}
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            for idx, optimizer in enumerate(self.optimizers):
                template = self._optimizer_template(optimizer, saved, f"optimizer_{idx}")
                if template:
                    optimizer_templates[idx] = template
                    to_load[f"optimizer_{idx}"] = template
        read_sharded(path, to_load)

        set_model_state_dict(module, to_load["state_dict"], options=StateDictOptions(strict=False))
        for idx, optimizer in enumerate(self.optimizers):
            if idx not in optimizer_templates:
                continue
            sharded = self._sharded.get(id(optimizer))
            if sharded is not None:
                sharded.load_parameters_into_shards()
                sharded.load_flat_state_dict(to_load[f"optimizer_{idx}"])
            else:
                options = StateDictOptions(flatten_optimizer_state_dict=True)
                set_optimizer_state_dict(module, optimizer, to_load[f"optimizer_{idx}"], options=options)
        for sharded in self._sharded.values():
            sharded.load_parameters_into_shards()

        # tensors and plain values only: loading a checkpoint never runs code
        meta = read_meta(path)
        written = meta.get(LAYOUT_KEY)
        if written:
            rank_zero_info(f"Resumed from {path} (written with {written}) onto {self.layout}")
        return meta

    def _optimizer_template(self, optimizer: Optimizer, saved: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """This rank's part of the flat, name-keyed optimizer state, shaped as the checkpoint stores it."""
        module = self.lightning_module
        assert module is not None
        sharded = self._sharded.get(id(optimizer))
        if sharded is None:
            options = StateDictOptions(flatten_optimizer_state_dict=True)
            current = get_optimizer_state_dict(module, optimizer, options=options)
            return {k: v for k, v in current.items() if f"{prefix}.{k}" in saved}
        names = {n for g in sharded.groups for n in g.names}
        template: dict[str, Any] = {}
        for key, meta in saved.items():
            if not key.startswith(prefix + "."):
                continue
            sub = key[len(prefix) + 1 :]
            _section, _, rest = sub.partition(".")
            if not any(rest.startswith(n + ".") for n in names):
                continue
            if isinstance(meta, TensorStorageMetadata):
                # a per-element state loads only this rank's slice; scalars load whole
                part = sharded.state_template(rest.rpartition(".")[0], meta.size, meta.properties.dtype)
                template[sub] = part if part is not None else torch.empty(meta.size, dtype=meta.properties.dtype)
            elif isinstance(meta, BytesStorageMetadata):
                template[sub] = None
        return template

    @override
    def teardown(self) -> None:
        # the split module and its schedule stay: a later validate()/test() on this Trainer reuses them
        self._pending_grads = None
        super().teardown()
