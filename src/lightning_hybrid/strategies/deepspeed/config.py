"""The DeepSpeed config of DeepSpeedPipelineStrategy: the user's config merged with what Lightning owns.

Lightning owns the batch (micro-batch size and accumulation follow from the DataLoader's batch size and
``num_microbatches``), gradient clipping (``Trainer(gradient_clip_val=...)``), precision
(``Trainer(precision=...)``), the ZeRO stage (the strategy's argument), the LR scheduler
(``configure_optimizers``) and, when ``configure_optimizers`` returns one, the optimizer. A config key that
says something else fails at set-up with both values, instead of one silently winning. DeepSpeed 0.19
clips at 1.0 when ``gradient_clipping`` is absent: here it is always written, 0.0 (off) unless the Trainer
or the config asks.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = ["EngineRequest", "check_zero_stage", "load_config", "merge_config", "precision_kind"]

# what DeepSpeed calls the Trainer's precision settings
_PRECISIONS = {"32-true": None, "32": None, "16-mixed": "fp16", "bf16-mixed": "bf16"}


def load_config(config: Union[dict[str, Any], str, os.PathLike, None]) -> dict[str, Any]:
    """A DeepSpeed config from a dict or a JSON file, as a new dict."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"config must be a dict or the path of a DeepSpeed JSON config, got {type(config).__name__}.")
    path = Path(config)
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the DeepSpeed config {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"the DeepSpeed config {path} is not valid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"the DeepSpeed config {path} must hold a JSON object, got {type(loaded).__name__}.")
    return loaded


@dataclass(frozen=True)
class EngineRequest:
    """What the Trainer and the strategy ask of the engine."""

    micro_batch_size: int
    num_microbatches: int
    data_parallel_size: int
    zero_stage: int
    gradient_clip_val: Union[float, None]
    precision: str
    client_optimizer: bool


def precision_kind(precision: str) -> Union[str, None]:
    """``None`` (fp32), ``"fp16"`` or ``"bf16"``; a ValueError for what the engine cannot do."""
    if precision not in _PRECISIONS:
        raise ValueError(
            f"DeepSpeedPipelineStrategy supports precision '32-true', '16-mixed' (DeepSpeed's fp16 with its loss"
            f" scaler) or 'bf16-mixed', got {precision!r}."
        )
    return _PRECISIONS[precision]


def merge_config(user: dict[str, Any], want: EngineRequest) -> dict[str, Any]:
    """``user`` with what Lightning owns filled in; a ValueError listing every conflict."""
    config = copy.deepcopy(user)
    conflicts: list[str] = []

    def own(key: str, value: Any, source: str, container: dict[str, Any] = config, shown: str = "") -> None:
        if key in container and container[key] != value:
            conflicts.append(f"{shown or key}: the config says {container[key]!r}, {source} says {value!r}")
        container[key] = value

    batch = want.micro_batch_size * want.num_microbatches
    own("train_micro_batch_size_per_gpu", want.micro_batch_size,
        f"the DataLoader's batch size {batch} / num_microbatches {want.num_microbatches}")  # fmt: skip
    own("gradient_accumulation_steps", want.num_microbatches, "the strategy's num_microbatches")
    own("train_batch_size", batch * want.data_parallel_size,
        f"batch size {batch} x data_parallel_size {want.data_parallel_size}")  # fmt: skip

    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"zero_optimization in the DeepSpeed config must be an object, got {zero!r}.")
    own("stage", want.zero_stage, "the strategy's zero_stage", zero, "zero_optimization.stage")
    # cpu_offload / cpu_offload_params: DeepSpeed's deprecated spellings of the same two settings
    for key in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"):
        value = zero.get(key)
        if value and not (isinstance(value, dict) and value.get("device", "cpu") in ("none", None)):
            conflicts.append(
                f"zero_optimization.{key}: not supported by DeepSpeedPipelineStrategy (its checkpoints read the"
                " optimizer state where DeepSpeed keeps it on the device); remove it"
            )
    if want.zero_stage >= 1:
        # DeepSpeed's default bucket is 5e8 elements, allocated every step under a pipeline
        zero.setdefault("reduce_bucket_size", 5_000_000)
        zero.setdefault("allgather_bucket_size", 5_000_000)
        if want.client_optimizer:
            config.setdefault("zero_allow_untested_optimizer", True)

    if want.gradient_clip_val is not None:
        own("gradient_clipping", float(want.gradient_clip_val), "Trainer(gradient_clip_val=...)")
    else:
        config.setdefault("gradient_clipping", 0.0)  # never DeepSpeed's silent default of 1.0

    kind = precision_kind(want.precision)
    if "bfloat16" in config:  # DeepSpeed's alias of the bf16 section
        section = config.pop("bfloat16")
        config["bf16"] = {**section, **config.get("bf16", {})} if isinstance(section, dict) else section
    autocast = config.get("torch_autocast", {})
    if isinstance(autocast, dict) and autocast.get("enabled"):
        conflicts.append(
            f"torch_autocast.enabled: the config says True, Trainer(precision={want.precision!r}) runs DeepSpeed's"
            " fp16 / bf16 engine instead; remove torch_autocast"
        )
    for name in ("fp16", "bf16"):
        section = config.setdefault(name, {})
        if not isinstance(section, dict):
            raise ValueError(f"{name} in the DeepSpeed config must be an object, got {section!r}.")
        own("enabled", kind == name, f"Trainer(precision={want.precision!r})", section, f"{name}.enabled")

    if kind == "bf16":  # Lightning's bf16-mixed accumulates gradients in fp32; DeepSpeed's default is bf16
        types = config.setdefault("data_types", {})
        if not isinstance(types, dict):
            raise ValueError(f"data_types in the DeepSpeed config must be an object, got {types!r}.")
        if want.zero_stage >= 1:
            types.setdefault("grad_accum_dtype", "fp32")
        elif types.get("grad_accum_dtype") not in ("bf16", "bfloat16"):
            conflicts.append(
                "data_types.grad_accum_dtype: DeepSpeed's pipeline with zero_stage=0 accumulates bf16 gradients"
                " only in bf16 (Trainer(precision='bf16-mixed') means fp32); use zero_stage=1, or accept bf16"
                " accumulation with data_types: {grad_accum_dtype: bf16} in the config"
            )
    if want.client_optimizer and "optimizer" in config:
        conflicts.append(
            "optimizer: the config names one and configure_optimizers returns one; keep one of them (return"
            " nothing from configure_optimizers to use the config's)"
        )
    if not want.client_optimizer and "optimizer" not in config:
        conflicts.append("optimizer: configure_optimizers returns none and the config names none")
    if "scheduler" in config:  # Lightning steps (and checkpoints) the schedulers of configure_optimizers
        conflicts.append(
            "scheduler: the config names one; return the LR scheduler from configure_optimizers instead (Lightning"
            " steps it, holds it on skipped fp16 steps and checkpoints it)"
        )
    if conflicts:
        raise ValueError(
            "The DeepSpeed config disagrees with the Trainer or the strategy:\n  - "
            + "\n  - ".join(conflicts)
            + "\nRemove the key from the config (the strategy fills it in) or make both say the same."
        )
    config.setdefault("steps_per_print", 2**31 - 1)  # the Trainer's loggers report progress
    return config


def check_zero_stage(zero_stage: Any) -> None:
    """DeepSpeed's pipeline engine runs ZeRO-0 and ZeRO-1 only."""
    if zero_stage in (2, 3):
        raise ValueError(
            f"zero_stage={zero_stage}: DeepSpeed's pipeline engine supports ZeRO-0 and ZeRO-1 only (it asserts"
            " on 2 and 3). HybridParallelStrategy shards gradients (ZeRO-2) and parameters (ZeRO-3) inside each"
            " pipeline stage."
        )
    if zero_stage not in (0, 1):
        raise ValueError(f"zero_stage must be 0 or 1, got {zero_stage!r}.")
