"""Tensor parallelism as the third axis (pp x dp x tp): every layout reproduces a single-process run."""

from __future__ import annotations

import pytest
from reference import reference_run
from test_hybrid_exactness import BASE, _run_layout

CLIP = {"trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, "accumulate": 2, "clip": 0.05}


def _whole_numel(model=None) -> int:
    base = {**BASE, "model": {**BASE["model"], **(model or {})}}
    return sum(t.numel() for t in reference_run(base, steps=0)[1].values())


def _check_split(job, nproc: int, *, model=None, pp: int = 1) -> None:
    """Each tensor-parallel rank stores about 1/tp of its stage (norms, biases of row-wise layers and the
    position embedding stay whole)."""
    tp = job.rank(0)["layout"]["tp"]
    held = [job.rank(r)["held_numel"] for r in range(nproc)]
    whole = _whole_numel(model)
    replica = sum(held) / (nproc // (tp * pp))  # what one replica's ranks hold between them
    assert whole <= replica < whole * 1.1, (held, whole)  # all of it, little of it twice
    assert max(held) < whole / tp * (0.7 if pp > 1 else 1.1), (held, whole)  # a stage: at most 70% of a model


@pytest.mark.multiproc
def test_tp2_with_accumulation_and_clipping_matches_single_process(tmp_path):
    job = _run_layout(tmp_path, {"tensor_parallel_size": 2}, nproc=2, trainer=CLIP["trainer"], accumulate=2, clip=0.05)
    assert job.rank(0)["layout"] == {"pp": 1, "dp": 1, "tp": 2}
    # tensor-parallel peers read the same batches: one data-parallel replica
    assert [job.rank(r)["sampler"] for r in range(2)] == [{"num_replicas": 1, "rank": 0}] * 2
    _check_split(job, 2)


@pytest.mark.multiproc
def test_pp2_tp2_matches_single_process(tmp_path):
    kwargs = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "num_microbatches": 2}
    job = _run_layout(tmp_path, kwargs, nproc=4, trainer=CLIP["trainer"], accumulate=2, clip=0.05)
    assert job.rank(0)["layout"] == {"pp": 2, "dp": 1, "tp": 2}
    _check_split(job, 4, pp=2)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_dp2_tp2_every_zero_stage_matches_single_process(tmp_path, zero_stage):
    kwargs = {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": zero_stage}
    job = _run_layout(tmp_path, kwargs, nproc=4, trainer=CLIP["trainer"], accumulate=2, clip=0.05)
    assert job.rank(0)["layout"] == {"pp": 1, "dp": 2, "tp": 2}
    # tensor-parallel ranks are adjacent and share a data-parallel index
    assert [job.rank(r)["sampler"]["rank"] for r in range(4)] == [0, 0, 1, 1]
