"""The plan of a resume on another number of data-parallel replicas, checked against hand-computed batches."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from lightning_hybrid.callbacks import AccumulationScheduler, FaultTolerantCheckpoint
from lightning_hybrid.callbacks._world_change import Batching, plan


def _position(replicas=2, batch_size=4, accumulation=1, world=4, consumed=64, epoch=0):
    return {"epoch": epoch, "consumed": consumed, "replicas": replicas, "batch_size": batch_size,
            "accumulation": accumulation, "world": world}  # fmt: skip


def test_fewer_replicas_multiply_the_accumulation_and_the_counter_is_in_this_worlds_batches():
    change = plan(_position(), world=2, replicas=1, batch_size=4, accumulation=1, policy="keep_global_batch")
    assert change is not None and change.new == Batching(1, 4, 2, world=2) and change.factor == 2
    assert change.new.global_batch == change.old.global_batch == 8
    assert change.batches() == 64 // 4  # 8 two-rank batches of 8 samples = 16 one-rank batches of 4
    assert change.line() == (
        "world 4 -> 2 (dp 2 -> 1): accumulation 1 -> 2, global batch 8 kept, resuming at sample 64 of epoch 0"
    )
    back = plan(_position(1, 4, 2, world=2), world=4, replicas=2, batch_size=4, accumulation=2,
                policy="keep_global_batch")  # fmt: skip
    assert back is not None and back.new == Batching(2, 4, 1, world=4) and back.batches() == 8


def test_a_fractional_accumulation_changes_the_per_rank_batch_or_refuses_with_the_usable_worlds():
    # 1 replica x 4 x K=1 onto 2 replicas: K would be 1/2; a per-rank batch of 2 keeps 4 samples per step
    change = plan(_position(1, 4, 1, world=1, consumed=12), world=2, replicas=2, batch_size=4, accumulation=1,
                  policy="keep_global_batch")  # fmt: skip
    assert change is not None and change.new == Batching(2, 2, 1, world=2) and change.batches() == 3
    assert "per-rank batch 4 -> 2, global batch 4 kept" in change.line()
    # ...not when the pipeline needs 4 micro-batches per batch, nor when the epoch's batches are limited
    for kwargs in ({"microbatches": 4}, {"resize_problem": "there is more than one training loader"}):
        with pytest.raises(ValueError, match="cannot keep the global batch") as error:
            plan(_position(1, 4, 1, world=1), world=2, replicas=2, batch_size=4, accumulation=1,
                 policy="keep_global_batch", **kwargs)  # fmt: skip
        assert "Resume on a world with 1 data-parallel replica(s)" in str(error.value)
        assert "Nothing was deleted" in str(error.value)
    # 2 x 4 x 1 onto 3 replicas: neither K (2/3) nor a batch (8/3) is whole
    with pytest.raises(ValueError, match=r"accumulation 1 x 2/3 = 2/3 is not a whole number, nor is a per-rank"):
        plan(_position(), world=3, replicas=3, batch_size=4, accumulation=1, policy="keep_global_batch")
    # DeepSpeed fixes its accumulation: the per-rank batch to configure is named
    with pytest.raises(ValueError, match="set the per-rank batch size to 8 in the configuration"):
        plan(_position(), world=1, replicas=1, batch_size=4, accumulation=1, policy="keep_global_batch",
             engine="DeepSpeed")  # fmt: skip


def test_the_other_policies_and_an_unchanged_world():
    assert plan(_position(), world=4, replicas=2, batch_size=4, accumulation=1, policy="refuse") is None
    assert plan({"epoch": 0, "consumed": 8}, world=2, replicas=1, batch_size=4, accumulation=1,
                policy="refuse") is None  # an earlier version's position says nothing of its world  # fmt: skip
    with pytest.raises(ValueError, match=r"on_world_size_change='refuse'.*Nothing was deleted"):
        plan(_position(), world=2, replicas=1, batch_size=4, accumulation=1, policy="refuse")
    kept = plan(_position(accumulation=2, consumed=40), world=2, replicas=1, batch_size=4, accumulation=2,
                policy="keep_per_rank_batch")  # fmt: skip
    assert kept is not None and kept.new == Batching(1, 4, 2, world=2)
    assert kept.batches() == 10  # 40 samples = 10 batches of 4, a whole window of K=2
    assert "global batch 16 -> 8" in kept.line()
    with pytest.raises(ValueError, match="on_world_size_change must be one of"):
        FaultTolerantCheckpoint(dirpath="x", on_world_size_change="keep")  # type: ignore[arg-type]


def test_an_accumulation_schedule_is_rescaled_whole_or_not_at_all():
    sched = AccumulationScheduler(schedule={0: 1, 100: 2, 200: 4}, unit="samples")
    assert sched.can_rescale_accumulation(Fraction(2)) and not sched.can_rescale_accumulation(Fraction(1, 2))
    sched.k = 2  # at K=2 (past 100 samples), halving K is whole, but the schedule's first K is not
    with pytest.raises(ValueError, match="schedule's K values x 1/2 are not all whole"):
        plan(_position(1, 4, 2, world=1), world=2, replicas=2, batch_size=4, accumulation=2,
             policy="keep_global_batch", schedule=sched, microbatches=4)  # fmt: skip
    sched.k = 1
    assert sched.rescale_accumulation(Fraction(2)) == 2 and sched.scale == 2
    assert sched.can_rescale_accumulation(Fraction(1, 2))  # back on the original world
    restored = AccumulationScheduler(schedule={0: 1, 100: 2, 200: 4}, unit="samples")
    restored.load_state_dict(sched.state_dict())
    assert restored.scale == 2 and restored.k == 2


def test_a_restart_on_the_same_world_keeps_the_accumulation_an_earlier_resume_rescaled():
    """2 ranks -> 1 (K 1 -> 2), then the 1-rank job restarts on 1 rank: the configuration still says K=1, the
    checkpoint K=2; the global batch of the uninterrupted run is kept, and the line says so."""
    position = {**_position(1, 4, 2, world=1, consumed=40), "configured": 1}
    change = plan(position, world=1, replicas=1, batch_size=4, accumulation=1, policy="keep_global_batch")
    assert change is not None and change.new == Batching(1, 4, 2, world=1) and change.batches() == 10
    assert "accumulation 2 kept from the checkpoint (accumulate_grad_batches=1 configured" in change.line()
    assert "global batch 8 kept" in change.line()
    for policy in ("keep_per_rank_batch", "refuse"):  # the configured K is the user's choice there
        assert plan(position, world=1, replicas=1, batch_size=4, accumulation=1, policy=policy) is None


def test_per_rank_state_is_restored_from_the_rank_that_had_the_same_role():
    """pp2 x dp2 (ranks: stage x 2 + replica) -> pp2 x dp1: the second stage's rank 1 restores old rank 2 (stage
    1, replica 0), not old rank 1 (stage 0, replica 1); back to dp2, replica 1 had no role in the dp1 world."""
    from lightning_hybrid.callbacks._resume import counterpart_rank

    pp2dp2 = {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 1}
    pp2dp1 = {"pipeline_parallel_size": 2, "data_parallel_size": 1, "tensor_parallel_size": 1}
    assert [counterpart_rank(r, pp2dp1, pp2dp2) for r in range(2)] == [0, 2]
    assert [counterpart_rank(r, pp2dp2, pp2dp1) for r in range(4)] == [0, None, 1, None]
    assert [counterpart_rank(r, None, None) for r in range(3)] == [0, 1, 2]  # Lightning's strategies: replicas


def test_a_checkpoint_from_8_visible_devices_restores_on_4_and_on_1_by_the_local_device():
    """Each process saved its own device's CUDA generator (this version); a checkpoint of an earlier version holds
    one state per device the saving process saw. Restored on a node with 4 or 1 visible devices, each process
    takes its own device's stream, never an index past what it sees (no GPU needed: the mapping is pure)."""
    from lightning_hybrid.callbacks._resume import cuda_state_for

    per_device = [torch.full((4,), i, dtype=torch.uint8) for i in range(8)]  # saved seeing 8 devices
    for visible in (4, 1):
        for device in range(visible):
            assert torch.equal(cuda_state_for(per_device, device), per_device[device])
    own = per_device[6]  # this version: the process on device 6 saved only its own stream
    for device in (3, 0):  # its role continues on device 3 of 4, or 0 of 1
        assert cuda_state_for(own, device) is own


def test_review_cases_restart_after_a_resize_mid_window_checkpoints_and_a_changed_configuration():
    # a restart on the same 3 replicas after an earlier resume made the per-rank batch 8 (configured: 6)
    restart = plan(_position(3, 8, 2, world=3, consumed=48), world=3, replicas=3, batch_size=6, accumulation=2,
                   policy="keep_global_batch")  # fmt: skip
    assert restart is not None and restart.new == Batching(3, 8, 2, world=3) and restart.same_batches
    assert "per-rank batch 6 -> 8, global batch 48 kept, resuming at sample 48" in restart.line()
    # keep_per_rank_batch onto 3 replicas from sample 16: every replica must get as many batches (a whole
    # window of 12 samples): the resume starts at 12 and says so
    uneven = plan(_position(consumed=16), world=3, replicas=3, batch_size=4, accumulation=1,
                  policy="keep_per_rank_batch")  # fmt: skip
    assert uneven is not None and uneven.resume_sample() == 12 and uneven.batches() == 1
    assert "written at sample 16, inside one of this world's accumulation windows" in uneven.line()
    # a checkpoint written mid-window (a preemption during validation): the new world's window is taken again
    mid = plan(_position(2, 4, 4, consumed=80), world=8, replicas=4, batch_size=4, accumulation=4,
               policy="keep_global_batch")  # fmt: skip
    assert mid is not None and mid.new.accumulation == 2 and mid.resume_sample() == 64 and mid.batches() == 4
    # the configuration's K changed since the rescaling run: the user's choice stands
    position = {**_position(1, 4, 2, world=1, consumed=40), "configured": 1}  # type: ignore[dict-item]
    assert plan(position, world=1, replicas=1, batch_size=4, accumulation=4, policy="keep_global_batch") is None
    kept = plan(position, world=1, replicas=1, batch_size=4, accumulation=1, policy="keep_global_batch")
    assert kept is not None and kept.new.accumulation == 2 and kept.same_batches
    with pytest.raises(ValueError, match="limit_train_batches=5 counts per-rank batches"):
        plan(_position(), world=2, replicas=1, batch_size=4, accumulation=1, policy="keep_global_batch",
             keep_problem="limit_train_batches=5 counts per-rank batches")  # fmt: skip


def test_an_adaptive_schedule_keeps_windows_of_two_after_a_rescale():
    sched = AccumulationScheduler(unit="adaptive", min_k=2, max_k=16)
    sched.k = 4
    assert sched.can_rescale_accumulation(Fraction(2))
    assert not sched.can_rescale_accumulation(Fraction(1, 2))  # min_k 2 -> 1: no noise scale measured
