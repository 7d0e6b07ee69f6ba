"""Worker: train the example GPT under a given strategy and report per-step losses (one JSON per rank)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from common import ExactDataModule, build_model, rank, run_worker, write_report
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy, PipelineSplit, ZeroConfig
from lightning_hybrid.utilities import consolidate_checkpoint


class RaiseOnRank(Callback):
    """A user callback that fails on one rank only (the others carry on into the next step's collectives)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"user callback failed on rank {self.rank}")


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        spec = getattr(self, "refreeze", None)
        if spec and trainer.global_step == spec["step"] and not hasattr(self, "frozen_at"):
            for p in pl_module.layers[spec["freeze"]].parameters():
                p.requires_grad_(False)
            for p in pl_module.layers[spec["unfreeze"]].parameters():
                p.requires_grad_(True)
            self.frozen_at = {n: p.detach().clone() for n, p in pl_module.layers[spec["freeze"]].named_parameters()}


def make_strategy(spec: dict[str, Any]) -> Any:
    name = spec.get("name", "hybrid")
    if name == "deepspeed_class":
        return DeepSpeedPipelineStrategy(**spec.get("kwargs", {}))
    if name != "hybrid_class":
        return name
    kwargs = dict(spec.get("kwargs", {}))
    if "split" in kwargs:
        kwargs["split"] = PipelineSplit(**kwargs["split"])
    if "zero" in kwargs:
        kwargs["zero"] = ZeroConfig(**kwargs["zero"])
    return HybridParallelStrategy(**kwargs)


def main(cfg: dict[str, Any]) -> None:
    recorder = RecordLoss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", "auto"),
        num_nodes=cfg.get("num_nodes", 1),
        strategy=make_strategy(cfg.get("strategy", {})),
        max_steps=cfg.get("steps", 4),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[recorder, *([RaiseOnRank(**cfg["raise_on_rank"])] if cfg.get("raise_on_rank") else [])],
        **{"limit_val_batches": 0, "num_sanity_val_steps": 0, **cfg.get("trainer", {})},
    )
    if cfg.get("seed_workers"):  # Lightning seeds dataloader workers (by the global rank unless a strategy says)
        L.seed_everything(0, workers=True)
    if cfg.get("seed_by_rank"):  # every rank initialises its own weights (the strategy must agree on rank 0's)
        cfg = {**cfg, "seed": rank()}
    if cfg.get("empty_init"):  # Lightning's way to build a big model: nothing allocated until the strategy
        with trainer.init_module(empty_init=True):
            model = build_model(cfg)
    else:
        model = build_model(cfg)
    if cfg.get("torch_optimizer"):  # one of torch's optimizers in place of the model's own
        optimizer_class = getattr(torch.optim, cfg["torch_optimizer"])
        kwargs = cfg.get("torch_optimizer_kwargs", {"lr": 0.01})
        model.configure_optimizers = lambda: optimizer_class(model.parameters(), **kwargs)
    if cfg.get("refreeze"):  # one block trains, then freezes at a step; another, frozen until then, unfreezes
        spec = cfg["refreeze"]
        for p in model.layers[spec["unfreeze"]].parameters():
            p.requires_grad_(False)
        recorder.refreeze = spec
    if cfg.get("reentrant_head"):  # the head (tied to the embedding) recomputed in backward by a nested backward
        head = model.layers[-1]
        forward = head.forward
        head.forward = lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=True)
    if cfg.get("count_loss_comms"):  # the collectives the loss runs on its logits (DTensor ones), per kind
        from torch.distributed.tensor import DTensor as _DTensor
        from torch.distributed.tensor.debug import CommDebugMode

        loss_fn, seen = model.pipeline_loss, {}

        def counted_loss(output, target):
            with CommDebugMode() as comms:
                loss = loss_fn(output, target)
            if not model.training:  # evaluation: the training steps' record stands
                return loss
            seen["logits"] = [str(p) for p in output.placements] if isinstance(output, _DTensor) else "plain"
            seen["comms"] = {str(k): v for k, v in comms.get_comm_counts().items()}
            return loss

        model.pipeline_loss = counted_loss
    norm_rows: set[int] = set()
    if cfg.get("norm_rows"):  # how many sequence positions each block's first norm computes on, on this rank

        def rows(module, args, output):
            if module.training:  # not the plan check's whole run of a block (eval mode)
                local = output.to_local() if hasattr(output, "to_local") else output
                norm_rows.add(int(local.shape[1]))

        for block in model.layers:
            if hasattr(block, "ln_1"):
                block.ln_1.register_forward_hook(rows)
    params = dict(model.named_parameters())
    for name, value in cfg.get("param_attributes", {}).items():  # a flag set on a parameter before set-up
        params[name].lightning_hybrid_test_flag = value  # (the whole model: every rank builds it all)
    data = ExactDataModule(block_size=model.hparams.block_size, **cfg.get("data", {}))
    trainer.fit(model, datamodule=data, ckpt_path=cfg.get("resume"))
    report: dict[str, Any] = {"rank": rank(), "losses": recorder.losses, "global_step": trainer.global_step}
    if cfg.get("count_loss_comms"):
        report["loss_comms"] = seen
    if cfg.get("norm_rows"):
        report["norm_rows"] = sorted(norm_rows)
    if cfg.get("refreeze"):  # how far the block frozen mid-training moved since (it must not)
        now = dict(model.layers[cfg["refreeze"]["freeze"]].named_parameters())
        report["moved_after_freeze"] = max(float((now[n] - v).abs().max()) for n, v in recorder.frozen_at.items())
    report["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    strategy = trainer.strategy
    if isinstance(strategy, HybridParallelStrategy):
        report["layout"] = {
            "pp": strategy.layout.pipeline_parallel_size,
            "dp": strategy.layout.data_parallel_size,
            "tp": strategy.layout.tensor_parallel_size,
        }
        # the elements of the parameters this rank stores (a DTensor's local part): what tensor parallelism splits
        report["held_numel"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        report["sampler"] = strategy.distributed_sampler_kwargs
        report["reductions"] = strategy.reductions_started()
        check = getattr(strategy, "_plan_check", None)  # the blocks compared with themselves run whole
        report["plan_checked"] = check.checked if check is not None else []
    if cfg.get("report_params"):  # this rank's values of the named parameters it holds (all names of a tie)
        held = dict(model.named_parameters(remove_duplicate=False))
        report["params"] = {
            n: (held[n].full_tensor() if isinstance(held[n], DTensor) else held[n].detach()).tolist()
            for n in cfg["report_params"]
            if n in held
        }
    if cfg.get("param_attributes"):  # the flags on the parameters the optimizer steps after set-up
        params = dict(model.named_parameters())
        report["param_attributes"] = {  # the names this rank holds (a pipeline stage holds its blocks)
            n: getattr(params[n], "lightning_hybrid_test_flag", None) for n in cfg["param_attributes"] if n in params
        }
    if cfg.get("report_attributes"):  # the named weights read as attributes after fit (a DTensor: the whole)
        report["attributes"] = {}
        for name in cfg["report_attributes"]:
            owner, _, attribute = name.rpartition(".")
            value = getattr(model.get_submodule(owner), attribute)
            whole = value.full_tensor() if isinstance(value, DTensor) else value.detach()
            try:  # a hook on the read: on a view made for this read it would never run again
                value.register_hook(lambda grad: grad).remove()
                hook = "registered"
            except RuntimeError as exc:
                hook = "refused: " + str(exc)
            report["attributes"][name] = {"dtensor": isinstance(value, DTensor), "value": whole.tolist(), "hook": hook}
    if cfg.get("validate"):
        results = trainer.validate(model, datamodule=data, verbose=False)
        report["validate"] = results[0] if results else {}
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
        sharded = isinstance(strategy, (HybridParallelStrategy, DeepSpeedPipelineStrategy))
        if cfg.get("weights") and trainer.global_rank == 0 and sharded:
            torch.save(consolidate_checkpoint(cfg["save"]), cfg["weights"])
    elif cfg.get("weights") and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg["weights"])
    write_report(cfg["out"], report)


if __name__ == "__main__":
    run_worker(main)
