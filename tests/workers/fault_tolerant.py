"""Worker: train the example GPT with FaultTolerantCheckpoint, inject a failure, report what every rank saw.

Config keys (besides train_gpt's strategy/devices/steps/model/trainer):
    ft: FaultTolerantCheckpoint kwargs;  data: CharDataModule kwargs;  resume: ckpt_path for fit
    inject: {"kill"|"signal"|"nan"|"hang"|"kill_in_write": {"step": k, "rank": r, "attempt": a}}
        kill: SIGKILL the rank at the end of optimizer step k (before the checkpoint of that step)
        kill_batch: SIGKILL the rank at the end of batch {"batch": b} (counted over epochs), mid-window or not
        signal: send itself SIGTERM (or inject.signal.name) at the start of the batch after step k
        nan: the loss of step k+1 on that rank is NaN
        hang: the rank sleeps for an hour at the start of the batch after step k (first touching "marker")
        kill_in_write: SIGKILL the rank half-way through writing the checkpoint file of step k
        fail_write: every file write of checkpoint k raises OSError on that rank
        fail_dcp_write: every DCP data file write of checkpoint k raises OSError on that rank (inside DCP's save)
        slow_write: every file write of checkpoint k on that rank first sleeps {"seconds": s}
        inf: one gradient element of that rank is set to inf in the window of step k+1
        signal_in_validation: send SIGTERM at validation batch {"batch": b} (sanity check included)
        slow_validation: every validation batch sleeps {"seconds": s}
        vanish: the checkpoint folder {"dirpath": d} disappears at the start of the batch after step k
        progress: every rank writes its global step to out/progress<R> after each batch (for outside kills)
        samples: every rank appends {"step", "dp", "rows"} to <samples>-rank<R>.jsonl at each batch (the step the
            batch belongs to, its data-parallel rank, a CRC-32 per sample), flushed at once
    plugin: AdaptiveLossScalingPrecision kwargs ("config": LossScaleConfig kwargs)
    accumulation: AccumulationScheduler kwargs
    weights: where rank 0 writes the final consolidated state_dict
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import rank, write_report
from gpt import GPT, CharDataModule
from lightning.pytorch.callbacks import Callback
from train_gpt import make_strategy

from lightning_hybrid._protocols import ShardedCheckpointing
from lightning_hybrid.callbacks import AccumulationScheduler, FaultTolerantCheckpoint
from lightning_hybrid.callbacks._writer import CheckpointWriter
from lightning_hybrid.plugins import AdaptiveLossScalingPrecision, LossScaleConfig
from lightning_hybrid.utilities import consolidate_checkpoint

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _armed(spec: dict[str, Any] | None) -> bool:
    """Whether an injection applies to this rank (``"rank": -1``: every rank) in this attempt."""
    return bool(spec) and spec.get("rank", 0) in (rank(), -1) and spec.get("attempt", 0) == ATTEMPT


class Injector(Callback):
    """Failures at chosen steps; placed before FaultTolerantCheckpoint so a kill at step k beats its save."""

    def __init__(self, inject: dict[str, Any]) -> None:
        self.inject = inject
        self.validation_batches = 0
        self.validation_signalled_at: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if "samples" in self.inject:
            self._record_samples(trainer, batch)
        inf = self.inject.get("inf")
        if _armed(inf) and step == inf["step"]:
            self._poison_next_backward(pl_module)
        sig = self.inject.get("signal")
        if _armed(sig) and step == sig["step"]:
            os.kill(os.getpid(), getattr(signal, sig.get("name", "SIGTERM")))
        hang = self.inject.get("hang")
        if _armed(hang) and step == hang["step"]:
            if "marker" in hang:
                tmp = Path(hang["marker"] + ".tmp")
                tmp.write_text(str(os.getpid()))
                tmp.replace(hang["marker"])  # tells the test this rank is stuck, and its process
            time.sleep(3600)
        vanish = self.inject.get("vanish")
        if _armed(vanish) and step == vanish["step"]:
            root = Path(vanish["dirpath"])
            root.rename(root.with_name(root.name + ".gone"))  # the mount went away under the job

    def _record_samples(self, trainer, batch) -> None:
        path = Path(f"{self.inject['samples']}-rank{rank()}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        dp = trainer.strategy.distributed_sampler_kwargs.get("rank", 0) if trainer.world_size > 1 else 0
        rows = [zlib.crc32(row.numpy().tobytes()) for row in batch[0]]
        with open(path, "a") as f:  # one line per batch, on disk before the batch runs
            f.write(json.dumps({"step": trainer.global_step + 1, "dp": dp, "rows": rows}) + "\n")

    def _poison_next_backward(self, pl_module) -> None:
        # a gradient hook, as an overflow happens: inside backward, before any strategy reduces or hands off
        # the gradient (ZeRO-2 reduces buckets during backward: .grad is gone by on_after_backward)
        param = next(p for p in pl_module.parameters() if p.requires_grad)

        def poison(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        self._poison = param.register_hook(poison)

    def on_train_start(self, trainer, pl_module) -> None:
        # what was loaded (the pointer moves on as this run saves)
        self.resumed = str(Path(trainer.ckpt_path).resolve()) if trainer.ckpt_path else "-"

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        slow = self.inject.get("slow_validation")
        if slow:
            time.sleep(slow["seconds"])
        sig = self.inject.get("signal_in_validation")
        if _armed(sig) and batch_idx == sig["batch"] and trainer.global_step == sig.get("step", trainer.global_step):
            self.validation_signalled_at = batch_idx
            os.kill(os.getpid(), getattr(signal, sig.get("name", "SIGTERM")))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.validation_batches += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(self, "_poison", None) is not None:
            self._poison.remove()
            self._poison = None
        if "progress" in self.inject:
            path = Path(self.inject["progress"]) / f"progress{rank()}"
            path.with_suffix(".tmp").write_text(json.dumps([trainer.global_step, os.getpid(), self.resumed]))
            path.with_suffix(".tmp").replace(path)
        kill = self.inject.get("kill")
        if _armed(kill) and trainer.global_step == kill["step"]:
            os.kill(os.getpid(), signal.SIGKILL)
        kill = self.inject.get("kill_batch")
        if _armed(kill) and trainer.fit_loop.total_batch_idx == kill["batch"]:
            os.kill(os.getpid(), signal.SIGKILL)


class Recorder(Callback):
    """Per optimizer step: loss, LR (the one the update used, and the one after the scheduler), and a digest
    of this rank's parameters after the step.

    The digest is taken when the next batch starts (and at the end), so it includes whatever
    FaultTolerantCheckpoint did after the step: Lightning runs checkpoint callbacks last.
    """

    def __init__(self, window_loss: bool = False) -> None:
        self.steps: dict[int, dict[str, float]] = {}
        self.window_loss = window_loss  # also the mean loss of each step's whole window over all ranks
        self._window: list[float] = []

    @staticmethod
    def _digest(pl_module) -> float:
        local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in pl_module.parameters()]
        return float(sum(t.double().abs().sum() for t in local))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.setdefault(trainer.global_step, {})["digest"] = self._digest(pl_module)
        if not hasattr(self, "_last_step"):
            self._last_step = trainer.global_step  # the step a resumed run starts from
        # the LR this update uses (the step it completes is global_step + 1; the LR does not change inside a
        # window). Read here, not in on_before_optimizer_step: DeepSpeed's engine refuses gradient hooks
        self.steps.setdefault(trainer.global_step + 1, {})["lr_used"] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        entry = self.steps.setdefault(trainer.global_step, {})
        entry["loss"] = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        if self.window_loss:
            # comparable across worlds: the window's micro-batches x replicas (each rank its own batches' mean)
            # Lightning reports each micro-batch's loss divided by the accumulation
            self._window.append(entry["loss"] * trainer.accumulate_grad_batches)
            self._tokens = getattr(self, "_tokens", 0) + int(batch[0].long().sum())  # which samples it saw
            if trainer.global_step != getattr(self, "_last_step", 0):
                mean = torch.tensor([sum(self._window) / len(self._window), self._tokens], dtype=torch.float64)
                if torch.distributed.is_initialized():
                    torch.distributed.all_reduce(mean)
                    mean[0] /= torch.distributed.get_world_size()
                entry["window_loss"], entry["window_tokens"] = float(mean[0]), int(mean[1])
                self._window, self._tokens = [], 0
            self._last_step = trainer.global_step
        entry["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        plugin = trainer.precision_plugin
        if hasattr(plugin, "loss_scale"):
            entry["scale"] = plugin.loss_scale
            entry["skipped"] = plugin.last_step_skipped

    def on_train_end(self, trainer, pl_module) -> None:
        self.steps.setdefault(trainer.global_step, {})["digest"] = self._digest(pl_module)


class NanGPT(GPT):
    """The example model whose loss is NaN on one rank at one step."""

    nan_spec: dict[str, Any] | None = None

    def pipeline_loss(self, output, target):
        loss = super().pipeline_loss(output, target)
        if _armed(self.nan_spec) and self.trainer.global_step == self.nan_spec["step"]:
            loss = loss * float("nan")
        return loss


def _kill_in_write(spec: dict[str, Any]) -> None:
    """Make the write of checkpoint ``step``'s first file stop half-way with SIGKILL (as a node loss would)."""
    original = CheckpointWriter.write_file

    def atomic_write(path, write):
        if f"step-{spec['step']:09d}" in str(path):

            def half(f):
                import io

                buf = io.BytesIO()
                write(buf)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            return original(path, half)
        return original(path, write)

    CheckpointWriter.write_file = staticmethod(atomic_write)


def _fail_write(spec: dict[str, Any]) -> None:
    """Make every file write of checkpoint ``step`` raise, as a full disk would."""
    original = CheckpointWriter.write_file

    def atomic_write(path, write):
        if f"step-{spec['step']:09d}" in str(path):
            raise OSError(28, "No space left on device (injected)")
        return original(path, write)

    CheckpointWriter.write_file = staticmethod(atomic_write)


def _fail_dcp_write(spec: dict[str, Any]) -> None:
    """Make DCP's own file writes of checkpoint ``step`` raise, as a full disk would (inside its collective save)."""
    from lightning_hybrid.checkpoint._files import AtomicFileSystem

    original = AtomicFileSystem.create_stream

    def create_stream(self, path, mode):
        if "w" in mode and f"step-{spec['step']:09d}" in str(path):
            raise OSError(28, "No space left on device (injected into DCP)")
        return original(self, path, mode)

    AtomicFileSystem.create_stream = create_stream


def _slow_write(spec: dict[str, Any]) -> None:
    """Make every file write of checkpoint ``step`` take ``seconds`` longer (a slow or congested filesystem)."""
    original = CheckpointWriter.write_file

    def atomic_write(path, write):
        if f"step-{spec['step']:09d}" in str(path):
            if "marker" in spec:
                Path(spec["marker"]).touch()  # tells the test the write has begun
            time.sleep(spec["seconds"])
        return original(path, write)

    CheckpointWriter.write_file = staticmethod(atomic_write)


def main(cfg: dict[str, Any]) -> None:
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a test that finds the job hung asks for stacks
    # Ctrl-C as a terminal's foreground job gets it: a job started in the background by a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no handler for it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    inject = cfg.get("inject", {})
    if _armed(inject.get("kill_in_write")):
        _kill_in_write(inject["kill_in_write"])
    if _armed(inject.get("fail_write")):
        _fail_write(inject["fail_write"])
    if _armed(inject.get("fail_dcp_write")):
        _fail_dcp_write(inject["fail_dcp_write"])
    if _armed(inject.get("slow_write")):
        _slow_write(inject["slow_write"])
    L.seed_everything(cfg.get("seed", 0), workers=True)
    model_cfg = {"vocab_size": 64, "n_layer": 2, "d_model": 32, "n_head": 2, "block_size": 16, **cfg.get("model", {})}
    NanGPT.nan_spec = inject.get("nan")
    model = NanGPT(**model_cfg)
    data = CharDataModule(block_size=model_cfg["block_size"], **{"batch_size": 4, **cfg.get("data", {})})
    ft = FaultTolerantCheckpoint(**cfg["ft"])
    extra: list[Any] = []
    if "accumulation" in cfg:
        acc = cfg["accumulation"]
        extra.append(AccumulationScheduler(**{**acc, "schedule": {int(k): v for k, v in acc["schedule"].items()}}))
    plugins = []
    if "plugin" in cfg:
        kwargs = dict(cfg["plugin"])
        kwargs["config"] = LossScaleConfig(**kwargs.get("config", {}))
        plugins.append(AdaptiveLossScalingPrecision(**kwargs))
    recorder = Recorder(window_loss=cfg.get("window_loss", False))
    injector = Injector(inject)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.get("devices", int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        # the nodes of this attempt (torchrun --nnodes=MIN:MAX: a restart may see fewer)
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=make_strategy(cfg.get("strategy", {"name": "ddp"})),
        max_steps=cfg.get("steps", 8),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[injector, ft, recorder, *extra],
        plugins=plugins,
        **{"limit_val_batches": 0, "num_sanity_val_steps": 0, **cfg.get("trainer", {})},
    )
    report: dict[str, Any] = {"rank": rank(), "attempt": ATTEMPT, "pid": os.getpid()}
    write_report(cfg["out"], {**report, "started": True})
    try:
        trainer.fit(model, datamodule=data, ckpt_path=cfg.get("resume", "last"))
    except SystemExit as exc:
        report["exit_code"] = exc.code
        report["steps"] = recorder.steps
        report["global_step"] = trainer.global_step
        report["validation_batches"] = injector.validation_batches
        report["validation_signalled_at"] = injector.validation_signalled_at
        write_report(cfg["out"], report)
        raise
    report.update(
        {
            "steps": recorder.steps,
            "global_step": trainer.global_step,
            "rollbacks": ft.rollbacks,
            "nonfinite_steps": ft.nonfinite_steps,
            "last_model_path": ft.last_model_path,
            "plugin": trainer.precision_plugin.state_dict() if plugins else None,
            "accumulation": extra[0].state_dict() if extra else None,
            "resumed_from": ft.resumed_from,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "validation_batches": injector.validation_batches,
        }
    )
    if cfg.get("weights") and isinstance(trainer.strategy, ShardedCheckpointing):
        if trainer.global_rank == 0:
            torch.save(consolidate_checkpoint(ft.last_model_path), cfg["weights"])
    elif cfg.get("weights") and trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, cfg["weights"])
    write_report(cfg["out"], report)


if __name__ == "__main__":
    config = json.loads(Path(sys.argv[1]).read_text())
    try:
        main(config)
    except SystemExit:
        raise
    except BaseException as exc:
        write_report(
            config["out"],
            {"rank": rank(), "attempt": ATTEMPT, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()},
        )
        raise
