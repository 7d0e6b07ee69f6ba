"""``optimizer.state`` and ``optimizer.state_dict()`` of an optimizer ZeRO-1/2 shard, as user code meets them.

Each rank holds the optimizer state of its shard only, keyed by the pieces it steps (``FlatShardedOptimizer``'s
chunks), while the param groups hold the model's parameters outside the step. Looked up by a model parameter,
a plain ``defaultdict`` would answer ``{}`` (and keep it): a callback reading Adam's moments would read nothing,
in silence. Here that lookup raises with where the state is and how to read it; iteration (what Lightning does
to move state between devices) sees this rank's pieces, as before. ``optimizer.state_dict()`` and
``load_state_dict()`` from user code raise the same way (the strategy's checkpoints read and write the shards
themselves)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from torch import Tensor

__all__ = ["ShardedState", "checkpoint_advice", "refuse_whole_state"]


def checkpoint_advice(zero_stage: int) -> str:
    return (
        f"under zero_stage={zero_stage} each data-parallel rank holds the optimizer state of its shard of the"
        " parameters only, keyed by the pieces it steps. Write a checkpoint with trainer.save_checkpoint(path) (any"
        " layout resumes it) and read whole tensors from it with lightning_hybrid.utilities.consolidate_checkpoint("
        "path, prefix='optimizer_0') (keys 'state.<parameter>.<name>'), or use zero_stage=0."
    )


class ShardedState(dict):
    """``optimizer.state`` under ZeRO-1/2: a dict of the chunks' states that refuses the model's parameters."""

    def __init__(self, existing: dict[Any, Any], *, name_of: Callable[[Tensor], str | None], zero_stage: int) -> None:
        super().__init__(existing)
        self._name_of, self._zero_stage = name_of, zero_stage

    def _refuse(self, key: Any) -> NoReturn:
        raise KeyError(f"optimizer.state[{self._name_of(key)}]: {checkpoint_advice(self._zero_stage)}")

    def _model(self, key: Any) -> bool:
        return isinstance(key, Tensor) and self._name_of(key) is not None

    def __missing__(self, key: Any) -> Any:  # as torch's defaultdict(dict), for the chunks the optimizer steps
        if self._model(key):
            self._refuse(key)
        value: dict[str, Any] = {}
        self[key] = value
        return value

    def __contains__(self, key: object) -> bool:
        if self._model(key):
            self._refuse(key)
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        if self._model(key):
            self._refuse(key)
        return super().get(key, default)


def refuse_whole_state(optimizer: Any, module: Any, zero_stage: int) -> None:
    """DeepSpeed's engine: its wrappers (ZeRO-1, bf16, fp16) give the torch optimizer flat partitions to step, so
    its state is keyed by those; the model's parameters are refused there as under the pack's ZeRO-1/2."""
    names = {id(p): n for n, p in module.named_parameters()}
    if any(id(p) in names for g in optimizer.param_groups for p in g["params"]):
        return  # it steps the model's own parameters (ZeRO-0 in fp32): its state is what one process holds
    optimizer.state = ShardedState(optimizer.state, name_of=lambda t: names.get(id(t)), zero_stage=zero_stage)

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"optimizer.state_dict() / load_state_dict(): {checkpoint_advice(zero_stage)}")

    optimizer.state_dict = refuse
    optimizer.load_state_dict = refuse
