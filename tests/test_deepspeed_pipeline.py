"""DeepSpeedPipelineStrategy: DeepSpeed's pipeline engine, exact against one process, resumed in any layout
and in the other engine, killed and resumed, from LightningCLI YAML; what it cannot do is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, launch
from reference import reference_run

from lightning_hybrid.strategies import DeepSpeedPipelineStrategy
from lightning_hybrid.strategies.deepspeed.config import EngineRequest, load_config, merge_config

# SGD with momentum: its state must travel through every checkpoint
MODEL = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "n_layer": 4}
BASE = {"model": MODEL, "data": {"global_batch": 8}}
STEPS = 6  # the AdamW chain


def _ds(pp: int = 2, zero_stage: int = 0, **kwargs) -> dict:
    return {"name": "deepspeed_class", "kwargs": {"pipeline_parallel_size": pp, "num_microbatches": 2,
                                                  "zero_stage": zero_stage, **kwargs}}  # fmt: skip


def _run(tmp: Path, name: str, nproc: int, strategy: dict, steps: tuple[int, int], clip, resume=None, base=BASE):
    """Train steps[0]+1 .. steps[1] (resuming from `resume`), save, and return (losses, consolidated weights)."""
    first, last = steps
    out = tmp / name
    cfg = {**base, "devices": nproc, "strategy": strategy, "steps": last, "save": str(out / "ckpt"),
           "weights": str(out / "w.pt"), "out": str(out), "trainer": {"gradient_clip_val": clip},
           "data": {**base["data"], "skip": first}, **({"resume": str(resume)} if resume else {})}  # fmt: skip
    job = launch("train_gpt.py", cfg, nproc=nproc)
    losses = [job.rank(r)["losses"] for r in range(nproc)]
    assert all(rank_losses == losses[0] for rank_losses in losses), f"{name}: ranks report different losses"
    assert job.rank(0)["global_step"] == last
    return losses[0], torch.load(out / "w.pt"), out / "ckpt"


def _compare(name: str, losses, weights, ref_losses, ref_weights) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5,
                               msg=lambda m: f"{name}: per-step losses differ from one process\n{m}")  # fmt: skip
    assert weights.keys() == ref_weights.keys(), f"{name}: {sorted(set(weights) ^ set(ref_weights))}"
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=0, atol=1e-4, msg=lambda m, k=key: f"{name}: {k}\n{m}")


@pytest.mark.multiproc
@pytest.mark.parametrize("clip", [None, 0.5], ids=["unclipped", "clip0.5"])
def test_exact_against_one_process_and_resumed_across_layouts_and_into_the_native_engine(tmp_path, clip):
    """pp2 and pp2 x dp2, each with ZeRO-0 and ZeRO-1, against one process (losses 1e-5, weights 1e-4); each
    launch trains two steps from the previous one's checkpoint in another layout; the clipped chain ends in
    HybridParallelStrategy."""
    layouts = {"pp2_z0": (2, _ds(zero_stage=0)), "pp2_z1": (2, _ds(zero_stage=1)),
               "pp2x2_z0": (4, _ds(zero_stage=0)), "pp2x2_z1": (4, _ds(zero_stage=1))}  # fmt: skip
    native = (
        2,
        {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2, "zero_stage": 1}},
    )
    if clip:
        chain = [(n, *layouts[n]) for n in ("pp2_z0", "pp2x2_z1", "pp2_z1", "pp2x2_z0")] + [("native", *native)]
    else:
        chain = [(n, *layouts[n]) for n in ("pp2x2_z0", "pp2_z1", "pp2x2_z1", "pp2_z0")]
    ref_losses, _ = reference_run(BASE, steps=2 * len(chain), clip=clip)
    resume = None
    for i, (name, nproc, strategy) in enumerate(chain):
        steps = (2 * i, 2 * i + 2)
        losses, weights, resume = _run(tmp_path, name, nproc, strategy, steps, clip, resume)
        _, ref_weights = reference_run(BASE, steps=steps[1], clip=clip)
        _compare(name, losses, weights, ref_losses[steps[0] : steps[1]], ref_weights)


@pytest.mark.multiproc
def test_adamw_state_travels_between_deepspeeds_flat_partitions_and_the_native_engine(tmp_path):
    """AdamW (per-element moments and a scalar step, which DeepSpeed's ZeRO-1 keeps once per flat partition),
    started from pretrained weights (init_from): DeepSpeed ZeRO-1 -> HybridParallelStrategy ZeRO-0 ->
    DeepSpeed ZeRO-1, exact against one process that starts from the same weights."""
    from workers.common import build_model

    base = {"model": {"optimizer": "adamw", "lr": 0.01, "n_layer": 4}, "data": {"global_batch": 8}}
    pretrained = tmp_path / "pretrained.pt"
    torch.save(build_model({**base, "seed": 7}).state_dict(), pretrained)  # the workers build with seed 0
    ref_losses, _ = reference_run({**base, "seed": 7}, steps=STEPS)
    native = {"name": "hybrid_class", "kwargs": {"pipeline_parallel_size": 2, "num_microbatches": 2}}
    chain = [
        ("ds_z1_init_from", _ds(zero_stage=1, init_from=str(pretrained))),
        ("native_z0", native),
        ("ds_z1_again", _ds(zero_stage=1)),
    ]
    resume = None
    for i, (name, strategy) in enumerate(chain):
        steps = (2 * i, 2 * i + 2)
        losses, weights, resume = _run(tmp_path, name, 2, strategy, steps, None, resume, base=base)
        _, ref_weights = reference_run({**base, "seed": 7}, steps=steps[1])
        _compare(name, losses, weights, ref_losses[steps[0] : steps[1]], ref_weights)


@pytest.mark.multiproc
def test_bf16_runs_deepspeeds_bf16_engine_and_resumes_bit_exactly(tmp_path):
    """precision='bf16-mixed' under ZeRO-1: DeepSpeed's bf16 optimizer (fp32 master and accumulation); near
    the fp32 run, and two steps + a resume give exactly the four uninterrupted steps (the fp32 master
    weights and the optimizer state travel; the checkpoint holds fp32)."""
    base = {"model": {"optimizer": "adamw", "lr": 0.01, "n_layer": 4}, "data": {"global_batch": 8}, "devices": 2,
            "trainer": {"precision": "bf16-mixed"}, "strategy": _ds(zero_stage=1)}  # fmt: skip

    def run(name: str, steps: int, **extra) -> tuple[list[float], dict]:
        cfg = {**base, "steps": steps, "save": str(tmp_path / name), "weights": str(tmp_path / f"{name}.pt"),
               "out": str(tmp_path / f"{name}-out"), **extra}  # fmt: skip
        return launch("train_gpt.py", cfg, nproc=2).rank(0)["losses"], torch.load(tmp_path / f"{name}.pt")

    # init_from: DeepSpeed builds its fp32 master copy from the bf16 parameters; the pretrained fp32 values
    # must reach it unrounded (the checkpoint of step 0 holds the masters)
    from workers.common import build_model

    pretrained = tmp_path / "pretrained.pt"
    torch.save(build_model({**base, "seed": 7}).state_dict(), pretrained)
    _, start = run("init", 0, strategy=_ds(zero_stage=1, init_from=str(pretrained)))
    want = torch.load(pretrained)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in want.values())  # not representable in bf16
    assert all(torch.equal(start[k], want[k]) for k in want), "the fp32 masters were rounded to bf16"

    full, weights = run("full", 4)
    first, _ = run("first", 2)
    second, resumed = run("second", 4, resume=str(tmp_path / "first"), data={**base["data"], "skip": 2})
    assert first + second == full
    assert all(v.dtype == torch.float32 for v in weights.values()) and weights.keys() == resumed.keys()
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    ref, _ = reference_run({k: v for k, v in base.items() if k in ("model", "data")}, steps=4)
    torch.testing.assert_close(torch.tensor(full), torch.tensor(ref), rtol=0, atol=5e-3)  # bf16 compute


@pytest.mark.multiproc
def test_kill9_mid_run_restarts_and_ends_with_the_uninterrupted_weights(tmp_path):
    """FaultTolerantCheckpoint around the engine: pp2 ZeRO-1 with dropout, one rank killed with SIGKILL at step 5,
    torchrun restarts both, they resume from step 4 and end bit-identical to the uninterrupted run."""
    common = {"strategy": _ds(zero_stage=1), "steps": 8, "model": {"dropout": 0.1}}

    def job(name: str, **extra) -> dict:
        ft = {"dirpath": str(tmp_path / name / "ckpt"), "every_n_train_steps": 2, "nan_policy": "rollback"}
        return {"ft": ft, **common,
                "weights": str(tmp_path / name / "w.pt"), "out": str(tmp_path / name / "out"), **extra}  # fmt: skip

    ref_cfg = job("ref")
    ref = launch("fault_tolerant.py", ref_cfg, nproc=2)
    cfg = job("kill", inject={"kill": {"step": 5, "rank": 1}})
    killed = launch("fault_tolerant.py", cfg, nproc=2, max_restarts=1, timeout=300)
    for rank in (0, 1):
        assert killed.rank(rank)["attempt"] == 1, f"rank {rank} was not restarted"
        assert killed.rank(rank)["resumed_from"].endswith("step-000000004")  # the pack's sharded folder
        assert killed.rank(rank)["global_step"] == 8
    for step in ("6", "7", "8"):
        assert killed.rank(0)["steps"][step]["loss"] == ref.rank(0)["steps"][step]["loss"], step
    a, b = torch.load(ref_cfg["weights"]), torch.load(cfg["weights"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((tmp_path / "kill" / "ckpt" / "step-000000008" / "manifest.json").read_text())
    assert manifest["layout"]["engine"] == "deepspeed" and ".metadata" in manifest["files"]


@pytest.mark.multiproc
def test_nan_loss_rolls_back_to_the_last_checkpoint_on_every_rank(tmp_path):
    """The engine steps inside training_step, so a NaN loss (on the last stage, rank 1) reaches the weights;
    FaultTolerantCheckpoint(nan_policy='rollback') reads the step-4 checkpoint back into the engine."""
    cfg = {"ft": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 2, "nan_policy": "rollback"},
           "strategy": _ds(zero_stage=1), "steps": 8, "inject": {"nan": {"step": 5, "rank": 1}},
           "model": {"warmup_steps": 20, "max_steps": 20}, "out": str(tmp_path / "out")}  # fmt: skip
    result = launch("fault_tolerant.py", cfg, nproc=2)
    for rank in (0, 1):
        report, steps = result.rank(rank), result.rank(rank)["steps"]
        assert report["rollbacks"] == 1 and report["global_step"] == 8
        assert steps["6"]["digest"] == steps["4"]["digest"]  # back to the checkpoint of step 4
        assert steps["7"]["digest"] != steps["6"]["digest"]  # and training goes on, finite
        assert all(v["digest"] == v["digest"] for v in steps.values())


@pytest.mark.multiproc
def test_lightning_cli_config_trains_the_example_gpt(tmp_path):
    import subprocess
    import sys

    from helpers import child_env

    # Lightning's own launcher starts the processes, as `python examples/gpt.py fit --config ...` does
    cmd = [
        sys.executable, "examples/gpt.py", "fit", "--config", "examples/configs/deepspeed_pipeline.yaml",
        "--trainer.devices=2", "--trainer.max_steps=6", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "DeepSpeedPipelineStrategy: pipeline_parallel_size=2, data_parallel_size=1" in out
    assert "optimizer steps   6" in out and "val_loss" in out


_ONE_BLOCK = """
seed_everything: 1234
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_hybrid.strategies.{engine}
    init_args:
      pipeline_parallel_size: 2
      zero_stage: 1
  max_steps: 4
  limit_val_batches: 0
  enable_progress_bar: false
  enable_checkpointing: false
  logger: false
  default_root_dir: {root}
model:
  n_layer: 2
  d_model: 32
  n_head: 2
data:
  block_size: 32
  batch_size: 8
"""


@pytest.mark.multiproc
def test_the_same_yaml_with_only_class_path_changed_trains_under_either_engine(tmp_path):
    """One strategy block, the two engines: the same spellings and defaults resolve to the same layout (the
    unset data-parallel size and micro-batches included), and both train the example."""
    import re
    import subprocess
    import sys

    from helpers import child_env

    layouts = {}
    for engine in ("HybridParallelStrategy", "DeepSpeedPipelineStrategy"):
        config = tmp_path / f"{engine}.yaml"
        config.write_text(_ONE_BLOCK.format(engine=engine, root=tmp_path / engine))
        cmd = [sys.executable, "examples/gpt.py", "fit", "--config", str(config)]
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert "`Trainer.fit` stopped: `max_steps=4` reached" in out, out[-3000:]
        layouts[engine] = re.search(rf"{engine}: (.*)", out).group(1)
    assert (
        layouts["HybridParallelStrategy"]
        == layouts["DeepSpeedPipelineStrategy"]
        == ("pipeline_parallel_size=2, data_parallel_size=1, zero_stage=1, schedule=1f1b, stages=2, num_microbatches=2")
    )


@pytest.mark.unit
def test_construction_refuses_what_the_engine_cannot_do():
    with pytest.raises(ValueError, match=r"supports ZeRO-0 and ZeRO-1 only .* HybridParallelStrategy shards"):
        DeepSpeedPipelineStrategy(pipeline_parallel_size=2, zero_stage=2)
    with pytest.raises(ValueError, match="partition_method must be 'parameters', 'uniform' or 'type:REGEX'"):
        DeepSpeedPipelineStrategy(pipeline_parallel_size=2, partition_method="balanced")
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1 or None, got 0"):
        DeepSpeedPipelineStrategy(pipeline_parallel_size=2, num_microbatches=0)


def _request(**kwargs) -> EngineRequest:
    fields = {
        "micro_batch_size": 4,
        "num_microbatches": 2,
        "data_parallel_size": 2,
        "zero_stage": 1,
        "gradient_clip_val": None,
        "precision": "32-true",
        "client_optimizer": True,
    }
    return EngineRequest(**{**fields, **kwargs})  # fmt: skip


@pytest.mark.unit
def test_config_takes_what_lightning_owns_and_shows_both_values_of_a_conflict(tmp_path):
    config = merge_config({"zero_optimization": {"stage": 1}, "wall_clock_breakdown": False}, _request())
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 16 and config["zero_optimization"]["stage"] == 1
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's silent default of 1.0 never applies
    assert config["zero_allow_untested_optimizer"] is True and config["wall_clock_breakdown"] is False
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False
    assert merge_config({"gradient_clipping": 1.0}, _request())["gradient_clipping"] == 1.0  # asked in the config
    assert merge_config({}, _request(gradient_clip_val=0.5))["gradient_clipping"] == 0.5
    bf16 = merge_config({"bfloat16": {"enabled": True}}, _request(precision="bf16-mixed"))  # DeepSpeed's alias
    assert bf16["bf16"]["enabled"] is True and "bfloat16" not in bf16
    assert bf16["data_types"]["grad_accum_dtype"] == "fp32"  # as Lightning's bf16-mixed accumulates
    with pytest.raises(ValueError, match="with zero_stage=0 accumulates bf16 gradients only in bf16"):
        merge_config({}, _request(precision="bf16-mixed", zero_stage=0))
    asked = {"data_types": {"grad_accum_dtype": "bf16"}}
    assert merge_config(asked, _request(precision="bf16-mixed", zero_stage=0))["bf16"]["enabled"] is True

    bad = {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 0}}  # fmt: skip
    with pytest.raises(ValueError) as info:
        merge_config(bad, _request(gradient_clip_val=0.5))
    message = str(info.value)
    for line in (
        "gradient_accumulation_steps: the config says 4, the strategy's num_microbatches says 2",
        "gradient_clipping: the config says 1.0, Trainer(gradient_clip_val=...) says 0.5",
        "bf16.enabled: the config says True, Trainer(precision='32-true') says False",
        "zero_optimization.stage: the config says 0, the strategy's zero_stage says 1",
        "optimizer: the config names one and configure_optimizers returns one",
    ):
        assert line in message, message
    with pytest.raises(ValueError, match="scheduler: the config names one; return the LR scheduler from"):
        merge_config({"scheduler": {"type": "WarmupLR"}}, _request())
    with pytest.raises(ValueError, match=r"torch_autocast\.enabled: the config says True"):
        merge_config({"torch_autocast": {"enabled": True}}, _request())
    with pytest.raises(ValueError, match="configure_optimizers returns none and the config names none"):
        merge_config({}, _request(client_optimizer=False))
    with pytest.raises(ValueError, match="supports precision '32-true', '16-mixed'"):
        merge_config({}, _request(precision="64-true"))
    # offload, under its current names and DeepSpeed's deprecated ones
    for offload in ({"offload_optimizer": {"device": "cpu"}}, {"cpu_offload": True}, {"cpu_offload_params": True}):
        with pytest.raises(ValueError, match=f"zero_optimization.{next(iter(offload))}: not supported"):
            merge_config({"zero_optimization": offload}, _request())
    assert merge_config({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, _request())

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"steps_per_print": 10}))
    assert load_config(path) == {"steps_per_print": 10}
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(path)
    with pytest.raises(ValueError, match="cannot read the DeepSpeed config"):
        load_config(tmp_path / "missing.json")


@pytest.mark.unit
def test_optimizers_deepspeed_would_step_on_a_flat_partition_are_refused():
    from lightning_hybrid.optim import LAMB
    from lightning_hybrid.strategies.deepspeed.checks import optimizer_problem

    w, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.zeros(2))

    def problem(optimizer, zero_stage=1, precision="32-true"):
        return optimizer_problem(optimizer, zero_stage=zero_stage, precision=precision, stage=1) or ""

    assert problem(torch.optim.AdamW([w, b])) == ""  # element-wise: the flat partition changes nothing
    assert problem(LAMB([w, b]), zero_stage=0) == ""  # fp32 ZeRO-0 steps the parameters themselves
    assert "LAMB takes per-tensor norms" in problem(LAMB([w, b]))
    assert "LAMB takes per-tensor norms" in problem(LAMB([w, b]), zero_stage=0, precision="bf16-mixed")
    assert "Adafactor is not known to be element-wise" in problem(torch.optim.Adafactor([w, b]))
    groups = torch.optim.SGD([{"params": [w, b]}, {"params": [], "lr": 0.5}], lr=0.1)
    assert "param group(s) [1] of SGD hold no parameter of stage 1's blocks" in problem(groups, zero_stage=0)
