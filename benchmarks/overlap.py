"""Communication hidden behind compute: step time of every data-parallel path relative to Lightning's DDP.

    python benchmarks/overlap.py                       # 2 CPU processes (gloo); 2+ GPUs (NCCL) if present
    python benchmarks/overlap.py --repeats 5 --steps 20 --out benchmarks/results

One run measures, side by side on the same model and data: Lightning's DDP, Lightning's
``ModelParallelStrategy`` (FSDP2), and ``HybridParallelStrategy`` at ZeRO-0, ZeRO-1, ZeRO-2 (both
``reduce_gradients`` settings) and ZeRO-3 (default units and ``"submodules"``), each with K=1 and K=4
micro-batches per step, and a second DDP Trainer (its ratio to the first is the measurement's own noise). One
more row is DDP plus the bytes ZeRO-2's default moves beyond DDP's (a reduce-scatter after each backward that
does not close the window): on a machine where nothing overlaps, about the fastest a ZeRO-2 can be that never
holds the full gradient between micro-batches.
A round is one ``torchrun`` job of this file (``--worker``) that fits every configuration of one K at once,
each in a thread of the same processes, one optimizer step of each in turn, in an order shuffled anew each
cycle (``--interleave steps``, the default without a GPU): the steps of every configuration are seconds apart
all through the round, so a slow spell of the machine (on a shared 2-core host, 20% for tens of seconds)
falls on all of them alike. On GPUs, whose model fills the device once, the configurations are fitted one
after the other instead (``--interleave trainers``). Rounds are repeated, their order rotated. The step time
is the median over the steps after warm-up, measured from Lightning's batch start to batch end
(the Lightning layer included).

Printed per row: the step time relative to DDP's in the same round (median over rounds, and the spread
min-max), and the share of communication hidden behind compute:
``1 - (step - compute) / communication``, where ``compute`` is the same per-rank work in one-process
jobs running side by side, one per rank (no collective), and ``communication`` is the configuration's
collectives for one step timed alone on the same processes (sizes from the model). 1.0: the collectives
cost nothing on top of compute; 0.0: they add their whole time. On a GPU the table adds per-GPU tokens/s,
MFU of the example GPT and the peak ``torch.cuda.max_memory_allocated``.

``--host-allocator keep-freed`` (results in ``overlap_cpu_keep_freed.txt``) has glibc keep freed host memory
for reuse, as CUDA's caching allocator keeps device memory. By default glibc hands large freed blocks back to
the system, and a buffer allocated afresh every micro-batch (ZeRO-2's buckets, ZeRO-0's) pays a page fault
per 4 KiB touched again; on a GPU it would not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job, sharded_gpt  # noqa: E402

EXTRA = "DDP + ZeRO-2's extra reduce-scatters"
# name: strategy spec ("ddp", "ddp+reduce-scatters", "fsdp2", or HybridParallelStrategy kwargs)
CONFIGS: dict[str, Any] = {
    "DDP (Lightning)": "ddp",
    "FSDP2 (ModelParallelStrategy)": "fsdp2",
    "hybrid ZeRO-0": {"zero_stage": 0},
    "hybrid ZeRO-1": {"zero_stage": 1},
    "hybrid ZeRO-2 every_microbatch": {"zero_stage": 2},
    "hybrid ZeRO-2 once_per_step": {"zero_stage": 2, "zero": {"reduce_gradients": "once_per_step"}},
    # the default units ("auto"): this model's 3 MB blocks whole, as the baseline gathers them
    "hybrid ZeRO-3": {"zero_stage": 3},
    # a unit per parameter-holding child of a block: less gathered at once, more (latency-bound) collectives
    "hybrid ZeRO-3 shard_units=submodules": {"zero_stage": 3, "zero": {"shard_units": "submodules"}},
    # Lightning's DDP plus the bytes ZeRO-2's default moves beyond DDP's: after each backward that does not
    # close the window, one reduce-scatter of a gradient-sized buffer (see ``_extra_reductions``)
    EXTRA: "ddp+reduce-scatters",
    # a second, identical DDP Trainer (last: fitted Trainer by Trainer, not right after the first): its ratio
    # to the first is what the measurement itself varies by
    "DDP (Lightning), again": "ddp",
}
FSDP2 = "FSDP2 (ModelParallelStrategy)"
BASELINE = {FSDP2: None, "hybrid ZeRO-3": FSDP2, "hybrid ZeRO-3 shard_units=submodules": FSDP2}

# ------------------------------------------------------------------------------------------------ worker


def _model(cfg: dict[str, Any]) -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT

    kwargs = dict(
        vocab_size=cfg["vocab_size"], block_size=cfg["block_size"], n_layer=cfg["n_layer"],
        d_model=cfg["d_model"], n_head=8, optimizer="adamw", dropout=0.0,
    )  # fmt: skip
    return (sharded_gpt() if cfg["strategy"] == "fsdp2" else GPT)(**kwargs)


def _strategy(cfg: dict[str, Any]) -> Any:
    from lightning_hybrid.strategies import HybridParallelStrategy, ZeroConfig

    spec = cfg["strategy"]
    if cfg["devices"] == 1:
        return "auto"
    if spec in ("ddp", "ddp+reduce-scatters"):
        return "ddp"
    if spec == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=cfg["devices"], tensor_parallel_size=1)
    kwargs = dict(spec)
    if "zero" in kwargs:
        kwargs["zero"] = ZeroConfig(**kwargs["zero"])
    return HybridParallelStrategy(data_parallel_size=cfg["devices"], **kwargs)


def _reduce_scatter(out: Any, flat: Any, world: int) -> None:
    import torch.distributed as dist

    try:
        dist.reduce_scatter_single(out, flat)
    except (RuntimeError, NotImplementedError):  # a backend without it: the same bytes by an all-reduce
        dist.all_reduce(flat)


def _timed(fn: Any, device: Any) -> float:
    """Median seconds of ``fn`` over 4 calls after 2 of warm-up, every rank starting together (a work handle
    that ``fn`` returns is waited for)."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(6):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if out is not None:
            out.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _communication_alone(cfg: dict[str, Any], psi: int, device: Any) -> float:
    """Seconds of the collectives this configuration issues in one optimizer step, timed alone."""
    import torch
    import torch.distributed as dist

    from lightning_hybrid.strategies.zero.collectives import gather_shards, reduce_to_owners

    spec, world, k = cfg["strategy"], dist.get_world_size(), cfg["accumulation"]
    n = -(-psi // world) * world
    flat = torch.randn(n, device=device)
    shard = torch.randn(n // world, device=device)
    outs = [torch.empty_like(shard) for _ in range(world)]

    group, s = dist.group.WORLD, n // world
    pieces = [(r, r * s, (r + 1) * s) for r in range(world)]

    def one_step() -> None:  # ZeRO-1/2 with the pack's own collectives
        zero = None if isinstance(spec, str) else spec["zero_stage"]
        once = isinstance(spec, dict) and spec.get("zero", {}).get("reduce_gradients") == "once_per_step"
        if spec == "ddp" or zero == 0:
            dist.all_reduce(flat)
        elif spec == "ddp+reduce-scatters":
            for _ in range(k - 1):
                reduce_to_owners(flat, pieces, group).wait()
            dist.all_reduce(flat)
        elif zero in (1, 2):
            for _ in range(1 if once or zero == 1 else k):
                reduce_to_owners(flat, pieces, group).wait()
        else:  # FSDP2: gather for forward and backward, reduce-scatter, every micro-batch
            for _ in range(k):
                dist.all_gather(outs, shard)
                dist.all_gather(outs, shard)
                _reduce_scatter(shard, flat, world)
        if zero in (1, 2):
            gather_shards(flat, s, group).wait()

    return _timed(one_step, device)


def _overlap_ceiling(module: Any, cfg: dict[str, Any], psi: int, device: Any) -> float:
    """How much of an all-reduce of the model's gradient size this machine hides behind a forward and backward
    at all: ``1 - (both - compute) / communication``, with the all-reduce launched asynchronously just before
    the compute (no strategy involved). What any overlap can reach here: near 1 where the network and the
    compute have their own resources (a GPU with NCCL), near 0 where they share the same cores."""
    import torch
    import torch.distributed as dist

    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch_size"], cfg["block_size"]), device=device)
    flat = torch.randn(psi, device=device)

    def compute() -> None:
        module(idx).float().square().mean().backward()

    def communicate() -> Any:
        return dist.all_reduce(flat, async_op=True)

    def both() -> None:
        work = communicate()
        compute()
        work.wait()

    module.train()
    c, m, b = _timed(compute, device), _timed(communicate, device), _timed(both, device)
    module.zero_grad(set_to_none=True)
    return 1 - (b - c) / m  # below 0: the two together take longer than one after the other


def _extra_reductions(k: int) -> Any:
    """A callback that gives Lightning's DDP the bytes ZeRO-2's default moves beyond DDP's with ``k``
    micro-batches per step: after each backward that does not close the window (DDP accumulates those locally),
    one reduce-scatter of a buffer of the gradient's size, by the collective ZeRO-2 reduces its buckets with
    (``reduce_to_owners``; on gloo, point-to-point messages). The buffer is allocated once and nothing is copied
    into it: the collectives alone, none of ZeRO-2's other work. Where nothing overlaps (an overlap ceiling at or
    below 0), a ZeRO-2 that never holds the full gradient between micro-batches is faster than this only by what
    its smaller optimizer step saves."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_hybrid.strategies.zero.collectives import reduce_to_owners

    class ExtraReductions(L.Callback):
        buffer: Any = None

        def on_after_backward(self, trainer, pl_module):
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % k == 0:  # closes (one epoch holds every window: Probe)
                return
            world = dist.get_world_size()
            if self.buffer is None:
                params = list(pl_module.parameters())
                numel = sum(p.numel() for p in params)
                self.buffer = torch.zeros(-(-numel // world) * world, dtype=params[0].dtype, device=pl_module.device)
            s = self.buffer.numel() // world
            reduce_to_owners(self.buffer, [(r, r * s, (r + 1) * s) for r in range(world)], dist.group.WORLD).wait()

    return ExtraReductions()


def _gpt_and_data(cfg: dict[str, Any], spec: Any) -> tuple[Any, Any]:
    """The example GPT of ``cfg``'s size for ``spec`` and its training batches (the same for every spec)."""
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import CharDataModule

    torch.manual_seed(0)
    data = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"], stride=4)
    model = _model({**cfg, "strategy": spec, "vocab_size": data.vocab_size})
    return model, DataLoader(data.train_set, batch_size=cfg["batch_size"], drop_last=True)


Build = Callable[[dict[str, Any], Any], tuple[Any, Any]]
"""(cfg, strategy spec) -> (LightningModule, training DataLoader), from the same seed for every spec."""


def _fit(
    cfg: dict[str, Any], spec: Any, k: int, turns: _Turns | None = None, me: str = "", build: Build = _gpt_and_data
) -> dict[str, Any]:
    """One Trainer of ``spec`` with ``k`` micro-batches per step, fitted from the same seed and data: this rank's
    median step time after warm-up (Lightning's batch start to batch end), and on a GPU its peak memory. With
    ``turns``, it hands the process over to the next Trainer after each optimizer step (see :class:`_Turns`)."""
    import lightning as L
    import torch

    model, loader = build(cfg, spec)
    cfg = {**cfg, "strategy": spec}
    gpu = torch.cuda.is_available()
    times: list[float] = []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            # Lightning also closes a window at an epoch's end: counted by batch_idx, the windows of a second epoch
            # would not be the ones Lightning steps (the same count on every rank: the sampler evens it out)
            if cfg["steps"] * k > trainer.num_training_batches:
                raise ValueError(
                    f"--steps {cfg['steps']} x K={k} micro-batches is more than one epoch"
                    f" ({trainer.num_training_batches} batches per rank): use at most"
                    f" {trainer.num_training_batches // k} steps"
                )

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % k == 0:
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % k == 0:
                if gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - self.t0)
                if turns is not None:
                    turns.hand_over(me)

    if gpu:  # this process's device first: a reset on the default device would open a context on device 0
        torch.cuda.set_device(cfg.get("device_index", int(os.environ.get("LOCAL_RANK", "0"))))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu", strategy=_strategy(cfg),
        devices=[cfg["device_index"]] if gpu and "device_index" in cfg else cfg["devices"],
        precision="bf16-mixed" if gpu else "32-true",
        max_steps=cfg["steps"], accumulate_grad_batches=k, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[Probe(), *([_extra_reductions(k)] if spec == "ddp+reduce-scatters" else [])],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    step = statistics.median(times[cfg["warmup"] :])
    report: dict[str, Any] = {"step_time": step}
    if gpu:
        psi = cfg["psi"]
        tokens = cfg["batch_size"] * cfg["block_size"] * k / step  # this rank's, per second
        # forward + backward per token: 6 per parameter, plus attention's scores and values (12 L T d)
        flops = (6 * psi + 12 * cfg["n_layer"] * cfg["block_size"] * cfg["d_model"]) * tokens
        report.update(tokens_per_s=tokens, mfu=flops / cfg["peak_flops"], peak_memory=torch.cuda.max_memory_allocated())
    return report


class _Turns:
    """Trainers in threads of one process, one optimizer step at a time, in an order that is the same on every
    rank: so each Trainer's collectives meet their peers', and the steps of every configuration are seconds
    apart all through the round (a slow spell of the machine falls on all of them alike, where whole fits one
    after the other each drew their own). Each cycle after the first runs them in a new order, shuffled from
    ``seed`` and the cycle's number (the same on every rank): a step runs measurably faster or slower after
    some configurations than after others (by 4% on 2 CPU processes, where one configuration always followed
    the same one), and shuffling spreads that over every configuration alike. A thread runs only while it
    holds the turn: its setup, a step, and its teardown (which may hold collectives too) run alone."""

    def __init__(self, order: list[str], seed: int = 0) -> None:
        import threading

        self.active = list(order)
        self.queue = list(order)  # this cycle's turns still to come; the head holds the process
        self.cycle, self.seed = 0, seed
        self.changed = threading.Condition()

    def wait(self, name: str) -> None:
        with self.changed:
            self.changed.wait_for(lambda: bool(self.queue) and self.queue[0] == name)

    def hand_over(self, name: str) -> None:
        with self.changed:
            assert self.queue[0] == name, (name, self.queue)
            self.queue.pop(0)
            self._next_cycle_if_done()
        self.wait(name)

    def leave(self, name: str) -> None:
        with self.changed:
            self.active.remove(name)
            if name in self.queue:
                self.queue.remove(name)
            self._next_cycle_if_done()

    def _next_cycle_if_done(self) -> None:
        if not self.queue and self.active:
            self.cycle += 1
            self.queue = list(self.active)
            random.Random(f"{self.seed} {self.cycle}").shuffle(self.queue)
        self.changed.notify_all()


def _lockstep(
    cfg: dict[str, Any], order: list[str], k: int, seed: int = 0, build: Build = _gpt_and_data
) -> dict[str, dict[str, Any]]:
    """Every configuration of ``order`` fitted at once, one optimizer step at a time (:class:`_Turns`)."""
    import threading

    turns = _Turns(order, seed)
    reports: dict[str, dict[str, Any]] = {}

    def fit(name: str) -> None:
        try:
            turns.wait(name)
            reports[name] = _fit(cfg, CONFIGS[name], k, turns, name, build)
        except BaseException:
            # this process ends at once: if only this rank failed, the next Trainer's collectives here would
            # pair with this one's on the other ranks (torchrun then stops them, and the round fails)
            print(f"overlap.py: {name} (K={k}) failed on this rank:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        turns.leave(name)

    threads = [threading.Thread(target=fit, args=(name,), name=f"overlap {name}") for name in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return reports


def _one_by_one(
    cfg: dict[str, Any], order: list[str], k: int, build: Build = _gpt_and_data, warm_up: bool = False
) -> dict[str, dict[str, Any]]:
    """Every configuration of ``order`` fitted alone, one Trainer after the other. ``warm_up``: first an untimed
    Trainer of the first, since the process's first Trainer is slower (its heap grows, first calls are compiled
    or cached)."""
    if warm_up:
        _fit({**cfg, "steps": cfg["warmup"] + 1}, CONFIGS[order[0]], 1, build=build)
    reports = {}
    for name in order:
        gc.collect()  # the last Trainer's model and buffers (reference cycles) before this one builds its own
        reports[name] = _fit(cfg, CONFIGS[name], k, build=build)
    return reports


def worker(cfg: dict[str, Any]) -> None:
    """One round: every configuration of ``cfg["configs"]`` with every ``cfg["accumulation"]`` in this one job
    (the order rotated by ``cfg["shift"]``, so that a position's bias falls on every configuration alike over
    the rounds); then each configuration's collectives timed alone, and the machine's overlap ceiling.

    ``cfg["interleave"]``: ``"steps"`` fits the configurations of one K at once, a step of each in turn
    (:class:`_Turns`); ``"trainers"`` fits them one after the other, after an untimed one (the process's first
    Trainer is slower: its heap grows, first calls are compiled or cached). ``"steps"`` holds every model at
    once, so a GPU whose model fills it takes ``"trainers"``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, CharDataModule

    vocab = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"]).vocab_size
    size = {key: cfg[key] for key in ("block_size", "n_layer", "d_model")}
    cfg["psi"] = psi = sum(p.numel() for p in GPT(vocab_size=vocab, n_head=8, **size).parameters())
    names: list[str] = cfg["configs"]
    shift = cfg.get("shift", 0) % len(names)
    order = names[shift:] + names[:shift]
    if cfg.get("interleave", "steps") == "steps":
        runs = []
        for k in cfg["accumulation"]:
            reports = _lockstep(cfg, order, k, seed=shift)
            runs += [{"k": k, "name": name, **reports[name]} for name in names]
    else:
        runs = []
        for k in cfg["accumulation"]:
            reports = _one_by_one(cfg, order, k, warm_up=not runs)
            runs += [{"k": k, "name": name, **reports[name]} for name in order]
    rank = dist.get_rank() if dist.is_initialized() else 0
    report: dict[str, Any] = {"rank": rank, "psi": psi, "runs": runs, "communication": {}}
    if cfg["devices"] > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        for name in names:
            for k in cfg["accumulation"]:
                spec = {**cfg, "strategy": CONFIGS[name], "accumulation": k}
                report["communication"][f"{name}|{k}"] = _communication_alone(spec, psi, device)
        torch.manual_seed(0)
        module = GPT(vocab_size=vocab, n_head=8, dropout=0.0, **size).to(device)
        report["ceiling"] = _overlap_ceiling(module, {**cfg, "vocab_size": vocab}, psi, device)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))


# ------------------------------------------------------------------------------------------------ driver


def _compute_alone(base: dict[str, Any], nproc: int, work: Path) -> dict[int, float]:
    """The step time of the per-rank work without any collective, per K: ``nproc`` one-process jobs at once (on
    the host they share its cores as the ranks do; on a GPU node each has its device), the slowest one's. With
    ``interleave="steps"`` each job fits two identical Trainers, so that every step follows another Trainer's as
    in the round (the median of the two)."""
    from concurrent.futures import ThreadPoolExecutor

    twice = ["DDP (Lightning), again"] if base["interleave"] == "steps" else []
    cfg = {**base, "configs": ["DDP (Lightning)", *twice]}
    with ThreadPoolExecutor(nproc) as pool:
        jobs = [
            pool.submit(run_job, __file__, {**cfg, "device_index": i}, 1, work / f"alone-{i}", _budget(cfg))
            for i in range(nproc)
        ]
        per_rank = [job.result()[0]["runs"] for job in jobs]
    return {
        k: max(statistics.median(r["step_time"] for r in runs if r["k"] == k) for runs in per_rank)
        for k in base["accumulation"]
    }


def _budget(cfg: dict[str, Any]) -> float:
    """Seconds a job of ``cfg`` is allowed: generous for a slow machine, finite so that a hang ends."""
    return 120 + len(cfg["configs"]) * sum(30 + 2 * cfg["steps"] * k for k in cfg["accumulation"])


def _against_extra(rows: dict[tuple[str, int], list[dict[str, Any]]], ks: list[int]) -> list[str]:
    """ZeRO-2's default against the row of DDP plus its extra bytes, round by round, per K (when both ran)."""
    zero2 = "hybrid ZeRO-2 every_microbatch"
    lines = []
    for k in ks:
        if (zero2, k) in rows and (EXTRA, k) in rows:
            ratios = [a["step"] / b["step"] for a, b in zip(rows[(zero2, k)], rows[(EXTRA, k)])]
            lines.append(
                f"{zero2} / {EXTRA}, K={k}: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    return ["", *lines] if lines else []


def _gpus() -> tuple[int, str, int]:
    import torch

    if not torch.cuda.is_available():
        return 0, "", 0
    props = torch.cuda.get_device_properties(0)
    return torch.cuda.device_count(), props.name, props.total_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every configuration")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per job (the first 3 are warm-up)")
    parser.add_argument(
        "--only", nargs="*", default=None, help="configurations to run (names of the table; both DDP rows always run)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    parser.add_argument("--quick", action="store_true", help="DDP and ZeRO-0/1/2 with K=1 only (gpu_check.sh)")
    parser.add_argument(
        "--interleave", choices=["steps", "trainers"], default=None,
        help="a step of each configuration in turn (without a GPU, the default), or one Trainer after the other"
        " (the only choice on GPUs: their model would not fit once per configuration)",
    )  # fmt: skip
    parser.add_argument(
        "--host-allocator", choices=["system", "keep-freed"], default="system",
        help="keep-freed: glibc keeps freed host memory for reuse instead of returning it to the system"
        " (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), as CUDA's caching allocator keeps device memory: a"
        " buffer allocated afresh every micro-batch then costs no page faults. For every configuration alike",
    )  # fmt: skip
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker.read_text()))
        return
    gpus, name, memory = _gpus()
    if gpus == 1:
        sys.exit("overlap.py compares data-parallel strategies: it needs 2 or more GPUs (or none: 2 CPU processes).")
    nproc = max(gpus, 2)
    machine = f"{gpus} x {name} (NCCL, bf16-mixed)" if gpus else "2 CPU processes (gloo, fp32)"
    size = {"n_layer": 4, "d_model": 256, "block_size": 64, "batch_size": 8}
    if gpus:  # a model whose fp32 states and AdamW fill a good part of the device (1.2B or 150M parameters)
        big = memory >= 70 * 2**30 and not args.quick
        size = {"n_layer": 24 if big else 12, "d_model": 2048 if big else 1024, "block_size": 1024, "batch_size": 4}
    keep_freed = args.host_allocator == "keep-freed"
    if keep_freed:  # inherited by every job's ranks
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(2**30), MALLOC_TRIM_THRESHOLD_=str(2**32))
    allocator = (
        ", host allocator keeping freed memory (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)" if keep_freed else ""
    )
    interleave = args.interleave or ("trainers" if gpus else "steps")
    if gpus and interleave == "steps":  # every model at once, and a CUDA device and peak per thread, not process
        sys.exit("overlap.py --interleave steps is for CPU processes; on GPUs use --interleave trainers (the default).")
    base = {**size, "steps": args.steps, "warmup": 3, "peak_flops": args.peak_tflops * 1e12, "interleave": interleave}
    only = ["hybrid ZeRO-0", "hybrid ZeRO-1", "hybrid ZeRO-2 every_microbatch"] if args.quick else args.only
    names = [n for n in CONFIGS if only is None or n in only or n.startswith("DDP (Lightning)")]
    if any(BASELINE.get(n) == FSDP2 for n in names) and FSDP2 not in names:
        names.insert(1, FSDP2)
    work = Path("/tmp") / "lightning-hybrid-overlap"
    base["accumulation"] = [1] if args.quick else [1, 4]
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    compute: dict[int, list[float]] = {}
    ceilings: list[float] = []
    for round_ in range(args.repeats):
        for k, seconds in _compute_alone(base, nproc, work).items():
            compute.setdefault(k, []).append(seconds)
        cfg = {**base, "configs": names, "shift": round_}
        reports = run_job(__file__, cfg, nproc, work / "job", _budget(cfg))
        ceilings.append(min(r["ceiling"] for r in reports))
        for i, run in enumerate(reports[0]["runs"]):
            n, k = run["name"], run["k"]
            rows.setdefault((n, k), []).append(
                {
                    "step": max(r["runs"][i]["step_time"] for r in reports),
                    "communication": max(r["communication"][f"{n}|{k}"] for r in reports),
                    **{key: run[key] for key in ("tokens_per_s", "mfu", "peak_memory") if key in run},
                }
            )
        print(f"round {round_ + 1}/{args.repeats}: done", flush=True)
    rows = {(n, k): rows[(n, k)] for k in base["accumulation"] for n in names}  # the table's order
    lines = [
        f"# overlap: step time relative to the baseline, {machine}, GPT {size['n_layer']}x{size['d_model']},"
        f" per-rank batch {size['batch_size']}x{size['block_size']}, {args.repeats} rounds of {args.steps} steps,"
        f" interleaved by {'step' if interleave == 'steps' else 'Trainer'}{allocator}",
        "",
        "| configuration | K | step / baseline (median, min-max) | baseline | comm alone / compute |"
        " hidden share | step (ms) |" + (" tokens/s per GPU | MFU | peak GiB |" if gpus else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|---|" if gpus else ""),
    ]
    for (n, k), runs in rows.items():
        ref_name = BASELINE.get(n, "DDP (Lightning)") or "DDP (Lightning)"
        ref = rows[(ref_name, k)]
        ratios = [run["step"] / r["step"] for run, r in zip(runs, ref)]
        step = statistics.median(run["step"] for run in runs)
        comp = statistics.median(compute[k])
        comm = statistics.median(run["communication"] for run in runs)
        hidden = max(0.0, min(1.0, 1 - (step - comp) / comm)) if comm > 0 else float("nan")
        line = (
            f"| {n} | {k} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {ref_name} |"
            f" {comm / comp:.2f} | {hidden:.2f} | {step * 1e3:.0f} |"
        )
        if gpus:
            last = runs[-1]
            line += f" {last['tokens_per_s']:.0f} | {last['mfu']:.1%} | {last['peak_memory'] / 2**30:.2f} |"
        lines.append(line)
    lines += [
        "",
        "DDP (Lightning), again: a second Trainer identical to the first; its ratio is the measurement's own noise.",
        "",
        f"{EXTRA}: Lightning's DDP plus, after each backward that does not close the window, one reduce-scatter"
        " of a gradient-sized buffer by the collective ZeRO-2 reduces its buckets with (allocated once, nothing"
        " copied into it): the bytes ZeRO-2's default moves beyond DDP's (K reduce-scatters and an all-gather"
        " where DDP's one all-reduce moves a reduce-scatter's and an all-gather's), without its other work. With"
        " K=1 it is DDP. Where the overlap ceiling is at or below 0, a ZeRO-2 that never holds the full gradient"
        " from one micro-batch to the next, with these collectives, is faster than it only by what its smaller"
        " optimizer step saves (each rank steps its shard).",
        *_against_extra(rows, base["accumulation"]),
        "",
        f"overlap ceiling of this machine: {statistics.median(ceilings):.2f} (min {min(ceilings):.2f}) of an"
        " all-reduce of the model's gradient size hidden behind one forward and backward when launched"
        " asynchronously just before it, no strategy involved (median over the rounds; below 0: the two at once"
        " take longer than one after the other). A hidden share above it is the noise of the step and compute"
        " times it is made of, not overlap.",
        "",
        "hidden share = 1 - (step - compute) / communication; compute: the same per-rank work in one-process jobs"
        " running side by side (no collective); communication: the configuration's collectives for one step,"
        " timed alone on the same processes.",
    ]
    publish(lines, args.out, f"overlap_{'gpu' if gpus else 'cpu'}{'_keep_freed' if keep_freed else ''}.txt")


if __name__ == "__main__":
    main()
