"""Checkpoints written in one layout resume exactly in another; consolidate_checkpoint gives plain weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, child_env, launch
from reference import reference_run

TOTAL, FIRST = 4, 2
BASE = {"model": {"optimizer": "adamw", "lr": 0.01, "n_layer": 4}, "data": {"global_batch": 8}}


def _hybrid(**kwargs):
    return {"name": "hybrid_class", "kwargs": {"num_microbatches": 2, **kwargs}}


@pytest.mark.multiproc
def test_resume_into_other_layouts_matches_uninterrupted_run(tmp_path):
    ref_losses, ref_weights = reference_run(BASE, steps=TOTAL)
    saved = tmp_path / "pp2dp2z2"
    first = launch(
        "train_gpt.py",
        {**BASE, "steps": FIRST, "devices": 4, "save": str(saved),
         # small buckets: the optimizer steps (and saves) each shard as several chunks
         "strategy": _hybrid(pipeline_parallel_size=2, data_parallel_size=2, zero_stage=2,
                             zero={"bucket_size_mb": 0.01})},
        nproc=4,
    )  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(first.rank(0)["losses"]), torch.tensor(ref_losses[:FIRST]), rtol=0, atol=1e-5
    )

    # the AdamW moments must travel too: resuming with fresh optimizer state would change steps 3-4
    targets = {
        "pp1_dp2_z0": (2, _hybrid(pipeline_parallel_size=1, data_parallel_size=2, zero_stage=0)),
        "pp4_dp1_z1": (4, _hybrid(pipeline_parallel_size=4, data_parallel_size=1, zero_stage=1, num_microbatches=4)),
        # ZeRO shards of other boundaries: each rank reads only the parts of the saved shards it owns now
        "pp1_dp4_z1": (
            4,
            _hybrid(pipeline_parallel_size=1, data_parallel_size=4, zero_stage=1, zero={"bucket_size_mb": 0.004}),
        ),
        "pp2_dp1_z3_gpipe": (
            2,
            _hybrid(pipeline_parallel_size=2, data_parallel_size=1, zero_stage=3, schedule="gpipe"),
        ),
    }
    for name, (nproc, strategy) in targets.items():
        out = tmp_path / name
        job = launch(
            "train_gpt.py",
            {**BASE, "steps": TOTAL, "devices": nproc, "strategy": strategy, "resume": str(saved),
             "data": {**BASE["data"], "skip": FIRST}, "save": str(out / "ckpt"), "weights": str(out / "w.pt")},
            nproc=nproc,
        )  # fmt: skip
        assert job.rank(0)["global_step"] == TOTAL
        # without a pipeline each rank reports its own half-batch loss, as under DDP: compare their mean
        mean_loss = torch.tensor([job.rank(r)["losses"] for r in range(nproc)]).mean(0)
        torch.testing.assert_close(
            mean_loss, torch.tensor(ref_losses[FIRST:]), rtol=0, atol=1e-5,
            msg=f"{name}: resumed losses differ from the uninterrupted run",
        )  # fmt: skip
        weights = torch.load(out / "w.pt")
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, rtol=0, atol=1e-4, msg=f"{name}: {key} differs")


@pytest.mark.multiproc
def test_consolidated_checkpoint_loads_into_unsplit_module(tmp_path):
    from gpt import GPT

    ckpt = tmp_path / "ckpt"
    launch(
        "train_gpt.py",
        {
            **BASE,
            "steps": 2,
            "devices": 2,
            "save": str(ckpt),
            "strategy": _hybrid(pipeline_parallel_size=2, zero_stage=0),
        },
        nproc=2,
    )
    out = tmp_path / "single.ckpt"
    cmd = [sys.executable, "-m", "lightning_hybrid.utilities.consolidate", str(ckpt), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    model = GPT.load_from_checkpoint(out)
    _, ref_weights = reference_run(BASE, steps=2)
    for key, ref in ref_weights.items():
        torch.testing.assert_close(model.state_dict()[key], ref, rtol=0, atol=1e-4)
