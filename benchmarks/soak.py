"""Soak: training jobs failed again and again at random times, relaunched each time, ending as if never failed.

    python benchmarks/soak.py --failures 500 --out benchmarks/results     # about an hour on 2 CPU cores
    python benchmarks/soak.py --failures 20                                # the short soak of the slow tier

Four jobs train the example GPT with ``FaultTolerantCheckpoint`` (a checkpoint every 2 steps, ``keep_last=2``):
dp2 under ``HybridParallelStrategy(zero_stage=2)`` and pp2 x dp2 under ZeRO-1 with 1F1B, each with
asynchronous and with synchronous saves. Two of them change world between relaunches (2 <-> 1 and 4 <-> 2
processes, ``on_world_size_change="keep_global_batch"``: K doubles where the world halves) and train with SGD
(momentum 0.9); the two that keep their world train with AdamW and dropout, whose random stream must come back
exactly too. Why SGD where the world changes: a world change reorders float sums, and AdamW amplifies that
rounding (measured here over 240 steps: 1 process with K=2 against 2 with K=1, both uninterrupted, end
1.3e-2 apart under AdamW and 6e-8 apart under SGD), so only SGD leaves a 1e-5 check able to see a lost step.

Each launch is ended by one fault sent from outside at a random time after a random step, as a node or a
scheduler would send it: SIGKILL of one rank, SIGTERM of every rank (a preemption), SIGINT of every rank
(Ctrl-C in the terminal, which signals the whole foreground process group) or SIGSTOP of one rank (a hung
node: its peers' watchdog must end them). Some launches also meet a full disk for a while (the checkpoints
live on a small filesystem made for the soak, filled to the last byte and freed again a few steps later),
and after some launches the newest valid checkpoint (of at least two) is truncated or has a byte flipped.
The driver then relaunches at once, as Slurm's requeue or torchrun's restart would, with nothing done by hand; the ranks
are started with torchrun's environment and its failure policy (a failed rank's peers get SIGTERM, then
SIGKILL 30 s later), forked from preloaded interpreters (``tests/helpers.py``).

Checked independently of the pack, at every launch: it resumes from the newest checkpoint whose manifest
and SHA-256 sums hold (recomputed here with hashlib), never from an older one, and no valid checkpoint ever
disappears while no newer valid one exists; every rank of a failed job has ended within ``BOUND_S`` of the
fault. At the end: the final weights against an uninterrupted run (bit for bit where the world never changed,
1e-5 where it did) and every step's samples (a CRC-32 per sample, over all data-parallel ranks) against the
uninterrupted run's: nothing skipped, nothing repeated.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish  # noqa: E402
from helpers import launch  # noqa: E402

BOUND_S = 60.0  # every rank of a failed job has ended within this many seconds of the fault
MIN_STEPS = 240  # and 6 steps per failure: the relaunches never reach the end; the final launch has steps left
EVERY = 2
HANG_TIMEOUT = 8.0
SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigstop": signal.SIGSTOP}
ENDINGS = {"sigkill": 0.3, "sigterm": 0.3, "sigint": 0.3, "sigstop": 0.05}  # SIGSTOP costs the launcher's 30 s grace
FULL_DISK_P, CORRUPT_P, SHRINK_P = 0.2, 0.25, 0.35
DISK_BYTES = 48 << 20


SGD = {"optimizer": "sgd", "momentum": 0.9}
PP2 = {"pipeline_parallel_size": 2, "zero_stage": 1}


@dataclass(frozen=True)
class Job:
    name: str
    nproc: int
    strategy: dict[str, Any]
    async_save: bool
    small: int | None = None  # the other world it changes to and from, or None
    dropout: float = 0.0
    optimizer: dict[str, Any] = field(default_factory=dict)  # GPT kwargs; AdamW unless given


JOBS = (
    Job("dp2 ZeRO-2, async, world 2 <-> 1, SGD", 2, {"zero_stage": 2}, True, small=1, optimizer=SGD),
    Job("dp2 ZeRO-2, sync, dropout", 2, {"zero_stage": 2}, False, dropout=0.1),
    Job("pp2 x dp2 ZeRO-1, async, dropout", 4, PP2, True, dropout=0.1),
    Job("pp2 x dp2 ZeRO-1, sync, world 4 <-> 2, SGD", 4, PP2, False, small=2, optimizer=SGD),
)


@dataclass
class Record:
    """What happened to one job."""

    failures: Counter = field(default_factory=Counter)
    ended_in: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # fault -> seconds
    recovery: list[float] = field(default_factory=list)
    relaunches: int = 0
    redone: int = 0
    wall: float = 0.0
    reference_wall: float = 0.0
    worlds: Counter = field(default_factory=Counter)
    exit_codes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    problems: list[str] = field(default_factory=list)
    weight_diff: float = float("nan")
    steps: int = 0
    steps_compared: int = 0
    disk: str = ""


# -- checkpoints, judged without the pack -----------------------------------------------------------------


def valid(folder: Path, required: frozenset[str] = frozenset()) -> bool:
    """The manifest parses and names files (``required`` among them), and every one has its size and SHA-256."""
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
        if not files or not required <= set(files):
            return False
        for name, entry in files.items():
            data = (folder / name).read_bytes()
            if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def order(name: str) -> tuple[int, int]:
    match = re.match(r"^step-(\d+)(?:-v(\d+))?$", name)
    assert match, name
    return int(match.group(1)), int(match.group(2) or 0)


def snapshot(root: Path, required: frozenset[str] = frozenset()) -> dict[str, bool]:
    """Each step folder under ``root``: valid or not."""
    if not root.exists():
        return {}
    steps = (p for p in root.iterdir() if p.is_dir() and re.match(r"^step-\d+(-v\d+)?$", p.name))
    return {p.name: valid(p, required) for p in steps}


def _newest(state: dict[str, bool]) -> str | None:
    good = [n for n, ok in state.items() if ok]
    return max(good, key=order) if good else None


def _damage(folder: Path, rng: random.Random) -> str:
    target = max(
        (p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    data = bytearray(target.read_bytes())
    if rng.random() < 0.5:
        data[rng.randrange(len(data))] ^= 0x5A
        how = "flipped"
    else:
        data = data[: rng.randrange(len(data))]
        how = "truncated"
    target.write_bytes(bytes(data))
    return how


# -- a small filesystem to fill ---------------------------------------------------------------------------


class Disk:
    """The checkpoints' filesystem: a tmpfs of ``DISK_BYTES`` mounted for the soak and removed after it. Mounting
    needs root; without it the full-disk fault is not injected, and the table says so."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)], capture_output=True, text=True
        )
        self.mounted = done.returncode == 0
        self.kind = (
            f"a tmpfs of {DISK_BYTES >> 20} MiB, filled to the last byte"
            if self.mounted
            else f"not injected (mounting a small filesystem needs root: {done.stderr.strip() or done.returncode})"
        )
        self._filler = path / "filler.bin"

    def fill(self) -> bool:
        if not self.mounted:
            return False
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (1 << 20, 4096):  # megabytes, then the last pages: full to the byte
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * chunk)
        finally:
            os.close(fd)
        return True

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def close(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


# -- one launch -------------------------------------------------------------------------------------------


def _config(job: Job, work: Path, name: str, nproc: int, ckpt: Path, steps: int) -> dict[str, Any]:
    kwargs = {**job.strategy, "schedule": "1f1b"} if "pipeline_parallel_size" in job.strategy else dict(job.strategy)
    (work / name / "progress").mkdir(parents=True, exist_ok=True)
    replicas = nproc // job.strategy.get("pipeline_parallel_size", 1)
    base = job.nproc // job.strategy.get("pipeline_parallel_size", 1)
    return {
        "strategy": {"name": "hybrid_class", "kwargs": kwargs},
        "ft": {
            "dirpath": str(ckpt),
            "every_n_train_steps": EVERY,
            "keep_last": 2,
            "async_save": job.async_save,
            "hang_timeout": HANG_TIMEOUT,
            "on_world_size_change": "keep_global_batch",
        },
        "steps": steps,
        "model": {"dropout": job.dropout, **job.optimizer},
        "data": {"batch_size": 4, "stride": 59},  # 96 samples: 12 steps of 8, on any world
        "trainer": {"accumulate_grad_batches": base // replicas},
        "weights": str(work / f"{name}-weights.pt"),
        "out": str(work / name),
        "inject": {"progress": str(work / name / "progress"), "samples": str(work / "samples" / name)},
    }


def _progress(cfg: dict[str, Any], nproc: int) -> dict[int, list[Any]]:
    seen = {}
    for rank in range(nproc):
        with contextlib.suppress(OSError, ValueError):
            seen[rank] = json.loads((Path(cfg["inject"]["progress"]) / f"progress{rank}").read_text())
    return seen


def _launch_with_fault(
    cfg: dict[str, Any], nproc: int, at: int, ending: str, full_disk: bool, disk: Disk, rng: random.Random
) -> dict[str, Any]:
    """Launch; once a rank reports step ``at`` (plus a random fraction of a step), send ``ending`` from outside."""
    outcome: dict[str, Any] = {}
    job = threading.Thread(
        target=lambda: outcome.update(
            result=launch("fault_tolerant.py", cfg, nproc=nproc, expect_success=False, timeout=400)
        )
    )
    start = time.monotonic()
    job.start()
    sent = first = filled = reached = None
    seen: dict[int, list[Any]] = {}
    fill_at = at - rng.randint(1, EVERY + 1) if full_disk else None
    while job.is_alive():
        seen = _progress(cfg, nproc) or seen
        if seen and first is None:
            first = time.monotonic() - start
        top = max((s[0] for s in seen.values()), default=-1)
        if fill_at is not None and filled is None and top >= fill_at and disk.fill():
            filled = top
        if filled is not None and sent is None and top >= filled + EVERY + 1:
            disk.free()  # another job's files were removed: the next save has room again
        if sent is None and top >= at and len(seen) == nproc:
            time.sleep(rng.uniform(0.0, 0.05))  # anywhere in a step: a save, a collective, a pipeline send
            pids = [s[1] for s in _progress(cfg, nproc).values()]
            sig = SIGNALS[ending]
            targets = [rng.choice(pids)] if ending in ("sigkill", "sigstop") else pids
            sent = time.monotonic()
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            reached = max(s[0] for s in _progress(cfg, nproc).values())
        time.sleep(0.02)
    job.join()
    ended = time.monotonic()
    disk.free()
    seen = _progress(cfg, nproc) or seen
    return {
        "result": outcome.get("result"),
        "sent": sent,
        "ended_in": None if sent is None else ended - sent,
        "first_step_after": first,
        "resumed": next(iter(seen.values()))[2] if seen else None,
        "reached": reached if sent is not None else max((s[0] for s in seen.values()), default=0),
        "filled": filled,
    }


# -- samples ----------------------------------------------------------------------------------------------


def _samples(folder: Path, launches: list[str]) -> dict[int, list[int]]:
    """Step -> the sorted CRC-32s of its samples over all data-parallel ranks, from the newest launch that ran it
    (a step redone after a failure replaces what the failed launch did; pipeline stages share a dp rank)."""
    per_launch: dict[str, dict[int, dict[int, list[list[int]]]]] = {}
    for name in launches:
        steps: dict[int, dict[int, list[list[int]]]] = defaultdict(dict)
        for path in sorted(folder.glob(f"{name}-rank*.jsonl")):
            mine: dict[tuple[int, int], list[list[int]]] = defaultdict(list)
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut by a kill
                    entry = json.loads(line)
                    mine[(entry["step"], entry["dp"])].append(entry["rows"])
            for (step, dp), batches in mine.items():
                if len(batches) > len(steps[step].get(dp, [])):
                    steps[step][dp] = batches
        per_launch[name] = steps
    out: dict[int, list[int]] = {}
    for name in launches:  # oldest first: a later launch's step replaces an earlier one's
        for step, by_dp in per_launch[name].items():
            out[step] = sorted(row for batches in by_dp.values() for batch in batches for row in batch)
    return out


# -- one job's soak ---------------------------------------------------------------------------------------


def soak_job(job: Job, failures: int, work: Path, rng: random.Random, log) -> Record:
    import torch

    rec = Record(steps=max(MIN_STEPS, 6 * failures))
    disk = Disk(work / "disk")
    rec.disk = disk.kind
    try:
        began = time.monotonic()
        ref_cfg = _config(job, work, "reference", job.nproc, work / "reference-ckpt", rec.steps)
        launch("fault_tolerant.py", ref_cfg, nproc=job.nproc, timeout=900)
        rec.reference_wall = time.monotonic() - began
        reference = _samples(work / "samples", ["reference"])
        root = disk.path / "ckpt"
        launches: list[str] = []
        before: dict[str, bool] = {}
        pending_recovery: float | None = None
        early = 0  # launches in a row that ended before their fault
        began = time.monotonic()
        while sum(rec.failures.values()) < failures:
            name = f"launch{len(launches):04d}"
            nproc = job.small if job.small and rng.random() < SHRINK_P else job.nproc
            endings = [e for e in ENDINGS if not (e == "sigstop" and nproc == 1)]  # nobody watches a lone process
            ending = rng.choices(endings, [ENDINGS[e] for e in endings])[0]
            full_disk = rng.random() < FULL_DISK_P
            newest = _newest(before)
            at = (order(newest)[0] if newest else 0) + rng.randint(1, 2 * EVERY)
            cfg = _config(job, work, name, nproc, root, rec.steps)
            out = _launch_with_fault(cfg, nproc, at, ending, full_disk, disk, rng)
            launches.append(name)
            rec.relaunches += 1
            rec.worlds[nproc] += 1
            where = f"{job.name}, {name} ({ending} at step {at}, {nproc} processes)"
            if pending_recovery is not None and out["first_step_after"] is not None:
                rec.recovery.append(pending_recovery + out["first_step_after"])
            # it resumed from the newest valid checkpoint there was when it started
            if out["resumed"] is not None:
                path = Path(out["resumed"])  # a sharded checkpoint's folder, or the file in a full one's
                resumed = path.name if path.name.startswith("step-") or path.name == "-" else path.parent.name
                if resumed != (newest or "-"):
                    rec.problems.append(f"{where}: resumed from {resumed}, the newest valid checkpoint was {newest}")
            if out["filled"] is not None:
                rec.failures["full disk"] += 1
            if out["sent"] is None:
                rec.problems.append(f"{where}: the job ended before the fault (exit {_code(out)})\n{_tail(out)}")
                pending_recovery = None
                early += 1
                if early == 5:
                    rec.problems.append(f"{job.name}: 5 launches in a row ended before their fault: a crash loop")
                    break
            else:
                early = 0
                rec.failures[ending] += 1
                rec.ended_in[ending].append(out["ended_in"])
                rec.exit_codes[ending][_code(out)] += 1
                if out["ended_in"] > BOUND_S:
                    rec.problems.append(f"{where}: ranks ended {out['ended_in']:.0f} s after the fault")
                pending_recovery = out["ended_in"]
            state = snapshot(root)
            for ckpt, ok in before.items():
                if ok and ckpt not in state and not any(v and order(n) > order(ckpt) for n, v in state.items()):
                    rec.problems.append(f"{where}: valid checkpoint {ckpt} is gone and no newer valid one exists")
            after = _newest(state)
            # the newest valid checkpoint, where an older valid one remains (with none, the run starts over from
            # step 0, as tests/test_fault_tolerant.py checks; the soak would only get longer)
            if sum(state.values()) >= 2 and rng.random() < CORRUPT_P:
                how = _damage(root / after, rng)
                rec.failures[f"checkpoint {how}"] += 1
                state[after] = False
            nxt = _newest(state)
            rec.redone += max(0, out["reached"] - (order(nxt)[0] if nxt else 0))
            before = state
            log(f"{where}: ended in {out['ended_in'] or 0:.1f} s, exit {_code(out)}, newest valid {nxt}; "
                f"{sum(rec.failures.values())} failures")  # fmt: skip
        final = _config(job, work, "final", job.nproc, root, rec.steps)
        done = launch("fault_tolerant.py", final, nproc=job.nproc, timeout=900, expect_success=False)
        launches.append("final")
        rec.wall = time.monotonic() - began
        if done.returncode != 0:
            rec.problems.append(f"{job.name}: the final launch failed (exit {done.returncode})\n{done.output[-3000:]}")
            return rec
        ours = torch.load(final["weights"])
        ref = torch.load(ref_cfg["weights"])
        rec.weight_diff = max((ours[k].double() - ref[k].double()).abs().max().item() for k in ref)
        changed = len(rec.worlds) > 1
        if rec.weight_diff > (1e-5 if changed else 0.0):
            rec.problems.append(f"{job.name}: final weights {rec.weight_diff:.3g} from the uninterrupted run's")
        got = _samples(work / "samples", launches)
        rec.steps_compared = len(reference)
        for step in range(1, rec.steps + 1):
            if got.get(step) != reference.get(step):
                rec.problems.append(f"{job.name}: step {step} trained other samples than the uninterrupted run")
                break
        return rec
    finally:
        disk.close()


def _code(out: dict[str, Any]) -> str:
    return str(out["result"].returncode) if out["result"] is not None else "no result"


def _tail(out: dict[str, Any]) -> str:
    return out["result"].output[-2000:] if out["result"] is not None else ""


# -- the table --------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def table(records: dict[str, Record], seed: int) -> list[str]:
    total = sum(sum(r.failures.values()) for r in records.values())
    lines = [
        f"# soak: {total} injected failures over {len(records)} jobs (seed {seed}, 2 CPU cores, gloo)",
        "",
        "| job | failures | relaunches | worlds (processes: launches) | steps redone | wall vs uninterrupted |"
        " final weights vs uninterrupted | steps' samples | lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        worlds = ", ".join(f"{n}: {c}" for n, c in sorted(r.worlds.items()))
        samples = f"{r.steps_compared} steps equal" if not any("samples" in p for p in r.problems) else "DIFFER"
        lost = "nothing" if not r.problems else f"{len(r.problems)} problem(s)"
        lines.append(
            f"| {name} | {sum(r.failures.values())} | {r.relaunches} | {worlds} | {r.redone} |"
            f" {r.wall / max(r.reference_wall, 1e-9):.1f}x | {r.weight_diff:.2g} | {samples} | {lost} |"
        )
    lines += [
        "",
        f"Every rank ended after the fault (bound {BOUND_S:.0f} s), by fault:",
        "",
        "| fault | count | median s | p90 s | max s | exit codes (count) |",
        "|---|---|---|---|---|---|",
    ]
    kinds: dict[str, list[float]] = defaultdict(list)
    codes: dict[str, Counter] = defaultdict(Counter)
    counts: Counter = Counter()
    for r in records.values():
        counts.update(r.failures)
        for kind, values in r.ended_in.items():
            kinds[kind] += values
            codes[kind].update(r.exit_codes[kind])
    for kind in sorted(counts):
        values = kinds.get(kind, [])
        exits = ", ".join(f"{c} ({n})" for c, n in codes[kind].most_common())
        exits = exits or ("- (the job went on)" if kind == "full disk" else "- (between launches)")
        if values:
            lines.append(
                f"| {kind} | {counts[kind]} | {statistics.median(values):.1f} | {_pct(values, 0.9):.1f} |"
                f" {max(values):.1f} | {exits} |"
            )
        else:
            lines.append(f"| {kind} | {counts[kind]} | - | - | - | {exits} |")
    recovery = [v for r in records.values() for v in r.recovery]
    if recovery:
        lines += [
            "",
            f"Recovery (fault to the relaunched job's first step), {len(recovery)} relaunches: median"
            f" {statistics.median(recovery):.1f} s, p90 {_pct(recovery, 0.9):.1f} s, max {max(recovery):.1f} s.",
        ]
    disks = {r.disk for r in records.values()}
    lines += ["", f"Full disk: {', '.join(sorted(disks))}."]
    problems = [p for r in records.values() for p in r.problems]
    lines += ["", "Problems: none." if not problems else "Problems:", *[f"- {p}" for p in problems]]
    return lines


def run(failures: int, seed: int, work: Path, jobs: tuple[Job, ...] = JOBS, log=print) -> dict[str, Record]:
    rng = random.Random(seed)
    records = {}
    for i, job in enumerate(jobs):
        share = failures // len(jobs) + (1 if i < failures % len(jobs) else 0)
        records[job.name] = soak_job(job, share, work / f"job{i}", rng, log)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--failures", type=int, default=500)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--out", type=Path, default=None, help="folder for soak_cpu.txt")
    parser.add_argument("--jobs", default="0,1,2,3", help="which of the four jobs, by index")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' folders (printed) for a look")
    args = parser.parse_args()
    jobs = tuple(JOBS[int(i)] for i in args.jobs.split(","))
    work = Path(tempfile.mkdtemp(prefix="lh-soak-"))
    if args.keep:
        print(f"jobs' folders: {work}")
    try:
        log = (lambda *_: None) if args.quiet else functools.partial(print, flush=True)
        records = run(args.failures, args.seed, work, jobs, log=log)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    lines = table(records, args.seed)
    if args.out:
        publish(lines, args.out, "soak_cpu.txt")
    else:
        print("\n".join(lines))
    sys.exit(1 if any(r.problems for r in records.values()) else 0)


if __name__ == "__main__":
    main()
