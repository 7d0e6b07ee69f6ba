"""Worker: try each bad configuration in turn and report the exception every rank raised."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import ExactDataModule, build_model, rank, write_report
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid.callbacks import AccumulationScheduler, FaultTolerantCheckpoint
from lightning_hybrid.plugins import AdaptiveLossScalingPrecision
from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy, PipelineSplit, ZeroConfig


class NoContract(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


CASES: dict[str, dict[str, Any]] = {
    "sizes": {"strategy": {"pipeline_parallel_size": 3}},
    "dp_sizes": {"strategy": {"pipeline_parallel_size": 2, "data_parallel_size": 2}},
    "too_few_blocks": {"strategy": {"pipeline_parallel_size": 2, "schedule": "interleaved_1f1b"}, "n_layer": 1},
    "empty_stage": {"strategy": {"pipeline_parallel_size": 2, "split": {"layers_per_stage": [6, 0]}}},
    "batch_not_divisible": {"strategy": {"pipeline_parallel_size": 2, "num_microbatches": 3}},
    "too_few_microbatches": {"strategy": {"pipeline_parallel_size": 2, "num_microbatches": 1}},
    "zero3_zero_bubble": {"strategy": {"pipeline_parallel_size": 2, "zero_stage": 3, "schedule": "zbv_zero_bubble"}},
    "unknown_schedule": {"strategy": {"pipeline_parallel_size": 2, "schedule": "2f2b"}},
    "no_contract": {"strategy": {"pipeline_parallel_size": 2}, "module": "no_contract"},
    # tied embeddings across the two stages: what cannot stay exact is refused before step 0
    "tied_zero2_buckets": {"strategy": {"pipeline_parallel_size": 2, "zero_stage": 2}, "tie": True},
    "tied_groups_differ": {"strategy": {"pipeline_parallel_size": 2}, "tie": True, "groups_by_name": True},
    # DeepSpeedPipelineStrategy: what its engine cannot do fails at set-up, before the engine is built
    "ds_tied": {"deepspeed": {}, "tie": True},
    "ds_accumulation_scheduler": {"deepspeed": {}, "accumulation": True},
    "ds_adaptive_loss_scaling": {"deepspeed": {}, "plugin": True},
    "ds_config_conflicts": {
        "deepspeed": {"config": {"gradient_accumulation_steps": 3, "gradient_clipping": 1.0}},
        "trainer": {"gradient_clip_val": 0.5},
    },
    "ds_batch_not_divisible": {"deepspeed": {"num_microbatches": 3}},
    "ds_meta_device": {"deepspeed": {}, "meta": True},
    "ds_nan_policy_skip": {"deepspeed": {}, "ft": True},
    "ds_predict": {"deepspeed": {}, "predict": True},
    # a module an earlier Trainer cut into stages is not cut again (these two train a step first)
    "hybrid_cut_twice": {"strategy": {"pipeline_parallel_size": 2}, "twice": True},
    "ds_cut_twice": {"deepspeed": {}, "twice": True},
    # after the first step a callback moves the head's parameters (last stage only) into a group of their own
    "group_moved_on_one_stage": {"strategy": {"pipeline_parallel_size": 2, "zero_stage": 1}, "move_group": True},
    # without a pipeline the failure is agreed by the step's reduction (no collective of its own): on one replica
    # only, and on every replica
    "group_moved_on_one_replica": {"strategy": {"data_parallel_size": 2, "zero_stage": 1}, "move_group": "rank1"},
    # a backward in on_after_backward, on rank 1 only: its gradients would reach the mean after it was reduced
    **{
        f"zero{z}_late_gradient_on_one_rank": {"strategy": {"data_parallel_size": 2, "zero_stage": z}, "late": True}
        for z in (0, 1, 2)
    },
    "zero2_once_late_gradient_on_one_rank": {
        "strategy": {"data_parallel_size": 2, "zero_stage": 2, "zero": {"reduce_gradients": "once_per_step"}},
        "late": True,
    },
    "group_moved_on_every_replica": {"strategy": {"data_parallel_size": 2, "zero_stage": 2}, "move_group": True},
    # rank 1's training_step returns None on its second batch (after its forward): refused on both ranks
    **{
        f"zero{z}_skip_on_one_rank": {"strategy": {"data_parallel_size": 2, "zero_stage": z}, "skip": 1}
        for z in range(4)
    },
    "zero2_once_skip_on_one_rank": {
        "strategy": {"data_parallel_size": 2, "zero_stage": 2, "zero": {"reduce_gradients": "once_per_step"}},
        "skip": 1,
    },
    # 2 micro-batches per step: the skipped one is the window's first (no reduction in its backward) or its last
    **{
        name: {
            "strategy": {"data_parallel_size": 2, "zero_stage": z},
            "skip": b,
            "trainer": {"accumulate_grad_batches": 2},
        }
        for name, z, b in (
            ("zero0_skip_accumulating", 0, 2),
            ("zero1_skip_closing", 1, 3),
            ("zero2_skip_accumulating", 2, 2),
        )
    },
    # a backward that communicates beyond the buckets (a gather with gradients), a counted loss's first batch (its
    # count is agreed after training_step): agreed at once
    "zero0_skip_gather_with_grads": {"strategy": {"data_parallel_size": 2, "zero_stage": 0}, "skip": 1, "gather": True},
    "zero1_skip_counted": {"strategy": {"data_parallel_size": 2, "zero_stage": 1}, "skip": 0, "counted": True},
    # a block of the last stage that breaks the pipeline contract (returns a dict) or raises in its forward: the
    # first stage holds neither, and must fail with the same message instead of a closed connection (one job each)
    **{
        name: {"strategy": {"pipeline_parallel_size": 2}, "bad_block": how, "alone": True}
        for name, how in (
            ("block_returns_dict_on_one_stage", "dict"),
            ("block_raises_on_one_stage", "raise"),
            ("first_stage_block_returns_dict", "dict0"),
            ("first_stage_block_changes_shape", "shape0"),
            ("block_raises_at_step_2", "raise_later"),
        )
    },
    # tensor parallelism: a plan that cannot split the module is refused before any block is split
    "tp_no_plan": {"strategy": {"tensor_parallel_size": 2}, "module": "no_contract"},
    "tp_plan_names_no_module": {"strategy": {"tensor_parallel_size": 2}, "plan": "missing"},
    "tp_block_without_plan": {"strategy": {"tensor_parallel_size": 2}, "plan": "none"},
    "tp_heads": {"strategy": {"tensor_parallel_size": 2}, "model": {"n_head": 1}},
    "tp_vocabulary": {"strategy": {"tensor_parallel_size": 2}, "model": {"vocab_size": 63}},
    "tp_tie_split_differently": {"strategy": {"tensor_parallel_size": 2}, "tie": True, "plan": "untied_split"},
    "ds_tensor_parallel": {"deepspeed": {"tensor_parallel_size": 2}},
    "tp_optimizer_not_elementwise": {"strategy": {"tensor_parallel_size": 2}, "adafactor": True},
    # every rank skips the same batch: Lightning's own refusal, on every rank
    "zero1_skip_on_every_rank": {"strategy": {"data_parallel_size": 2, "zero_stage": 1}, "skip": 1, "everywhere": True},
    # layouts that train: with the cases above they are run again at the end (AGAIN)
    "tp2_trains": {"strategy": {"tensor_parallel_size": 2}},
    "pp2_tied_trains": {"strategy": {"pipeline_parallel_size": 2}, "tie": True},
}
# run a second time after every case: their Trainers must reuse the process groups the first ones made (mesh,
# skip flags, tensor-parallel norm, tied weights), not add groups (threads) of their own
AGAIN = ("zero1_skip_on_one_rank", "tp2_trains", "pp2_tied_trains")


class MoveHeadToNewGroup(Callback):
    """Regroups parameters after set-up, which ZeRO-1/2 cannot reshard; only the last stage holds the head
    (``only_rank``: on that rank only)."""

    def __init__(self, only_rank: int | None = None) -> None:
        self.only_rank = only_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 1 or self.only_rank not in (None, rank()):
            return
        optimizer = trainer.optimizers[0]
        moved = [p for n, p in pl_module.named_parameters() if "head" in n]
        if moved:
            ids = {id(p) for p in moved}
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in ids]
            optimizer.add_param_group({"params": moved, "lr": 0.01})


class BackwardAfterBackward(Callback):
    """On rank 1 only, a second backward after the step's own (reaching the first parameter) from its second step."""

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step >= 1 and rank() == 1:
            next(pl_module.parameters()).square().sum().backward()


def skipping(model: L.LightningModule, case: dict[str, Any]) -> Any:
    """``training_step`` that runs its forward everywhere, then returns None for batch ``case["skip"]`` on rank 1
    (on every rank with ``everywhere``); with ``gather``, the loss is the replicas' mean through
    ``all_gather(sync_grads=True)`` (its backward communicates)."""
    step, everywhere = model.training_step, case.get("everywhere", False)

    def training_step(batch: Any, batch_idx: int) -> Any:
        loss = step(batch, batch_idx)
        if case.get("gather"):
            loss = model.all_gather(loss, sync_grads=True).mean()
        return None if (everywhere or rank() == 1) and batch_idx == case["skip"] else loss

    return training_step


def break_last_block(model: L.LightningModule, how: str) -> None:
    """A block breaks the contract: the last one (last stage) returns a dict or raises (at once, or from the
    third call); with ``0``, the first stage's last block returns a dict or, from its third call, a tensor of
    another shape."""
    block = model.layers[len(model.layers) // 2 - 1] if how.endswith("0") else model.layers[-1]
    forward = block.forward
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        out = forward(*args, **kwargs)
        if how == "raise" or (how == "raise_later" and calls[0] > 2):
            raise ValueError("a bug in the user's block")
        if how.startswith("dict"):
            return {"hidden": out}
        if how == "shape0" and calls[0] > 2:
            return out[:, :-1].contiguous()
        return out

    block.forward = broken


def groups_by_name(model: L.LightningModule) -> torch.optim.Optimizer:
    """A name-keyed parameter-group rule that tells the two names of a tied parameter apart."""
    named = list(model.named_parameters())
    head = [p for n, p in named if "head" in n]
    rest = [p for n, p in named if "head" not in n]
    return torch.optim.SGD([{"params": head, "lr": 0.1}, {"params": rest, "lr": 0.2}])


def broken_plan(model: L.LightningModule, how: str) -> None:
    """The example's tensor-parallel plan, broken: a name no submodule has, None for the transformer blocks,
    or the token embedding split by columns while the head it is tied to splits by rows."""
    plan = model.tensor_parallel_plan

    def tensor_parallel_plan(name: str, block: torch.nn.Module) -> Any:
        given = plan(name, block)
        if how == "missing" and "attn.q" in given:
            return {**given, "attn.query": ColwiseParallel()}
        if how == "none" and "attn.q" in given:
            return None
        if how == "untied_split" and "token" in given:
            return {"token": ColwiseParallel()}
        return given

    model.tensor_parallel_plan = tensor_parallel_plan


def make_strategy(case: dict[str, Any]) -> Any:
    if "deepspeed" in case:
        return DeepSpeedPipelineStrategy(pipeline_parallel_size=2, **case["deepspeed"])
    kwargs = dict(case["strategy"])
    if "zero" in kwargs:
        kwargs["zero"] = ZeroConfig(**kwargs["zero"])
    if "split" in kwargs:
        kwargs["split"] = PipelineSplit(**kwargs["split"])
    return HybridParallelStrategy(**kwargs)


def attempt(case: dict[str, Any]) -> str:
    try:
        strategy = make_strategy(case)
        if case.get("module") == "no_contract":
            model: L.LightningModule = NoContract()
        else:
            tie = case.get("tie", False)
            model = build_model(
                {
                    "model": {
                        "n_layer": case.get("n_layer", 4),
                        "tie_embeddings": tie,
                        "build_on_meta": bool(case.get("meta")),
                        **case.get("model", {}),
                    }
                }
            )
        if case.get("plan"):
            broken_plan(model, case["plan"])
        if case.get("adafactor"):  # factors each matrix's second moment: a slice's factors are not the tensor's
            model.configure_optimizers = lambda: torch.optim.Adafactor(model.parameters())
        if case.get("bad_block"):
            break_last_block(model, case["bad_block"])
        if case.get("groups_by_name"):
            model.configure_optimizers = lambda: groups_by_name(model)
        if "skip" in case:
            model.training_step = skipping(model, case)
        if case.get("counted"):  # a loss that is a mean over a count of elements (agreed every micro-batch)
            model.pipeline_loss_count = lambda target: target.numel()
        callbacks: list[Any] = [AccumulationScheduler(schedule={0: 2})] if case.get("accumulation") else []
        if case.get("late"):
            callbacks.append(BackwardAfterBackward())
        if case.get("move_group"):
            callbacks.append(MoveHeadToNewGroup(1 if case["move_group"] == "rank1" else None))
        if case.get("ft"):  # its default nan_policy, checkpoints under this job's own folder
            callbacks.append(FaultTolerantCheckpoint(dirpath=str(Path(OUT) / "ft-ckpt")))
        plugins = [AdaptiveLossScalingPrecision()] if case.get("plugin") else []
        steps = 3 if case.get("move_group") or case.get("late") or "skip" in case else 1
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=bool(case.get("ft")), enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, limit_val_batches=0, callbacks=callbacks, plugins=plugins,
            **case.get("trainer", {}),
        )  # fmt: skip
        data = ExactDataModule(block_size=16, global_batch=8)
        if case.get("predict"):
            tokens = torch.zeros(8, 16, dtype=torch.long)
            trainer.predict(model, dataloaders=DataLoader(TensorDataset(tokens, tokens), batch_size=8))
        else:
            trainer.fit(model, datamodule=data)
        if case.get("twice"):  # a new Trainer (and strategy) on the module the first one cut
            again = L.Trainer(
                accelerator="cpu", devices=2, strategy=make_strategy(case), logger=False, enable_progress_bar=False,
                enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=1,
            )  # fmt: skip
            again.validate(model, datamodule=ExactDataModule(block_size=16, global_batch=8), verbose=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


OUT = "."  # this job's folder (set in main)


def main(cfg: dict[str, Any]) -> None:
    global OUT
    OUT = cfg["out"]
    cases = {
        name: case
        for name, case in CASES.items()
        if (name in cfg["only"] if cfg.get("only") else not case.get("alone"))  # "alone": a job of its own
    }
    report: dict[str, Any] = {"rank": rank(), "errors": {name: attempt(case) for name, case in cases.items()}}
    if not cfg.get("only"):
        threads = len(os.listdir("/proc/self/task"))  # gloo's native threads included
        report["again"] = {name: attempt(CASES[name]) for name in AGAIN}
        report["threads"] = [threads, len(os.listdir("/proc/self/task"))]
    write_report(cfg["out"], report)


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
