"""Step time of HybridParallelStrategy at two revisions of this repository, side by side in one run.

    python benchmarks/compare_revisions.py --base e8cffc0          # that revision vs the working tree
    python benchmarks/compare_revisions.py --base v0.1 --head main

A regression check for changes that should not slow training down: each row trains the example GPT under
Lightning (2 CPU processes, data parallel) with the package and the example model of each revision, in
alternating order (base, head, head, base) so that drift of the machine cancels, and prints the median step
time of each and their ratio. The step time is Lightning's: from ``on_train_batch_start`` to
``on_train_batch_end`` of each optimizer step (the window's micro-batches included); each job reports its
fastest step after two warm-up steps, since on a shared 2-core machine the median of identical jobs still
varies by 20%.

The revision's ``src`` and ``examples`` are exported with ``git archive`` into a temporary folder (no
worktree, nothing changed in the repository) and put first on the jobs' ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _jobs import publish, run_job  # noqa: E402


def worker(cfg: dict[str, Any]) -> None:
    tree = Path(cfg["tree"])
    sys.path[:0] = [str(tree / "src"), str(tree / "examples")]
    import lightning as L
    import torch
    from gpt import GPT, CharDataModule
    from torch.utils.data import DataLoader

    import lightning_hybrid
    from lightning_hybrid.strategies import HybridParallelStrategy

    assert Path(lightning_hybrid.__file__).is_relative_to(tree), lightning_hybrid.__file__  # the revision's code
    torch.manual_seed(0)
    data = CharDataModule(block_size=cfg["block_size"], batch_size=cfg["batch_size"], stride=64)
    loader = DataLoader(data.train_set, batch_size=cfg["batch_size"], drop_last=True)
    model = GPT(vocab_size=data.vocab_size, block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                d_model=cfg["d_model"], n_head=8, optimizer="adamw")  # fmt: skip
    kwargs = dict(cfg["strategy"])
    if "zero" in kwargs:
        from lightning_hybrid.strategies import ZeroConfig

        kwargs["zero"] = ZeroConfig(**kwargs["zero"])
    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % cfg["accumulate"] == 0:
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % cfg["accumulate"] == 0:
                times.append(time.perf_counter() - self.t0)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(**kwargs), max_steps=cfg["steps"],
        accumulate_grad_batches=cfg["accumulate"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader)
    # the fastest step after two warm-up steps: what the code costs, with the machine's interference filtered
    out = {"rank": trainer.global_rank, "step_time": min(times[2:])}
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
    # what is timed is done: leave without the interpreter's shutdown (an older revision may abort in it)
    sys.stdout.flush()
    os._exit(0)


def export(rev: str, into: Path) -> Path:
    """``src`` and ``examples`` of ``rev`` (the working tree itself for ``"WORKTREE"``)."""
    if rev == "WORKTREE":
        return ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "src", "examples"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--base", required=False, default="e8cffc0", help="revision to compare against")
    parser.add_argument("--head", default="WORKTREE", help="revision to compare (default: the working tree)")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="run only these rows (labels as printed)")
    parser.add_argument("--pairs", type=int, default=1, help="(base, head, head, base) rounds per row")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return

    tmp = Path(tempfile.mkdtemp(prefix="lh-revisions-"))
    try:
        trees = {"base": export(args.base, tmp / "base"), "head": export(args.head, tmp / "head")}
        base = {"block_size": 64, "batch_size": 8, "n_layer": args.n_layer, "d_model": args.d_model,
                "steps": args.steps}  # fmt: skip
        rows = [(f"zero_stage={z}, accumulate {k}", {"zero_stage": z}, {}, k) for k in (1, 4) for z in (0, 1, 2)]
        # the head's ZeRO-2 reduces every micro-batch by default; its once-per-step setting is what the base did
        once = {"zero": {"reduce_gradients": "once_per_step"}}
        rows.append(("zero_stage=2 once_per_step, acc. 4", {"zero_stage": 2}, once, 4))
        if args.only:
            rows = [row for row in rows if row[0] in args.only]
        times: dict[str, dict[str, list[float]]] = {}
        for label, strategy, head_only, k in rows:
            times[label] = {"base": [], "head": []}
            for side in ("base", "head", "head", "base") * args.pairs:
                print(f"running {label} at {side} ...", flush=True)
                kwargs = {**strategy, **(head_only if side == "head" else {})}
                job = {**base, "tree": str(trees[side]), "strategy": kwargs, "accumulate": k}
                reports = run_job(__file__, job, 2, tmp / "jobs" / side, timeout=900)
                times[label][side].append(max(r["step_time"] for r in reports))
                print(f"  {times[label][side][-1]:.3f} s/step", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    head_name = "working tree" if args.head == "WORKTREE" else args.head
    lines = [
        f"Step time under Lightning, 2 CPU processes (pp1 x dp2), GPT d_model={args.d_model} n_layer={args.n_layer},"
        f" AdamW, micro-batch 8 x 64 tokens; base = {args.base}, head = {head_name}; fastest step of each job"
        f" after two warm-up steps (the slowest rank), mean of {2 * args.pairs} jobs per side"
        " (order base, head, head, base)",
        "",
        f"| {'layout':<34} | {'base s/step':>11} | {'head s/step':>11} | {'head / base':>11} |",
        f"|{'-' * 36}|{'-' * 13}|{'-' * 13}|{'-' * 13}|",
    ]
    for label, sides in times.items():
        b, h = statistics.mean(sides["base"]), statistics.mean(sides["head"])
        lines.append(f"| {label:<34} | {b:>11.3f} | {h:>11.3f} | {h / b:>11.2f} |")
    publish(lines, args.out, "compare_revisions.txt")


if __name__ == "__main__":
    main()
