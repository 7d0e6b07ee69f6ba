"""Worker (one launch per layout): train every cell of the catalogue under the layout, then resume each
cell from the checkpoint another layout wrote, and report what every rank saw.

Config keys: layout (name), strategy ({"name": "hybrid" | "deepspeed", "kwargs": {...}}), shapes (cells,
``"<shape>/<optimizer>"``), resume ({cell: checkpoint folder written by another layout}), checkpoints (the
root this launch writes its step checkpoints under), out (reports).

Per cell and run, every rank reports: the loss of every batch as the global batch's (the strategy's own under
a pipeline; under pure data parallelism the replicas' losses combined as one process would have them); its
own micro-batch losses, as ``pipeline_loss`` computed them on this rank before any reduction; its own
weights (its stages' parameters and buffers as the module holds them, ZeRO-3's gathered); its data-parallel
rank; rank 0 also the weights consolidated from the final checkpoint. Or the error every rank raised.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import shapes
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from shapes import CHECKPOINT_AT, GLOBAL_BATCH, MAX_STEPS, Shape, TokenMean, build
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_hybrid._torch_compat import default_store
from lightning_hybrid.callbacks import FaultTolerantCheckpoint
from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy, ZeroConfig
from lightning_hybrid.strategies.tensor import tensor_slices
from lightning_hybrid.utilities import consolidate_checkpoint

RANK = int(os.environ.get("RANK", "0"))


class Data(L.LightningDataModule):
    """The shape's dataset in global batches of GLOBAL_BATCH samples, split over the data-parallel ranks."""

    def __init__(self, model: Shape) -> None:
        super().__init__()
        self.dataset = model.dataset()

    def train_dataloader(self) -> DataLoader:
        replicas = self.trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1)
        return DataLoader(self.dataset, batch_size=GLOBAL_BATCH // replicas, shuffle=True)


class Record(Callback):
    """Each batch's loss over the global batch, and (routed experts) which experts each rank used."""

    def __init__(self, pipelined: bool, experts: bool) -> None:
        self.pipelined, self.record_experts = pipelined, experts
        self.losses: list[float] = []
        self.experts: list[list[list[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = float(loss) * (trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1)
        if not self.pipelined and dist.is_initialized() and dist.get_world_size() > 1:
            # each replica's loss is its own batch's: combine them as the global batch's
            count = float(pl_module.pipeline_loss_count(batch[1])) if isinstance(pl_module, TokenMean) else 1.0
            both = torch.tensor([loss * count, count], dtype=torch.float64)
            dist.all_reduce(both)
            loss = float(both[0] / both[1])
        self.losses.append(loss)
        if self.record_experts and dist.is_initialized():  # every rank takes part; a stage without them says []
            router = next((m for m in pl_module.modules() if isinstance(getattr(m, "used", None), set)), None)
            used: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(used, sorted(router.used) if router is not None else None)
            self.experts.append([u for u in used if u is not None])


def make_strategy(spec: dict[str, Any]) -> Any:
    kwargs = dict(spec.get("kwargs", {}))
    if spec["name"] == "deepspeed":
        return DeepSpeedPipelineStrategy(**kwargs)
    if "zero" in kwargs:
        kwargs["zero"] = ZeroConfig(**kwargs["zero"])
    return HybridParallelStrategy(**kwargs)


def train(cfg: dict[str, Any], name: str, *, folder: Path, resume: str | None) -> dict[str, Any]:
    L.seed_everything(0, workers=False, verbose=False)
    model = build(name)
    pipelined = cfg["strategy"]["name"] == "deepspeed" or cfg["strategy"]["kwargs"].get("pipeline_parallel_size", 1) > 1
    record = Record(pipelined, experts=name.partition("/")[0] == "routed-experts")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=make_strategy(cfg["strategy"]),
        max_steps=MAX_STEPS,
        accumulate_grad_batches=model.accumulate,
        **model.trainer_kwargs(),
        callbacks=[
            *model.callbacks(),
            record,
            FaultTolerantCheckpoint(  # a resume continues the folder it resumes from, as a requeued job does
                dirpath=Path(resume).parent if resume else folder / "steps",
                every_n_train_steps=CHECKPOINT_AT,
                keep_last=3,
                hang_timeout=0,
                nan_policy=None,
            ),
        ],
        logger=CSVLogger(folder / "logs", name="", version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    shapes.OWN_LOSSES.clear()
    trainer.fit(model, datamodule=Data(model), ckpt_path=resume)
    own_losses = list(shapes.OWN_LOSSES)
    trainer.save_checkpoint(folder / "final")
    # this rank's own weights, as its module holds them (every rank gathers ZeRO-3's shards, in one order)
    mine = {}
    slices = tensor_slices(trainer.lightning_module)  # tensor-parallel slices: gathered whole, in one order
    for key, value in trainer.lightning_module.state_dict().items():
        if key in slices:
            value = slices[key].as_dtensor(value)
        value = value.full_tensor() if isinstance(value, DTensor) else value
        mine[key] = value.detach().cpu().clone()
    torch.save(mine, folder / f"weights-rank{RANK}.pt")
    report: dict[str, Any] = {
        "losses": record.losses,
        "experts": record.experts,
        "own_losses": own_losses,
        "own_weights": str(folder / f"weights-rank{RANK}.pt"),
        "replica": trainer.strategy.distributed_sampler_kwargs.get("rank", 0) if dist.is_initialized() else 0,
    }
    if trainer.global_rank == 0:
        weights = consolidate_checkpoint(folder / "final")
        torch.save(weights, folder / "weights.pt")
        report["weights"] = str(folder / "weights.pt")
        report["checkpoint"] = str(folder / "steps" / f"step-{CHECKPOINT_AT:09d}")

    return report


def main() -> None:
    faulthandler.enable()  # a rank that crashes (a signal, an abort in a library's thread) prints its stacks
    cfg = json.loads(Path(sys.argv[1]).read_text())
    root = Path(cfg["checkpoints"])
    results: dict[str, Any] = {}
    out = Path(cfg["out"]) / f"rank{RANK}.json"
    for name in cfg["shapes"]:
        results[name] = {}
        runs = [("fresh", None)]
        if cfg.get("resume", {}).get(name):
            runs.append(("resumed", cfg["resume"][name]))
        for run, resume in runs:
            folder = root / name / run
            try:
                results[name][run] = train(cfg, name, folder=folder, resume=resume)
            except (Exception, SystemExit) as exc:  # a refusal (every rank must raise the same), or a signal's exit
                results[name][run] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"error-rank{RANK}.txt").write_text(traceback.format_exc())  # seen even if a rank hangs
                _leave_together(out, results)
        _write(out, results)  # after every cell: a launch that ends early keeps what it decided


def _write(out: Path, results: dict[str, Any]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": RANK, "results": results}))
    tmp.replace(out)


_FAILURES = 0


def _leave_together(out: Path, results: dict[str, Any]) -> None:
    """The ranks leave a failed fit together before the next cell. A rank whose peer is still blocked in a
    collective or a pipeline message the failed fit left (a failure on some ranks only) would wait for it
    forever: after a bounded wait (counted in the job's key-value store, which answers while a peer's main
    thread is blocked) this process ends with what it has decided; the peer's connection to it closes, so
    the peer fails and ends too, and the matrix launches the layout again for the cells left."""
    global _FAILURES
    if not dist.is_initialized():
        return
    _FAILURES += 1
    key = f"conformance/failed/{_FAILURES}"
    try:
        store = default_store()
        store.add(key, 1)
        deadline = time.monotonic() + 30
        while store.add(key, 0) < dist.get_world_size():
            if time.monotonic() > deadline:
                raise TimeoutError(key)
            time.sleep(0.2)
        dist.barrier()
    except Exception:  # a peer is blocked, or gone (its store with it)
        _write(out, results)
        os._exit(3)


if __name__ == "__main__":
    main()
