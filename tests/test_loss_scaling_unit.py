"""AdaptiveLossScalingPrecision: the state machine alone, and single-process Trainer runs against Lightning's."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_hybrid.plugins import AdaptiveLossScalingPrecision, LossScaleConfig
from lightning_hybrid.plugins._loss_scale import FP16_MAX, LossScaler

CLEAN = {"found_inf": False, "grad_absmax": 1e-3}


@pytest.mark.unit
def test_dynamic_policy_is_gradscalers_rule():
    s = LossScaler("dynamic", LossScaleConfig(init_scale=2.0**10, growth_interval=3))
    for _ in range(2):
        assert not s.update(**CLEAN).skip and s.scale == 2.0**10
    assert s.update(**CLEAN).scale == 2.0**11  # grows after 3 clean steps
    d = s.update(found_inf=True)
    assert d.skip and d.reason == "overflow" and s.scale == 2.0**10  # backs off and skips
    assert s.state.skipped_steps == 1 and s.state.consecutive_skips == 1
    s.update(**CLEAN)
    assert s.state.consecutive_skips == 0


@pytest.mark.unit
def test_hysteresis_tolerates_overflows_before_backing_off():
    s = LossScaler("hysteresis", LossScaleConfig(init_scale=2.0**10, growth_interval=2, hysteresis=2))
    assert s.update(found_inf=True).skip and s.scale == 2.0**10  # first overflow: skip, keep the scale
    assert s.update(found_inf=True).skip and s.scale == 2.0**9  # second: back off
    assert s.update(found_inf=True).skip and s.scale == 2.0**8  # tolerance used up until the next growth
    s.update(**CLEAN)
    s.update(**CLEAN)
    assert s.scale == 2.0**9 and s.state.hysteresis_left == 2  # growth restores the tolerance


@pytest.mark.unit
def test_floor_and_ceiling_clamp_the_scale():
    s = LossScaler("dynamic", LossScaleConfig(init_scale=2.0, min_scale=1.0, max_scale=4.0, growth_interval=1))
    s.update(found_inf=True)
    s.update(found_inf=True)
    assert s.scale == 1.0 and s.state.consecutive_skips == 2
    for _ in range(5):
        s.update(**CLEAN)
    assert s.scale == 4.0


@pytest.mark.unit
def test_adaptive_shrinks_before_overflow_and_grows_on_headroom():
    cfg = LossScaleConfig(init_scale=2.0**16, min_headroom=2.0**4, max_headroom=2.0**10, adapt_interval=3)
    s = LossScaler("adaptive", cfg)
    # max |grad| * scale = 2**16 * 2**-4 = 2**12: headroom 65504 / 4096 ~ 16 -> just under 2**4: shrink once
    d = s.update(found_inf=False, grad_absmax=2.0**-4)
    assert not d.skip and s.scale == 2.0**15 and s.state.skipped_steps == 0
    # far from overflow: grows only after adapt_interval clean steps that all had headroom to spare
    for _ in range(2):
        s.update(found_inf=False, grad_absmax=2.0**-20)
    assert s.scale == 2.0**15
    s.update(found_inf=False, grad_absmax=2.0**-20)
    assert s.scale == 2.0**16
    # a step with little headroom inside the window blocks the growth
    s.update(found_inf=False, grad_absmax=2.0**-20)
    s.update(found_inf=False, grad_absmax=FP16_MAX / 2.0**16 / 2.0**5)  # headroom 2**5: inside the band
    s.update(found_inf=False, grad_absmax=2.0**-20)
    assert s.scale == 2.0**16
    # an overflow still backs off and skips
    assert s.update(found_inf=True).skip and s.scale == 2.0**15


@pytest.mark.unit
def test_nonfinite_loss_skips_without_touching_the_scale_and_state_round_trips():
    s = LossScaler("adaptive")
    d = s.update(found_inf=True, loss_nonfinite=True)
    assert d.skip and d.reason == "nonfinite_loss" and s.scale == 2.0**16
    assert s.state.nonfinite_loss_steps == 1 and s.state.skipped_steps == 1
    s.update(found_inf=False, grad_absmax=1e-2)
    t = LossScaler("adaptive")
    t.load_state_dict(s.state_dict())
    assert t.state == s.state
    assert all(isinstance(v, (int, float, str)) for v in s.state_dict().values())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 1000.0}, "power of two"),
        ({"init_scale": 2.0**30}, "must lie in"),
        ({"growth_factor": 0.5}, "growth_factor must be > 1"),
        ({"min_headroom": 2.0**12, "max_headroom": 2.0**10}, "min_headroom < max_headroom"),
        ({"growth_interval": 2.5}, "growth_interval must be an integer >= 1, got 2.5"),
        ({"init_scale": float("nan")}, "init_scale must be a finite number > 0, got nan"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1, got 0"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaleConfig(**kwargs)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"log_every_n_steps": -1}, "log_every_n_steps must be an integer >= 1 or None, got -1"),
        ({"log_every_n_steps": 0}, "log_every_n_steps must be an integer >= 1 or None, got 0"),
        ({"policy": "blind"}, "policy must be one of 'adaptive', 'dynamic', 'hysteresis', got 'blind'"),
        ({"precision": "16"}, "precision must be one of '16-mixed', 'bf16-mixed', got '16'"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips must be an integer >= 1, got 0"),
        ({"config": {"init_scal": 2.0}}, "config has unknown key(s) ['init_scal']"),
        ({"config": [2.0]}, "config must be a LossScaleConfig or a mapping of its fields"),
        ({"config": {"init_scale": 1000.0}}, "init_scale must be a power of two"),
    ],
)
def test_bad_plugin_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        AdaptiveLossScalingPrecision(**kwargs)
    assert message in str(excinfo.value)


@pytest.mark.unit
def test_config_as_the_mapping_lightningcli_gives():
    import jsonargparse

    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(AdaptiveLossScalingPrecision, "plugin")
    cfg = parser.parse_string("plugin: {policy: hysteresis, config: {init_scale: 1024.0, hysteresis: 3}}")
    plugin = parser.instantiate(cfg).plugin
    assert plugin.loss_scale == 1024.0 and plugin.scaler_state.config.hysteresis == 3
    assert AdaptiveLossScalingPrecision(config={"init_scale": 256.0}).loss_scale == 256.0


def _fit(plugin, steps: int = 12, lr_warmup: int = 0) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=8, stride=16)
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=32, n_head=2, warmup_steps=lr_warmup)
    scales: list[float] = []
    lrs: list[float] = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            p = trainer.precision_plugin
            scales.append(p.loss_scale if hasattr(p, "loss_scale") else p.scaler.get_scale())
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        plugins=[plugin], callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, scales, lrs


@pytest.mark.trainer
def test_dynamic_policy_trains_bit_for_bit_like_lightnings_mixed_precision():
    # no overflow at this scale: both grow the scale every 4 steps and must produce identical weights
    lightning = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=4))
    ours = AdaptiveLossScalingPrecision(
        precision="16-mixed", policy="dynamic", config=LossScaleConfig(init_scale=2.0**8, growth_interval=4)
    )
    w_ref, s_ref, _ = _fit(lightning)
    w_ours, s_ours, _ = _fit(ours)
    assert s_ours == s_ref and s_ref[-1] == 2.0**11
    assert all(torch.equal(w_ref[k], w_ours[k]) for k in w_ref)
    assert ours.skipped_steps == 0 and ours.optimizer_steps_taken == 12


@pytest.mark.trainer
def test_overflowing_steps_leave_weights_and_the_lr_schedule_alone():
    # a huge initial scale overflows fp16: the first steps are skipped until the scale comes down
    cfg = LossScaleConfig(init_scale=2.0**24, max_scale=2.0**24)
    ours = AdaptiveLossScalingPrecision(policy="dynamic", config=cfg)
    weights, scales, lrs = _fit(ours, steps=24, lr_warmup=10)
    skipped = ours.skipped_steps
    assert skipped >= 3 and scales[0] == 2.0**23
    # the warm-up LR advanced only on the steps that were taken
    assert lrs[skipped - 1] == lrs[0] and lrs[skipped] > lrs[skipped - 1]
    assert ours.optimizer_steps_taken == 24 - skipped
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert math.log2(ours.loss_scale).is_integer()


@pytest.mark.trainer
def test_scale_skip_rate_and_headroom_reach_the_loggers_every_n_steps(tmp_path):
    import csv

    from gpt import GPT, CharDataModule
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=8, stride=16)
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=32, n_head=2)
    plugin = AdaptiveLossScalingPrecision(policy="adaptive")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=12, logger=CSVLogger(tmp_path), log_every_n_steps=4,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, plugins=[plugin], accumulate_grad_batches=2,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss_scale")]
    assert [int(r["step"]) for r in rows] == [4, 8, 12]  # once per log_every_n_steps optimizer steps
    assert all(float(r["loss_scale"]) == plugin.loss_scale for r in rows[-1:])
    assert all(float(r["skipped_rate"]) == 0.0 and float(r["headroom_log2"]) > 0 for r in rows)
    assert plugin.scaler_state.state.steps == 12  # one decision per optimizer step with accumulation


@pytest.mark.unit
def test_a_checkpoint_written_with_lightnings_mixed_precision_loads_its_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**11)
    checkpoint = {"MixedPrecision": scaler.state_dict()}
    plugin = AdaptiveLossScalingPrecision(policy="dynamic")
    plugin.on_load_checkpoint(checkpoint)
    assert plugin.loss_scale == 2.0**11


class _NanAt(L.Callback):
    """Turns the model's loss into NaN for one step (a forward NaN, not an overflow)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.nan_now = trainer.global_step == self.step


@pytest.mark.trainer
def test_a_nonfinite_loss_skips_without_lowering_the_scale_and_the_floor_names_layers(tmp_path):
    from gpt import GPT, CharDataModule

    class NanGPT(GPT):
        nan_now = False

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.nan_now else loss

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=8, stride=16)
    model = NanGPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=32, n_head=2)
    plugin = AdaptiveLossScalingPrecision(policy="dynamic", config=LossScaleConfig(init_scale=2.0**8))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        plugins=[plugin], callbacks=[_NanAt(3)],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    state = plugin.scaler_state.state
    assert state.skipped_steps == 1 and state.nonfinite_loss_steps == 1 and plugin.loss_scale == 2.0**8

    # an unrecoverable overflow: after max_consecutive_skips the plugin raises with the layers' names
    plugin = AdaptiveLossScalingPrecision(
        policy="dynamic", config=LossScaleConfig(init_scale=2.0**40, max_scale=2.0**40), max_consecutive_skips=3
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, plugins=[plugin],
    )  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row were skipped \(overflow\).*layers\."):
        trainer.fit(GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=32, n_head=2), datamodule=data)


@pytest.mark.trainer
def test_bf16_mixed_keeps_the_agreed_check_with_a_scale_of_one():
    plugin = AdaptiveLossScalingPrecision(precision="bf16-mixed")
    weights, scales, _ = _fit(plugin, steps=4)
    assert scales == [1.0] * 4 and plugin.skipped_steps == 0 and plugin.optimizer_steps_taken == 4
    assert all(v.dtype != torch.bfloat16 for v in weights.values())  # fp32 master weights
