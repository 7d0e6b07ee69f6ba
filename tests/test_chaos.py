"""Chaos: a 2-rank job relaunched 20 times, each launch ended by kill -9, SIGTERM, or kill -9 followed by a
corrupted newest checkpoint, at a random step. The last launch must end with the uninterrupted run's weights,
bit for bit, and no valid checkpoint may ever disappear while a newer one is invalid.

Checkpoints are checked here independently of the pack (the manifest's sizes and SHA-256 recomputed with
hashlib), and the faults come from outside the processes, as a node failure or a scheduler would send them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from soak import order, snapshot  # the checkpoints judged without the pack, as the soak judges them

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STEPS = 80  # long enough that 20 interrupted launches (at most 3 steps of progress each) never finish it
LAUNCHES = 20
KEEP_LAST = 2
REQUIRED = frozenset({"checkpoint.pt", "rank-00000.pt", "rank-00001.pt"})


def _config(tmp: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "ft": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": 2, "keep_last": KEEP_LAST, "async_save": True},
        "steps": STEPS,
        "model": {"dropout": 0.1},
        "weights": str(tmp / f"{name}-weights.pt"),
        "out": str(tmp / name),
        **extra,
    }


def _run_until(cfg: dict[str, Any], step: int, action: str, victim: int) -> dict[str, Any]:
    """Launch, wait until a rank reports `step`, then send the fault to `victim` from outside."""
    progress = Path(cfg["out"]) / "progress"
    progress.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "inject": {"progress": str(progress)}}
    outcome: dict[str, Any] = {}
    job = threading.Thread(
        target=lambda: outcome.update(
            result=launch("fault_tolerant.py", cfg, nproc=2, expect_success=False, timeout=240)
        )
    )
    job.start()
    sent, seen = None, {}
    while job.is_alive():
        for rank in (0, 1):
            try:
                seen[rank] = json.loads((progress / f"progress{rank}").read_text())
            except (OSError, ValueError):
                continue
        if sent is None and victim in seen and seen[victim][0] >= step:
            sig = signal.SIGTERM if action == "sigterm" else signal.SIGKILL
            try:
                os.kill(seen[victim][1], sig)
                sent = seen[victim][0]
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    job.join()
    return {"result": outcome["result"], "sent_at": sent, "progress": seen}


@pytest.mark.timeout(1500)
def test_twenty_relaunches_with_random_faults_end_with_the_uninterrupted_weights(tmp_path):
    reference = _config(tmp_path / "ref", "ref")
    launch("fault_tolerant.py", reference, nproc=2, timeout=240)
    root = tmp_path / "run" / "ckpt"
    rng = random.Random(2026)
    valid_before: dict[str, bool] = {}
    newest_valid = -1
    history = []
    for attempt in range(LAUNCHES):
        action = rng.choice(["sigkill", "sigterm", "corrupt"])
        victim = rng.randint(0, 1)
        at = max(newest_valid, 0) + rng.randint(1, 3)
        outcome = _run_until(_config(tmp_path / "run", f"launch{attempt}"), at, action, victim)
        assert outcome["sent_at"] is not None, f"launch {attempt} ended before step {at}"
        resumed = outcome["progress"][victim][2]
        history.append((attempt, action, victim, at, outcome["sent_at"], Path(resumed).parent.name))
        before = sorted(valid_before.items())
        where = f"launch {attempt} ({action} rank {victim} at step {at}); before: {before}; history {history}"
        # the resume point is the newest checkpoint that was valid when the launch started
        if newest_valid >= 0:
            assert resumed != "-", f"started fresh although valid checkpoints existed: {where}"
            assert order(Path(resumed).parent.name) == max(order(n) for n, ok in valid_before.items() if ok), where
        if action == "sigterm" and outcome["sent_at"] is not None:
            codes = [r.get("exit_code") for r in outcome["result"].reports if "exit_code" in r]
            assert codes and set(codes) == {75}, f"{codes}: {where}\n{outcome['result'].output[-3000:]}"
        state = snapshot(root, REQUIRED)
        # never: a valid checkpoint deleted while no newer valid one exists
        for name, ok in valid_before.items():
            if ok and name not in state:
                assert any(v and order(n) > order(name) for n, v in state.items()), f"lost {name}: {where}"
        valid = sorted((n for n, ok in state.items() if ok), key=order)
        if action == "corrupt" and valid:
            newest = root / valid[-1]
            target = max((p for p in newest.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
            data = bytearray(target.read_bytes())
            if rng.random() < 0.5:
                data[rng.randrange(len(data))] ^= 0x5A
            else:
                data = data[: rng.randrange(len(data))]
            target.write_bytes(bytes(data))
            state[valid[-1]] = False
        valid_before = state
        newest_valid = max((order(n)[0] for n, ok in state.items() if ok), default=-1)
    assert {entry[1] for entry in history} == {"sigkill", "sigterm", "corrupt"}
    final = launch("fault_tolerant.py", _config(tmp_path / "run", "final"), nproc=2, timeout=240)
    assert final.rank(0)["global_step"] == STEPS
    ours, ref = torch.load(tmp_path / "run" / "final-weights.pt"), torch.load(reference["weights"])
    assert ours.keys() == ref.keys()
    diff = max((ours[k] - ref[k]).abs().max().item() for k in ref)
    assert diff == 0.0, f"weights differ by {diff} after {history}"
