"""Running the conformance matrix and judging its cells (used by the test tier and by ``run.py``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from helpers import launch  # noqa: E402
from layouts import LAYOUTS, REFUSED  # noqa: E402
from one_process import reference  # noqa: E402
from shapes import CHECKPOINT_AT, SHAPES, build  # noqa: E402


@dataclass
class Cell:
    verdict: str  # "exact", "refused", "DIFFERENT", "FAILED"
    detail: str = ""


@dataclass
class Matrix:
    root: Path
    cells: dict[tuple[str, str, str], Cell] = field(default_factory=dict)  # (shape, layout, run)
    checkpoints: dict[str, tuple[str, str]] = field(default_factory=dict)  # shape -> (layout, folder)
    rank_dependent_experts: bool = False
    _references: dict[tuple[Any, ...], tuple[list[float], dict]] = field(default_factory=dict)

    def reference(self, shape: str, split: tuple[int, int], before: tuple[int, int] | None = None):
        """The one-process reference; ``split`` (and ``before``, the split a resumed run's checkpoint was
        trained with) matter only to shapes with per-chunk statistics."""
        if not build(shape).per_chunk_statistics:
            split, before = (1, 1), None  # the split changes nothing: one reference for every layout
        key = (shape, split, before)
        if key not in self._references:
            folder = self.root / "reference" / f"{shape}-{len(self._references)}"
            self._references[key] = reference(shape, folder, split=split, split_before=before)
        return self._references[key]

    def run_layout(self, layout: str, shapes: list[str] | None = None) -> list[str]:
        """Launch ``layout`` on every shape; judge its cells. Returns the problems (empty when all conform)."""
        nproc, strategy, replicas, microbatches = LAYOUTS[layout]
        shapes = shapes or list(SHAPES)
        resume = {s: self.checkpoints[s][1] for s in shapes if s in self.checkpoints}
        resumed_from = {s: self.checkpoints[s][0] for s in resume}
        out = self.root / layout
        cfg = {"layout": layout, "strategy": strategy, "shapes": shapes, "resume": resume,
               "checkpoints": str(out / "runs"), "out": str(out / "reports")}  # fmt: skip
        job = launch("../conformance/worker.py", cfg, nproc=nproc, timeout=900, expect_success=False)
        if len(job.reports) != nproc:
            for s in shapes:
                self.cells[(s, layout, "fresh")] = Cell("FAILED", f"launch failed (exit {job.returncode})")
            return [f"{layout}: the launch failed with exit code {job.returncode}\n{job.output[-6000:]}"]
        problems = []
        for s in shapes:
            runs = [json.loads(json.dumps(r["results"][s])) for r in sorted(job.reports, key=lambda r: r["rank"])]
            for run in ("fresh", "resumed"):
                if run not in runs[0]:
                    continue
                before = LAYOUTS[resumed_from[s]][2:] if run == "resumed" else None
                ref_losses, ref_weights = self.reference(s, (replicas, microbatches), before)
                label = f"{s} x {layout} ({run}{' from ' + resumed_from[s] if run == 'resumed' else ''})"
                cell = self._judge(layout, s, runs, run, ref_losses, ref_weights)
                self.cells[(s, layout, run)] = cell
                if cell.verdict not in ("exact", "refused"):
                    problems.append(f"{label}: {cell.verdict}: {cell.detail}")
            fresh = runs[0]["fresh"]
            if "error" not in fresh:
                self.checkpoints[s] = (layout, fresh["checkpoint"])
                if s == "routed-experts" and replicas > 1:
                    self.rank_dependent_experts |= any(len({tuple(u) for u in step}) > 1 for step in fresh["experts"])
        return problems

    def _judge(self, layout, shape, runs, run, ref_losses, ref_weights) -> Cell:
        errors = [r[run].get("error") for r in runs]
        expected = REFUSED.get((layout, shape))
        if any(errors):
            if not all(errors):
                return Cell("FAILED", f"some ranks failed, others did not: {errors}")
            if len(set(errors)) != 1:
                return Cell("FAILED", f"the ranks failed differently: {errors}")
            if expected and expected in errors[0]:
                return Cell("refused", errors[0][:300])
            return Cell("FAILED", f"{errors[0]}\n{runs[0][run].get('tb', '')}")
        if expected:
            return Cell("DIFFERENT", f"trained where a refusal ({expected!r}) was expected")
        losses = torch.tensor(runs[0][run]["losses"], dtype=torch.float64)
        for rank, r in enumerate(runs[1:], start=1):
            if r[run]["losses"] != runs[0][run]["losses"]:
                return Cell("DIFFERENT", f"rank {rank} reported other losses than rank 0")
        want = torch.tensor(ref_losses, dtype=torch.float64)
        if run == "resumed":
            want = want[-len(losses) :]
            if len(losses) != len(ref_losses) - CHECKPOINT_AT * (len(ref_losses) // 8):
                return Cell("DIFFERENT", f"resumed for {len(losses)} batches of {len(ref_losses)}")
        if losses.shape != want.shape:
            return Cell("DIFFERENT", f"{len(losses)} batches, the reference {len(want)}")
        shape_model = build(shape)
        loss_tol, weight_tol = shape_model.loss_tolerance, shape_model.weight_tolerance
        gap = float((losses - want).abs().max())
        if gap > loss_tol:
            return Cell("DIFFERENT", f"loss off by {gap:.2e} (per batch: {losses.tolist()} vs {want.tolist()})")
        weights = torch.load(runs[0][run]["weights"])
        if set(weights) != set(ref_weights):
            return Cell("DIFFERENT", f"weights {sorted(set(weights) ^ set(ref_weights))} on one side only")
        worst = max(
            ((float((weights[k].double() - v.double()).abs().max()), k) for k, v in ref_weights.items()),
            default=(0.0, ""),
        )
        if worst[0] > weight_tol:
            return Cell("DIFFERENT", f"weight {worst[1]} off by {worst[0]:.2e}")
        return Cell("exact", f"loss {gap:.1e}, weights {worst[0]:.1e}")

    def undecided(self) -> list[str]:
        out = []
        for s in SHAPES:
            for layout in LAYOUTS:
                cell = self.cells.get((s, layout, "fresh"))
                if cell is None or cell.verdict not in ("exact", "refused"):
                    out.append(f"{s} x {layout}")
        return out

    def table(self) -> str:
        """Markdown: a row per shape, a column per layout; each cell fresh / resumed."""
        layouts = list(LAYOUTS)
        lines = ["| shape | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
        mark = {"exact": "exact", "refused": "refused", "DIFFERENT": "**DIFFERENT**", "FAILED": "**FAILED**"}
        for s in SHAPES:
            row = []
            for layout in layouts:
                fresh, resumed = self.cells.get((s, layout, "fresh")), self.cells.get((s, layout, "resumed"))
                text = mark[fresh.verdict] if fresh else "-"
                if resumed is not None and resumed.verdict != "refused":
                    text += " / resumed " + mark[resumed.verdict]
                row.append(text)
            lines.append(f"| {s} | " + " | ".join(row) + " |")
        return "\n".join(lines)

    def refusals(self) -> dict[tuple[str, str], str]:
        return {
            (s, lay): c.detail for (s, lay, run), c in self.cells.items() if c.verdict == "refused" and run == "fresh"
        }


def summary(matrix: Matrix) -> dict[str, Any]:
    return {f"{s}|{lay}|{run}": (c.verdict, c.detail) for (s, lay, run), c in matrix.cells.items()}
