"""Large-batch training where the theory says a growing batch wins: samples and optimizer steps to a target loss.

    python benchmarks/large_batch.py                        # ~15 min on 2 CPU cores
    python benchmarks/large_batch.py --optimizers adamw --out /tmp/results

The data is an endless stream of text from a fixed random order-2 Markov chain whose entropy is known, so
the loss has a floor (no memorisation, no epochs) and the gradient noise scale ``B_noise = tr(Sigma)/|G|^2``
grows as the model approaches it (McCandlish et al. 2018): early on a small batch is as good as a big one,
late a big batch saves steps at little cost in samples. The example GPT is trained with the same micro-batch
under AccumulationScheduler: a fixed small batch, a fixed large batch, a ramp of K over samples, and the
adaptive schedule (K from the measured noise scale, aiming at the whole noise scale and at a quarter of it),
each with AdamW and with LAMB, the LR coupled to K (square root) where K changes and decayed by a cosine
over the sample budget, keyed to samples so every schedule sees the same LR at the same sample count. Each
run stops at the first validation at or below the tightest target loss (or when the data runs out).
Printed, for each target: samples and optimizer steps to reach it and their ratios to the best fixed batch
(the fixed batch that needed the fewest samples); a plot of B_noise and K.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish  # noqa: E402
from gpt import GPT  # noqa: E402

from lightning_hybrid.callbacks import AccumulationScheduler, Ramp  # noqa: E402


class MarkovChain:
    """An order-2 Markov chain over ``vocab`` symbols: each context's next-symbol law is a sparse Dirichlet draw."""

    def __init__(self, vocab: int, *, concentration: float, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.probs = torch.distributions.Dirichlet(torch.full((vocab * vocab, vocab), concentration)).sample()
        self.vocab = vocab

    def sample(self, n: int, length: int, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(n, length, dtype=torch.long)
        out[:, :2] = torch.randint(self.vocab, (n, 2), generator=g)
        for t in range(2, length):
            ctx = out[:, t - 2] * self.vocab + out[:, t - 1]
            out[:, t] = torch.multinomial(self.probs[ctx], 1, generator=g).squeeze(1)
        return out

    def entropy(self) -> float:
        """The entropy rate in nats: the loss floor of a model that has learnt the chain."""
        v = self.vocab
        # stationary law of the context (a, b): pi'(b, c) = sum_a pi(a, b) P(c | a, b)
        pi = torch.full((v * v,), 1.0 / (v * v), dtype=torch.float64)
        p = self.probs.double()
        for _ in range(500):
            nxt = (pi[:, None] * p).reshape(v, v, v).sum(0).reshape(-1)
            pi = nxt / nxt.sum()
        h = -(p * p.clamp_min(1e-30).log()).sum(1)
        return float((pi * h).sum())


class Sequences(Dataset):
    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]


class MarkovData(L.LightningDataModule):
    """A fixed sample of the chain, read in one fixed order by every run (no shuffling: same data, same order)."""

    def __init__(self, chain: MarkovChain, *, train: int, val: int, block_size: int, micro_batch: int) -> None:
        super().__init__()
        self.train_set = Sequences(chain.sample(train, block_size + 1, seed=1))
        self.val_set = Sequences(chain.sample(val, block_size + 1, seed=2))
        self.micro_batch = micro_batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.micro_batch, shuffle=False, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class Probe(L.Callback):
    """Counts samples and optimizer steps; stops at the first validation at or below ``target``; records the
    noise scale and K of an AccumulationScheduler over training."""

    def __init__(self, target: float, scheduler: AccumulationScheduler | None) -> None:
        self.target, self.scheduler = target, scheduler
        self.samples = 0
        self.trace: list[tuple[int, float, int]] = []  # (samples, B_noise, K)
        self.losses: list[tuple[int, int, float]] = []  # (samples, optimizer steps, validation loss)

    def reached(self, target: float) -> tuple[int, int] | None:
        """(samples, optimizer steps) at the first validation at or below ``target``."""
        return next(((s, k) for s, k, loss in self.losses if loss <= target), None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += batch[0].shape[0]
        if self.scheduler is not None and self.scheduler.noise_scale is not None:
            self.trace.append((self.samples, self.scheduler.noise_scale, self.scheduler.accumulate_grad_batches))

    def on_validation_end(self, trainer, pl_module) -> None:
        loss = float(trainer.callback_metrics.get("val_loss", math.inf))
        self.losses.append((self.samples, trainer.global_step, loss))
        if loss <= self.target:
            trainer.should_stop = True


class SampleCosine(L.Callback):
    """The LR decays by the samples consumed, not the steps (every schedule sees the same LR at the same
    sample count): a cosine from the base LR to ``floor`` times it over ``total`` samples. Set before each
    batch, so AccumulationScheduler's K coupling multiplies it around the optimizer step."""

    def __init__(self, total: int, floor: float = 0.1) -> None:
        self.total, self.floor, self.samples = total, floor, 0
        self.base: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        groups = trainer.optimizers[0].param_groups
        if not self.base:
            self.base = [g["lr"] for g in groups]
        progress = min(1.0, self.samples / self.total)
        factor = self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        for group, base in zip(groups, self.base):
            group["lr"] = base * factor
        self.samples += batch[0].shape[0]


def run(optimizer: str, lr: float, scheduler: AccumulationScheduler | None, data: MarkovData, args: Any) -> Probe:
    L.seed_everything(0, verbose=False)
    model = GPT(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer, d_model=args.d_model,
                n_head=4, lr=lr, optimizer=optimizer)  # fmt: skip
    probe = Probe(min(args.targets), scheduler)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=-1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=args.val_every, check_val_every_n_epoch=None,
        callbacks=[
            probe, *([SampleCosine(args.train_samples)] if args.lr_decay else []),
            *([scheduler] if scheduler is not None else []),
        ],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    return probe


def schedules(args: Any) -> dict[str, tuple[float, Any]]:
    """name -> (LR multiplier, a factory of the AccumulationScheduler or None for K=1)."""
    big = args.large_k
    out = {
        "fixed small (K=1)": (1.0, lambda: None),
        f"fixed large (K={big})": (1.0, lambda: AccumulationScheduler(schedule={0: big})),
        f"ramp K 1->{big} over {args.ramp_samples // 1000}k samples": (
            1.0,
            lambda: AccumulationScheduler(
                ramp=Ramp(start=1, end=big, length=args.ramp_samples), unit="samples", lr_scaling="sqrt"
            ),
        ),
    }
    for f in args.noise_fractions:
        out[f"adaptive, B = {f:g} B_noise"] = (
            math.sqrt(2),
            lambda f=f: AccumulationScheduler(
                unit="adaptive", min_k=2, max_k=args.max_k, adapt_every=args.adapt_every, lr_scaling="sqrt",
                noise_fraction=f,
            ),
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "lamb"])
    parser.add_argument("--lr-adamw", type=float, default=3e-3)
    parser.add_argument("--lr-lamb", type=float, default=5e-3)
    parser.add_argument("--lr-decay", action=argparse.BooleanOptionalAction, default=True,
                        help="cosine LR decay to 10%% over the sample budget, keyed to samples")  # fmt: skip
    parser.add_argument("--only", nargs="*", default=None, help="substrings of the schedule names to run")
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--concentration", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--large-k", type=int, default=16)
    parser.add_argument("--max-k", type=int, default=32)
    parser.add_argument("--adapt-every", type=int, default=10)
    parser.add_argument("--noise-fractions", type=float, nargs="+", default=[1.0, 0.25],
                        help="adaptive schedules: the batch aimed at, as a fraction of B_noise")  # fmt: skip
    parser.add_argument("--ramp-samples", type=int, default=30_000)
    parser.add_argument("--train-samples", type=int, default=80_000)
    parser.add_argument("--val-every", type=int, default=64, help="micro-batches between validations")
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.12, 0.16], help="targets: floor + gap (nats)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    chain = MarkovChain(args.vocab, concentration=args.concentration, seed=0)
    floor = chain.entropy()
    args.targets = [floor + gap for gap in args.gaps]
    data = MarkovData(chain, train=args.train_samples, val=2048, block_size=args.block_size,
                      micro_batch=args.micro_batch)  # fmt: skip
    print(f"entropy floor {floor:.4f} nats, targets {[round(t, 4) for t in args.targets]}", flush=True)
    results: dict[tuple[str, str], Probe] = {}
    for opt in args.optimizers:
        lr = getattr(args, f"lr_{opt}")
        for name, (mult, make) in schedules(args).items():
            if args.only and not any(s in name for s in args.only):
                continue
            scheduler = make()
            probe = run(opt, lr * mult, scheduler, data, args)
            results[opt, name] = probe
            curve = " ".join(f"{s // 1000}k:{v:.3f}" for s, _, v in probe.losses[::4])
            print(f"{opt:<6} {name:<36} curve={curve}",
                  flush=True)  # fmt: skip
    report(results, args, floor)


def report(results: dict[tuple[str, str], Probe], args: Any, floor: float) -> None:
    lines = [
        f"example GPT ({args.n_layer} layers, d_model {args.d_model}) on an order-2 Markov chain over {args.vocab}"
        f" symbols (entropy floor {floor:.3f} nats), 1 CPU process, micro-batch {args.micro_batch} x"
        f" {args.block_size} tokens, at most {args.train_samples // 1000}k samples; validation every"
        f" {args.val_every} micro-batches; the ramp's and the adaptive schedule's LR scaled by sqrt(K)",
    ]
    for gap, target in zip(args.gaps, args.targets):
        lines += [
            "",
            f"target val_loss <= {target:.3f} (floor + {gap})",
            f"{'optimizer':<9} {'schedule':<36} {'samples':>9} {'steps':>7} {'samples/best':>13} {'steps/best':>11}"
            f" {'B_noise at end':>15}",
        ]
        for opt in args.optimizers:
            fixed = [p.reached(target) for (o, n), p in results.items() if o == opt and n.startswith("fixed")]
            best = min((r for r in fixed if r is not None), key=lambda r: r[0], default=None)
            for (o, name), probe in results.items():
                if o != opt:
                    continue
                noise = f"{probe.trace[-1][1]:.0f}" if probe.trace else "-"
                reached = probe.reached(target)
                if reached is None:
                    lines.append(f"{opt:<9} {name:<36} {'not reached':>17}")
                    continue
                samples, steps = reached
                rel = f"{'-':>13} {'-':>11}"
                if best is not None:
                    rel = f"{samples / best[0]:>13.2f} {steps / best[1]:>11.2f}"
                lines.append(f"{opt:<9} {name:<36} {samples:>9} {steps:>7} {rel} {noise:>15}")
    lines += ["", "best = the fixed batch that reached the target with the fewest samples. Target: the adaptive"
              " schedule in fewer optimizer steps than the best fixed batch, at <= 1.1x its samples."]  # fmt: skip
    publish(lines, args.out, "large_batch_cpu.txt")
    plot(results, args)


def plot(results: dict[tuple[str, str], Probe], args: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_noise, ax_k, ax_loss) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for (opt, name), probe in results.items():
        if probe.trace:
            s, b, k = zip(*probe.trace)
            ax_noise.plot(s, b, label=f"{opt} {name}")
            ax_k.step(s, k, where="post", label=f"{opt} {name}")
        if probe.losses:
            s, _, loss = zip(*probe.losses)
            ax_loss.plot(s, loss, label=f"{opt} {name}")
    ax_noise.axhline(args.micro_batch, color="grey", linestyle=":", label="micro-batch")
    ax_noise.set(ylabel="B_noise (samples)", yscale="log")
    ax_k.set(ylabel="K (micro-batches per step)", yscale="log")
    for target in args.targets:
        ax_loss.axhline(target, color="grey", linestyle=":", label=f"target {target:.3f}")
    ax_loss.set(ylabel="val loss (nats)", xlabel="samples")
    for ax in (ax_noise, ax_k, ax_loss):
        ax.legend(fontsize=6)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "large_batch_noise_scale.png", dpi=110)


if __name__ == "__main__":
    main()
