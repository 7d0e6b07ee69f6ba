"""Planted bugs: each a small patch to a temporary copy of the package, run under the matrix cells that should
see it. The matrix can fail only if each of them makes some cell DIFFERENT or FAILED.

    python tests/conformance/mutations.py [NAME ...]      (default: every mutation)

prints, for each planted bug, the cells that caught it (or SURVIVED), and the mutation score (caught /
planted); the exit code is 1 when any survived. The test tier runs the same (``test_mutations.py``).
A mutation names the layouts and shapes it runs: a chain (a layout resuming another's checkpoint) when what
it breaks is a resume. Every cell runs with plain SGD, whose update is proportional to the gradient.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from matrix import Matrix  # noqa: E402

PACKAGE = ROOT / "src" / "lightning_hybrid"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    file: str  # relative to src/lightning_hybrid
    old: str  # must occur exactly once in the file
    new: str
    layouts: tuple[str, ...]  # run in this order: a later one resumes the earlier ones' checkpoints
    shapes: tuple[str, ...]


MUTATIONS = [
    Mutation(
        "zero0-sum-not-mean",
        "ZeRO-0: the bucket all-reduce's result is not divided by the replicas (a sum, not the mean)",
        "strategies/zero/buckets.py",
        "            flat.div_(self.world)\n",
        "            pass\n",
        ("dp2-zero0",),
        ("param-groups", "padded-lm"),
    ),
    Mutation(
        "zero1-sum-not-mean",
        "ZeRO-1: each bucket's reduce-scatter to its owner is not divided by the replicas",
        "strategies/zero/flat_gradients.py",
        "                    self.flat[lo:hi].div_(self.world)\n",
        "                    pass\n",
        ("dp2-zero1",),
        ("param-groups", "frozen-part"),
    ),
    Mutation(
        "zero2-sum-not-mean",
        "ZeRO-2 (every_microbatch): the shard gradient is not divided by the replicas (the review's planted bug)",
        "strategies/zero/bucket_gradients.py",
        "            grad.div_(self.world)  # in place\n",
        "            pass\n",
        ("dp2-zero2",),
        ("frozen-part", "manual-optimization", "scalar-params", "param-groups"),
    ),
    Mutation(
        "zero3-sum-not-mean",
        "ZeRO-3: FSDP2 sums the replicas' gradients instead of averaging them",
        "strategies/zero/fully_sharded.py",
        "            fully_shard(unit, **self.kwargs)\n",
        "            fully_shard(unit, **self.kwargs)\n            unit.set_gradient_divide_factor(1.0)\n",
        ("dp2-zero3",),
        ("param-groups", "nested-moduledict"),
    ),
    Mutation(
        "zero0-one-bucket-local",
        "ZeRO-0: the first bucket of the plan is never all-reduced (each replica keeps its own gradient there)",
        "strategies/zero/buckets.py",
        "        work = dist.all_reduce(flat, group=self.group, async_op=True)\n",
        "        work = dist.all_reduce(flat if bucket.lo else flat.new_zeros(1), group=self.group, async_op=True)\n"
        "        if not bucket.lo:\n            flat.mul_(self.world)\n",
        ("dp2-zero0",),
        ("param-groups", "memory-layouts"),
    ),
    Mutation(
        "last-microbatch-dropped",
        "The backward of an accumulation window's last micro-batch is skipped (its gradient never counts)",
        "strategies/hybrid_step.py",
        "            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)\n",
        "            if not self._window_closing:\n"
        "                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)\n",
        ("dp2-zero1",),
        ("padded-lm", "partial-window"),
    ),
    Mutation(
        "stale-gradient-kept",
        "ZeRO-1: the step does not forget which segments of the flat buffer this window wrote: the next window's "
        "first gradients are added to the last one's",
        "strategies/zero/group_gradients.py",
        "        self._written = set()\n",
        "        pass\n",
        ("dp2-zero1",),
        ("param-groups", "scalar-params"),
    ),
    Mutation(
        "optimizer-state-not-restored",
        "A resumed optimizer's state skips its first parameter (it starts that one afresh)",
        "strategies/_state.py",
        '            if by_name["state"].get(name):\n',
        '            if by_name["state"].get(name) and index:\n',
        ("single", "dp2-zero0"),
        ("param-groups", "scalar-params"),
    ),
    Mutation(
        "zero1-state-not-restored",
        "ZeRO-1/2: a resumed rank takes no state for the first parameter of each group",
        "strategies/zero/flat_state.py",
        '                entries = by_name["state"].get(name, {})\n',
        '                entries = by_name["state"].get(name, {}) if i else {}\n',
        ("single", "dp2-zero1"),
        ("param-groups", "scalar-params"),
    ),
    Mutation(
        "sampler-off-by-one-batch",
        "The data position a checkpoint records is one batch ahead: a resume skips a batch",
        "callbacks/_samplers.py",
        "        consumed = (batch_idx + 1) * batch_size * sampler.num_replicas\n",
        "        consumed = (batch_idx + 2) * batch_size * sampler.num_replicas\n",
        ("single", "dp2-zero0"),
        ("param-groups", "scalar-params"),
    ),
    Mutation(
        "loss-scale-per-rank",
        "AdaptiveLossScalingPrecision decides skip and scale from this rank's gradients alone",
        "plugins/adaptive_loss_scaling.py",
        "nothing_any = agree([found_inf, loss_bad, absmax, float(nothing)], device=device)",
        "nothing_any = [found_inf, loss_bad, absmax, float(nothing)]",
        ("dp2-zero1",),
        ("fp16-scaled",),
    ),
    Mutation(
        "unused-parameter-stepped",
        "ZeRO-0: a parameter no replica has a gradient for keeps a zero gradient (stepped under weight decay)",
        "strategies/zero/replicated.py",
        "p.grad = None  # as in one process: no gradient, not stepped (a zero would move it under decay)",
        "p.grad = torch.zeros_like(p)",
        ("dp2-zero0",),
        ("unused-everywhere", "routed-experts"),
    ),
    Mutation(
        "tp-whole-counted-on-every-rank",
        "Tensor parallelism: the global gradient norm counts a parameter every tensor-parallel rank holds whole"
        " once per rank (a norm too large: clipped too much)",
        "strategies/zero/grad_sync.py",
        '        """``grads`` (as the optimizer sees them) less the parts another tensor-parallel rank counts."""\n'
        "        if self._counts_whole:\n",
        '        """``grads`` (as the optimizer sees them) less the parts another tensor-parallel rank counts."""\n'
        "        if True:\n",
        ("tp2",),
        ("clip-norm",),
    ),
    Mutation(
        "edited-gradient-not-averaged",
        "ZeRO-0: a gradient user code assigned after the reduction is stepped as this replica holds it",
        "strategies/zero/replicated.py",
        "        changed = [p.grad is not self._left.get(id(p)) for p in every]\n",
        "        changed = [False for p in every]\n",
        ("dp2-zero0",),
        ("grad-estimated",),
    ),
]


def apply(mutation: Mutation, root: Path) -> Path:
    """A copy of the package under ``root/src`` with ``mutation`` applied; returns the ``src`` folder."""
    src = root / "src"
    shutil.copytree(PACKAGE, src / "lightning_hybrid", ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "lightning_hybrid" / mutation.file
    text = target.read_text()
    if text.count(mutation.old) != 1:
        raise AssertionError(
            f"{mutation.name}: the patched text occurs {text.count(mutation.old)} times in {mutation.file}"
        )
    target.write_text(text.replace(mutation.old, mutation.new))
    return src


def run(mutation: Mutation, root: Path, references: dict | None = None) -> list[str]:
    """The cells that caught ``mutation`` (DIFFERENT or FAILED), as ``"<cell> x <layout> (<run>)"``."""
    src = apply(mutation, root / "package")
    path = os.pathsep.join([str(src), str(ROOT / "examples"), str(ROOT)])
    matrix = Matrix(root / "matrix", env={"PYTHONPATH": path})
    if references is not None:
        matrix._references = references  # the one-process references do not depend on the package
    cells = [f"{shape}/sgd" for shape in mutation.shapes]
    for layout in mutation.layouts:
        matrix.run_layout(layout, cells)
    for layout, found in matrix.crashes.items():  # judged on the second launch: the first one's end is shown
        for shape, why in found.items():
            print(f"{mutation.name}: {shape} x {layout} launched twice; the first time {why}", flush=True)
    return [
        f"{shape} x {layout} ({run})"
        for (shape, layout, run), cell in sorted(matrix.cells.items())
        if cell.verdict in ("DIFFERENT", "FAILED")
    ]


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    references: dict = {}
    caught = 0
    lines = ["| planted bug | what it breaks | caught by |", "|---|---|---|"]
    for mutation in chosen:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"lh-mutation-{mutation.name}-") as tmp:
            found = run(mutation, Path(tmp), references)
        caught += bool(found)
        shown = (
            "; ".join(found[:4]) + (f"; and {len(found) - 4} more" if len(found) > 4 else "") if found else "SURVIVED"
        )
        lines.append(f"| `{mutation.name}` | {mutation.what} | {shown} |")
        print(f"{mutation.name}: {'caught by ' + str(len(found)) + ' cell(s)' if found else 'SURVIVED'}"
              f" ({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    lines.append("")
    lines.append(f"Mutation score: {caught} / {len(chosen)} planted bugs caught.")
    print("\n".join(lines))
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
