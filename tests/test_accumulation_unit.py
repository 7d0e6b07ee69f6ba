"""AccumulationScheduler's pure parts and its gradient-noise-scale estimate against brute force."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid.callbacks import AccumulationScheduler, Ramp
from lightning_hybrid.callbacks._accumulation import can_switch, lookup, validate_schedule


@pytest.mark.unit
def test_lookup_switch_rule_and_ramps():
    schedule = {0: 1, 1000: 2, 5000: 8}
    assert [lookup(schedule, p) for p in (0, 999, 1000, 4999, 5000, 10**6)] == [1, 1, 2, 2, 8, 8]
    assert lookup({10: 4}, 3) == 1  # K = 1 before the first key
    assert not can_switch(8, 4, 3) and can_switch(12, 4, 3)  # 4 -> 3 waits for a multiple of both
    assert not can_switch(6, 2, 4) and can_switch(8, 2, 4)
    assert Ramp(start=1, end=8, length=300).schedule() == {0: 1, 100: 2, 200: 4, 300: 8}
    assert Ramp(start=2, end=5, length=30, begin=10, increments="linear").schedule() == {
        0: 1, 10: 2, 20: 3, 30: 4, 40: 5,
    }  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": {0: 2, 0.5: 4}}, "keys must be integers"),
        ({"schedule": {10: 2, 5: 4}}, "strictly increasing"),
        ({"schedule": {0: 0}}, "integer >= 1"),
        ({"schedule": {0: 2}, "unit": "tokens"}, "unit must be"),
        ({"schedule": {0: 2}, "ramp": Ramp(start=1, end=2, length=5)}, "exactly one"),
        ({"ramp": Ramp(start=1, end=4, length=5), "lr_scaling": "cubic"}, "lr_scaling"),
        ({"unit": "adaptive", "min_k": 1}, "needs min_k >= 2"),
        ({"unit": "adaptive", "schedule": {0: 1}}, r"K must stay in \[min_k, max_k\] = \[2, 64\]"),
        ({"unit": "adaptive", "schedule": {0: 2, 10: 128}}, r"\{10: 128\} is outside"),
        ({"unit": "adaptive", "schedule": {5: 4}}, r"\{0: 1\} is outside"),
        ({"schedule": {}}, "must not be empty"),
        ({"schedule": [1, 2]}, "schedule must be a mapping"),
        ({"schedule": {0: 2}, "min_k": 4, "max_k": 2}, "max_k must be an integer >= 4, got 2"),
        ({"schedule": {0: 2}, "adapt_every": 0.5}, "adapt_every must be an integer >= 1, got 0.5"),
        ({"schedule": {0: 2}, "noise_ema": 1.5}, r"noise_ema must be in \[0, 1\)"),
        ({"unit": "adaptive", "noise_fraction": 0}, "noise_fraction must be a finite number > 0, got 0"),
    ],
)
def test_bad_input_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AccumulationScheduler(**kwargs)


@pytest.mark.unit
def test_a_ramp_that_ends_before_it_starts_is_refused():
    with pytest.raises(ValueError, match="must increase"):
        Ramp(start=8, end=2, length=10)
    with pytest.raises(ValueError, match="integers >= 0"):
        validate_schedule({0: 1, -1: 3})


class _Frozen(L.LightningModule):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1, dtype=torch.float64)
        with torch.no_grad():
            self.net.weight.copy_(w[:4].view(1, 4))
            self.net.bias.fill_(float(w[4]))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # frozen: the true G and Sigma stay fixed


@pytest.mark.trainer
def test_noise_scale_estimate_is_within_10_percent_of_brute_force():
    g = torch.Generator().manual_seed(0)
    n = 16384
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + 0.5 * torch.randn(n, generator=g).double()
    w = torch.tensor([0.9, -1.9, 0.45, 2.9, 0.05], dtype=torch.float64)  # near the optimum: B_simple ~ 40
    # brute force: every per-sample gradient of the frozen model
    residual = x @ w[:4] + w[4] - y
    per_sample = 2 * residual[:, None] * torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1)
    mean = per_sample.mean(0)
    b_simple = float(((per_sample - mean) ** 2).sum(1).mean() / mean.pow(2).sum())

    L.seed_everything(0)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    # a frozen model is a stationary problem: average every step's estimate equally (noise_ema=None)
    scheduler = AccumulationScheduler(unit="adaptive", min_k=4, max_k=4, noise_ema=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2000, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="64-true", callbacks=[scheduler],
    )  # fmt: skip
    trainer.fit(_Frozen(w), train_dataloaders=loader)
    assert scheduler.accumulate_grad_batches == 4 and scheduler.effective_batch_size == 64
    assert scheduler.noise_scale == pytest.approx(b_simple, rel=0.10), f"brute force B_simple = {b_simple:.1f}"


@pytest.mark.trainer
def test_lr_scaling_applies_around_each_step_and_composes_with_the_schedule():
    seen: list[tuple[float, float]] = []

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(
                (optimizer.param_groups[0]["lr"], float(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]))
            )

    from gpt import GPT, CharDataModule

    L.seed_everything(0)
    data = CharDataModule(block_size=16, batch_size=4, stride=16)
    model = GPT(vocab_size=data.vocab_size, block_size=16, n_layer=1, d_model=16, n_head=2, warmup_steps=10)
    scheduler = AccumulationScheduler(schedule={0: 1, 2: 4}, lr_scaling="linear")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[scheduler, Probe()],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    # the step's LR is the schedule's LR times K / K0, never compounding: K=4 is requested after step 2 and
    # starts at batch 4 (the first multiple of 4), so steps 3 and 4 still run with K=1
    assert [round(lr / sched, 9) for lr, sched in seen] == [1.0, 1.0, 1.0, 1.0, 4.0]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    )


@pytest.mark.parametrize(
    ("fraction", "b_noise", "k_now", "wanted"),
    [
        (1.0, 128.0, 8, 16),  # the critical batch: 128 samples = 16 micro-batches of 8
        (0.25, 128.0, 8, 4),  # a quarter of it: 32 samples
        (0.125, 128.0, 2, 2),  # 16 samples, already there
        (0.125, 1024.0, 2, 4),  # 128 samples wanted, but at most x2 per change
        (0.01, 128.0, 8, 4),  # below min_k... bounded by /2 per change first
        (0.01, 128.0, 2, 2),  # ...then by min_k
    ],
)
def test_adaptive_k_aims_at_noise_fraction_times_the_noise_scale(fraction, b_noise, k_now, wanted):
    scheduler = AccumulationScheduler(unit="adaptive", min_k=2, max_k=64, adapt_every=1, noise_fraction=fraction)
    scheduler.k, scheduler._micro_samples = k_now, 8
    scheduler.noise.g2, scheduler.noise.trace, scheduler.noise.count = 1.0, b_noise, 1
    assert scheduler.noise_scale == b_noise
    trainer = type("T", (), {"global_step": 5})()
    assert scheduler._wanted(trainer) == wanted
