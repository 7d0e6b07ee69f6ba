"""DeepSpeed's PipelineModule from the pipeline contract's ``self.layers`` (this rank keeps its stage), and
the engine around it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid._validate import check_int
from lightning_hybrid.checkpoint.pretrained import PretrainedWeights, agreed_load, agreed_plan
from lightning_hybrid.contract import mark_cut, refuse_cut_module
from lightning_hybrid.strategies.deepspeed.batch import unpacking
from lightning_hybrid.strategies.deepspeed.compat import keep_only_stage_blocks, stage_blocks
from lightning_hybrid.strategies.deepspeed.config import EngineRequest, merge_config

__all__ = ["PipeOptions", "build_pipeline", "start_engine"]


@dataclass(frozen=True)
class PipeOptions:
    """How DeepSpeed's ``PipelineModule`` is built: how it balances blocks over stages (``"parameters"``,
    ``"uniform"`` or ``"type:REGEX"``) and every how many blocks it recomputes activations (0: never)."""

    partition_method: str = "parameters"
    activation_checkpoint_interval: int = 0

    def __post_init__(self) -> None:
        method = self.partition_method
        if not isinstance(method, str) or not (
            method.lower() in ("parameters", "uniform") or method.lower().startswith("type:")
        ):
            raise ValueError(f"partition_method must be 'parameters', 'uniform' or 'type:REGEX', got {method!r}.")
        check_int("activation_checkpoint_interval", self.activation_checkpoint_interval, minimum=0)


def build_pipeline(
    module: nn.Module,
    *,
    num_stages: int,
    stage: int,
    options: PipeOptions,
    init_from: Union[PretrainedWeights, None],
    device: torch.device,
    loss_fn: Union[Callable[[Any, Any], Any], None] = None,
) -> tuple[nn.Module, Any]:
    """A ``PipelineModule`` over ``module.layers`` (every rank together: it builds process groups). Afterwards
    ``module.layers`` holds only this rank's blocks, under their original names, on ``device``, with the
    pretrained weights of ``init_from`` if given. Returns the PipelineModule and the pretrained source and
    plan (``None`` without ``init_from``), to fill DeepSpeed's fp32 master copy from once it exists."""
    from deepspeed.pipe import PipelineModule

    refuse_cut_module(module)
    # pretrained weights are planned against the whole module (every key must fit), read after the cut
    pretrained = agreed_plan(init_from, module, device) if init_from is not None else None
    items = list(module.layers.named_children())
    pipe = PipelineModule(
        layers=[unpacking(block) for _, block in items],
        num_stages=num_stages,
        loss_fn=loss_fn if loss_fn is not None else module.pipeline_loss,
        partition_method=options.partition_method,
        activation_checkpoint_interval=options.activation_checkpoint_interval,
    )
    start, stop = stage_blocks(pipe)  # this stage's blocks
    problem = None
    if start >= stop:
        problem = (
            f"stage {stage} of {num_stages} got no block of self.layers ({len(items)} blocks): use fewer stages or"
            " partition_method='uniform'"
        )
    problem = agreed_problem(problem, device=device)  # every rank fails, none waits
    if problem:
        raise ValueError(problem)
    # the other stages' blocks go; names stay `layers.<original name>.*`, as in the unsplit module
    module.layers = nn.ModuleDict(items[start:stop])
    mark_cut(module)
    keep_only_stage_blocks(pipe, start, stop)
    for p in pipe.parameters():
        # DeepSpeed's fp32 ZeRO-0 clipping counts only the first stage's gradients unless parameters say they
        # are split across its "model parallel" (here: pipeline) group; then the norm is global
        p.model_parallel = True
    module.to(device)
    for p in module.parameters():
        if not p.is_contiguous():  # DeepSpeed broadcasts and flattens storage: same values, row-major strides
            p.data = p.data.contiguous()
    if pretrained is not None:  # this stage's tensors only, before DeepSpeed copies them into its partitions
        read = agreed_load(module, *pretrained, device)
        rank_zero_info(f"init_from: rank 0 read {read / 2**20:.1f} MiB of {pretrained[1].weights.path}")
    return pipe, pretrained


def start_engine(
    pipe: nn.Module, optimizer: Any, user_config: dict[str, Any], request: EngineRequest, *, fitting: bool
) -> Any:
    """``deepspeed.initialize`` on the merged config (every rank together: it broadcasts and builds groups)."""
    import deepspeed

    user = dict(user_config)
    if not fitting:  # no optimizer or scheduler to build for validate / test
        user.pop("optimizer", None)
        user.pop("scheduler", None)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=merge_config(user, request))
    return engine
