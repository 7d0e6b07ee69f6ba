"""benchmarks/overlap.py's step-by-step interleaving (``_Turns``): the Trainers of one process run one at a time,
in an order every rank derives alike (their collectives must meet their peers'), and one that leaves early (a
failed fit) hands the turn on instead of stopping the others. Threads only; no process group."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from overlap import _Turns

NAMES = ["DDP", "DDP again", "ZeRO-0", "ZeRO-1", "ZeRO-2"]


def _run(turns: _Turns, steps: dict[str, int], fail_at: dict[str, int] | None = None) -> list[str]:
    """Each name runs ``steps[name]`` turns in its own thread; the names in the order they ran."""
    ran: list[str] = []
    running = threading.Semaphore(1)  # never two at once: acquire would block and the test time out
    errors: list[BaseException] = []

    def trainer(name: str) -> None:
        try:
            turns.wait(name)
            for step in range(steps[name]):
                assert running.acquire(blocking=False), f"{name} ran while another Trainer held the turn"
                ran.append(name)
                running.release()
                if fail_at and fail_at.get(name) == step:
                    raise RuntimeError("this fit failed")
                turns.hand_over(name)
        except RuntimeError as error:
            if "this fit failed" not in str(error):
                errors.append(error)
        except BaseException as error:
            errors.append(error)
        finally:
            turns.leave(name)

    threads = [threading.Thread(target=trainer, args=(n,), daemon=True) for n in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a Trainer never got its turn back"
    assert not errors, errors
    return ran


def test_every_cycle_runs_each_trainer_once_in_an_order_every_rank_derives_alike():
    steps = dict.fromkeys(NAMES, 12)
    rank0, rank1 = _run(_Turns(NAMES, seed=3), steps), _run(_Turns(NAMES, seed=3), steps)
    assert rank0 == rank1  # the two "ranks" issue their Trainers' collectives in one order
    cycles = [rank0[i : i + len(NAMES)] for i in range(0, len(rank0), len(NAMES))]
    assert len(cycles) == 12 and all(sorted(cycle) == sorted(NAMES) for cycle in cycles)
    assert cycles[0] == NAMES  # the first cycle (every Trainer's set-up) in the given order
    # shuffled: no Trainer always follows the same one
    followers = {n: {c[c.index(n) + 1] for c in cycles if c.index(n) + 1 < len(c)} for n in NAMES}
    assert all(len(after) > 1 for after in followers.values()), followers
    assert _run(_Turns(NAMES, seed=4), steps) != rank0  # another round, another sequence


@pytest.mark.parametrize("failing", ["DDP", "ZeRO-1"])
def test_a_trainer_that_leaves_early_hands_the_turn_on(failing):
    steps = dict.fromkeys(NAMES, 6)
    ran = _run(_Turns(NAMES, seed=0), steps, fail_at={failing: 2})
    assert ran.count(failing) == 3
    assert all(ran.count(n) == 6 for n in NAMES if n != failing)


def test_trainers_with_different_step_counts_all_finish():
    steps = {"DDP": 3, "DDP again": 7, "ZeRO-0": 1, "ZeRO-1": 5, "ZeRO-2": 7}
    ran = _run(_Turns(list(steps), seed=1), steps)
    assert {n: ran.count(n) for n in steps} == steps


def test_a_trainer_failing_ends_the_process_at_once(tmp_path):
    """A failure on one rank only must not let this rank's next Trainer pair its collectives with the failed
    one's peers: the process exits non-zero at once (torchrun then stops the other ranks)."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "import overlap\n"
        "def fit(cfg, spec, k, turns, me, build=None):\n"
        "    for step in range(3):\n"
        "        print(me, 'step', step, flush=True)\n"
        "        if me == 'hybrid ZeRO-1' and step == 1:\n"
        "            raise ValueError('injected failure')\n"
        "        turns.hand_over(me)\n"
        "    return {'step_time': 1.0}\n"
        "overlap._fit = fit\n"
        "threading.Timer(20, lambda: print('still running', flush=True)).start()\n"
        "overlap._lockstep({}, ['DDP (Lightning)', 'hybrid ZeRO-0', 'hybrid ZeRO-1'], 1)\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "hybrid ZeRO-1 (K=1) failed on this rank" in proc.stderr and "injected failure" in proc.stderr
    assert "returned" not in proc.stdout and "still running" not in proc.stdout
    assert "step 1" in proc.stdout and "step 2" not in proc.stdout  # no Trainer ran another step after it
