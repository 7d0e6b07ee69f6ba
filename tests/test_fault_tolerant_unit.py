"""FaultTolerantCheckpoint's pure parts: the store, the resumable sampler, RNG capture, the watchdog."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid.callbacks import FaultTolerantCheckpoint, ResumableSampler
from lightning_hybrid.callbacks._resume import capture_rng, cuda_state_for, restore_rng
from lightning_hybrid.callbacks._watchdog import Watchdog, _Calls

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("shuffle", "drop_last"), [(True, False), (False, False), (True, True)])
def test_resumable_sampler_matches_distributed_sampler(world, shuffle, drop_last):
    n = 23
    for epoch in (0, 3):
        for rank in range(world):
            ref = DistributedSampler(
                range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            ours = ResumableSampler(n, num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


def test_resumable_sampler_resumes_mid_epoch_on_the_same_and_another_world():
    n, batch = 40, 3
    full = [ResumableSampler(n, num_replicas=2, rank=r, seed=1) for r in range(2)]
    for s in full:
        s.set_epoch(5)
    per_rank = [list(s) for s in full]
    consumed_batches = 4
    consumed = consumed_batches * batch * 2
    # same world: each rank continues exactly where its uninterrupted iteration was
    for r in range(2):
        s = ResumableSampler(n, num_replicas=2, rank=r, seed=1)
        s.set_epoch(5)
        s.resume_at(5, consumed)
        assert list(s) == per_rank[r][consumed_batches * batch :]
        # every iterator made in that epoch resumes (a loader with workers draws its indices when its iterator is
        # made, and the training iterator may be made again before the first batch); the next epoch starts at 0
        assert list(s) == per_rank[r][consumed_batches * batch :]
        s.set_epoch(6)
        fresh = ResumableSampler(n, num_replicas=2, rank=r, seed=1)
        fresh.set_epoch(6)
        assert list(s) == list(fresh)
        s.set_epoch(5)
        assert list(s) == per_rank[r]  # the resume point is gone with its epoch
    # a different world: the three ranks together see exactly the samples not yet consumed
    order = full[0].global_order(5)
    seen = []
    for r in range(3):
        s = ResumableSampler(n, num_replicas=3, rank=r, seed=1)
        s.set_epoch(5)
        s.resume_at(5, consumed)
        seen += list(s)
    # every sample not yet consumed, each once, plus (as DistributedSampler does) padding to a multiple of 3
    assert set(order[consumed:]) <= set(seen)
    assert len(seen) - (n - consumed) == (-(n - consumed)) % 3
    assert sorted(seen) == sorted(ResumableSampler(n, num_replicas=3, seed=1).global_order(5)[consumed:])
    # a resume point for another epoch is ignored
    s = ResumableSampler(n, num_replicas=2, rank=0, seed=1)
    s.set_epoch(6)
    s.resume_at(5, consumed)
    assert len(list(s)) == len(s)


def test_rng_capture_restores_every_stream():
    state = capture_rng()
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]
    # the saved state loads with weights_only=True (tensors and plain values only)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    assert torch.equal(torch.rand(3), first[0])


def test_the_cuda_stream_is_restored_by_the_device_a_process_runs_on_never_by_count():
    """A process restores the generator of its own device: from a checkpoint of this version, the one state it
    saved; from an older one (one state per GPU the saving process saw), the entry of its device if there is
    one. A restart that sees fewer GPUs than the saving process (another node, CUDA_VISIBLE_DEVICES) never
    fails (it raised IndexError on every restart before)."""
    own = torch.arange(4, dtype=torch.uint8)
    assert cuda_state_for(own, 3) is own  # whatever the device index: it is this process's own stream
    per_gpu = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]
    assert torch.equal(cuda_state_for(per_gpu, 5), per_gpu[5])
    assert cuda_state_for(per_gpu[:1], 5) is None  # saved seeing one GPU, restored on device 5 of 8
    assert cuda_state_for(None, 0) is None


def test_watchdog_fires_on_a_stalled_step_but_not_while_paused():
    reports: list[str] = []
    dog = Watchdog(timeout=1.5, rank=3, world_size=4, on_timeout=reports.append)
    dog.start()
    dog.beat(1)
    dog.pause()
    time.sleep(2.5)
    assert reports == []  # a long save is not a hang
    dog.resume()
    dog.beat(2)
    time.sleep(3.0)
    dog.stop()
    assert len(reports) == 1
    assert "[rank 3] watchdog: no training step finished" in reports[0]
    assert "last finished step 2" in reports[0]


class _FrozenStore:
    """A store whose host process is stopped: every call blocks (until ``thaw``: no thread outlives the test)."""

    def __init__(self) -> None:
        import threading

        self.thawed = threading.Event()

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.thawed.wait(3600)


def _paused_dog(store, reports: list[str]) -> Watchdog:
    dog = Watchdog(timeout=1.5, rank=0, world_size=2, on_timeout=reports.append)
    dog._store = _Calls(store)
    dog.start()
    dog.beat(1)
    dog.pause()  # a checkpoint's commit waits on the peer
    return dog


def test_a_watchdog_waiting_in_checkpoint_io_fires_only_once_a_peer_stops_its_heartbeat():
    """A save waits on every rank; a peer stopped (SIGSTOP, a hung node) used to keep it waiting forever."""
    store, reports = torch.distributed.HashStore(), []
    dog = _paused_dog(store, reports)
    for tick in range(40):  # the peer is alive for 4 s: the long save is not a hang
        store.set("lightning_hybrid/alive/1", str(tick))
        time.sleep(0.1)
    assert reports == []
    time.sleep(3.5)  # then it stops: within about 1.5 x the limit, the waiting rank exits
    dog.stop()
    assert len(reports) == 1, reports
    assert "waits in checkpoint I/O and rank(s) [1] sent no heartbeat for over 2s (stopped or hung)" in reports[0]


def test_a_watchdog_waiting_in_checkpoint_io_fires_when_the_store_stops_answering():
    reports: list[str] = []
    store = _FrozenStore()
    dog = _paused_dog(store, reports)
    time.sleep(5.0)
    dog._stop.set()
    store.thawed.set()
    assert len(reports) == 1, reports
    assert "the job's key-value store (hosted by rank 0) has not answered for" in reports[0]


def test_watchdog_derives_its_limit_from_step_times():
    dog = Watchdog(timeout=None, rank=0, world_size=1, min_timeout=10.0, factor=20.0, warmup=3)
    assert dog.limit() is None
    dog._durations.extend([0.5, 1.0, 2.0])
    assert dog.limit() == 20.0  # 20 x median 1.0
    dog._durations.extend([0.1] * 3)
    assert dog.limit() == 10.0  # never below min_timeout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 1}, "keep_last must be an integer >= 2, got 1; the previous checkpoint is the fallback"),
        ({"keep_last": 2.5}, "keep_last must be an integer >= 2, got 2.5"),
        ({"keep_last": True}, "keep_last must be an integer >= 2, got True"),
        ({"every_n_train_steps": 0}, "every_n_train_steps must be an integer >= 1 or None, got 0"),
        ({"every_n_minutes": -1}, "every_n_minutes must be a finite number > 0 or None, got -1"),
        ({"every_n_minutes": float("nan")}, "every_n_minutes must be a finite number > 0 or None, got nan"),
        ({"hang_timeout": -1}, "hang_timeout must be a finite number >= 0 or None, got -1; use None to derive"),
        ({"hang_timeout": float("inf")}, "hang_timeout must be a finite number >= 0 or None, got inf"),
        ({"nan_policy": "ignore"}, "nan_policy must be one of 'skip', 'rollback', 'raise', None, got 'ignore'"),
        ({"signals": ["SIGNOPE"]}, "Unknown signal name 'SIGNOPE'"),
        ({"signals": "SIGTERM"}, "signals must be a list of signal names"),
        ({"signals": ["SIGKILL"]}, "SIGKILL cannot be caught by any process"),
        ({"signals": ["SIGINT"]}, "SIGINT is Ctrl-C: it stops the run"),
        ({"requeue": "no"}, "requeue must be True or False or None, got 'no'"),
        ({"async_save": 1}, "async_save must be True or False, got 1"),
        ({"max_rollbacks": -1}, "max_rollbacks must be an integer >= 0, got -1"),
        ({"dirpath": ""}, "dirpath must be a folder path"),
    ],
)
def test_bad_arguments_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        FaultTolerantCheckpoint(**{"dirpath": tmp_path, **kwargs})
    assert message in str(excinfo.value)


def test_a_restarted_worker_gets_a_fresh_store(monkeypatch):
    monkeypatch.setattr("lightning_hybrid._elastic.RESTART_PAUSE_S", 0.0)
    # setenv first, so that the value the code under test writes is removed afterwards too: a marker left
    # in this process's environment would reach every job the later tests launch
    monkeypatch.setenv("LIGHTNING_HYBRID_FRESH_STORE", "1:29999")  # inherited from another process: ignored
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not prepare_elastic_restart()
    assert os.environ["MASTER_PORT"] == "29500"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert prepare_elastic_restart()
    assert os.environ["MASTER_PORT"] == "29503"
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert not prepare_elastic_restart()  # once per process
    assert os.environ["MASTER_PORT"] == "29503"
    assert os.environ["LIGHTNING_HYBRID_FRESH_STORE"] == f"{os.getpid()}:29503"


def _fit_single_device(tmp_path, steps: int, *, epochs_over: bool = False) -> dict[str, torch.Tensor]:
    import lightning as L
    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=64, stride=16)  # a short epoch: resume crosses epochs
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2, dropout=0.1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[FaultTolerantCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3)],
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path="last")
    assert trainer.num_training_batches < steps  # the run spans several epochs
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.trainer
def test_single_device_resume_across_an_epoch_boundary_is_bitwise_exact(tmp_path):
    uninterrupted = _fit_single_device(tmp_path / "a", 25)
    _fit_single_device(tmp_path / "b", 11)  # stops at 11; its last checkpoints are steps 9 and 11
    resumed = _fit_single_device(tmp_path / "b", 25)
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


def test_watchdog_beat_within_a_step_refreshes_the_clock_without_adding_a_step_time():
    dog = Watchdog(timeout=None, rank=0, world_size=1)
    dog.beat(1)
    dog.beat(1)  # a validation batch during fit: still step 1
    dog.beat(2)
    assert len(dog._durations) == 2


_EXIT_WITH_A_THREAD_IN_NATIVE_CODE = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from lightning_hybrid._torch_compat import note_failed_fit, wait_for_gloo_at_exit

class SlowFinaliser:  # finalisation that lasts: the store call below returns inside it
    def __init__(self, seconds):
        self.seconds = seconds
    def __del__(self, _sleep=time.sleep):
        _sleep(self.seconds)

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
wait_for_gloo_at_exit()  # as a fit sets up

def heartbeat():  # the watchdog's store thread, in a call that has not returned when the rank exits
    try:
        store.wait(["never"], timedelta(seconds=3 if sys.argv[1] == "ctrl-c" else 30))
    except Exception:
        pass

threading.Thread(target=heartbeat, name="lightning-hybrid-store", daemon=True).start()
sys.slow_finaliser = SlowFinaliser(6)  # cleared by finalisation alone
time.sleep(0.2)
if sys.argv[1] == "ctrl-c":
    note_failed_fit(KeyboardInterrupt())  # what on_exception records when Ctrl-C ends the fit
    print(f"exit begins at {time.monotonic()}", file=sys.stderr, flush=True)  # the host's clock: start-up apart
    raise SystemExit(1)  # Lightning's exit after a KeyboardInterrupt
note_failed_fit(ValueError("caught by the script, which goes on"))
raise SystemExit(0)  # the script ends well: its code is not the hook's to change
"""


def test_an_exit_with_a_pack_thread_in_native_code_leaves_with_the_fits_code_instead_of_sigabrt(tmp_path):
    """A daemon thread of the pack inside a native call (a store heartbeat, a background checkpoint write in a
    collective) when the rank exits: the call returned during finalisation, the thread took the GIL, CPython
    ended it with ``pthread_exit`` and the unwind through C++ called ``std::terminate`` ("terminate called
    without an active exception", SIGABRT: 4 of 98 Ctrl-Cs of the soak). Without the exit hook this script
    aborts every time; with it the process leaves after 2 s with the failed fit's exit code."""
    import subprocess
    import sys

    script = tmp_path / "exit_busy.py"
    script.write_text(_EXIT_WITH_A_THREAD_IN_NATIVE_CODE)
    done = subprocess.run([sys.executable, str(script), "ctrl-c"], capture_output=True, text=True, timeout=60)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "without finalising the interpreter: lightning-hybrid-store" in done.stderr
    # from the exit's start (the interpreter's start-up, seconds on a loaded machine, apart): it left before the
    # slow finalisation's 6 s ended, and did not wait for the heartbeat
    began = float(done.stderr.split("exit begins at ")[1].split()[0])
    assert time.monotonic() - began < 6, done.stderr[-2000:]
    # a failure the script caught is not the process's end: its own exit code stands (the hook stays out)
    done = subprocess.run([sys.executable, str(script), "caught"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "without finalising" not in done.stderr


def test_each_engine_records_the_exit_code_of_a_fit_that_ends_the_process_and_nothing_else():
    """A KeyboardInterrupt (Lightning exits 1) and a SystemExit (the preemption's 75) end the process: recorded.
    An error reaches the user's script, which may catch it and go on: not recorded (a test suite that caught
    one, then ended with a thread still busy, exited 1 while every test passed)."""
    from lightning_hybrid import _torch_compat
    from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy

    try:
        for owner in (FaultTolerantCheckpoint(dirpath="unused"), HybridParallelStrategy(), DeepSpeedPipelineStrategy()):
            for exception, code in ((KeyboardInterrupt(), 1), (SystemExit(75), 75), (ValueError("x"), None)):
                _torch_compat.wait_for_gloo_at_exit()  # a fit sets up: nothing recorded
                assert _torch_compat._exit_code() is None
                if isinstance(owner, FaultTolerantCheckpoint):
                    owner.on_exception(None, None, exception)
                else:
                    owner.on_exception(exception)
                assert _torch_compat._exit_code() == code, (type(owner).__name__, exception)
    finally:
        _torch_compat.note_failed_fit(None)  # this process goes on: nothing ends it
