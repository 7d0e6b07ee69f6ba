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
from layouts import LAYOUTS, PIPELINES, REFUSED  # noqa: E402
from one_process import Reference, reference  # noqa: E402
from shapes import CHECKPOINT_AT, build, cells  # noqa: E402


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
    env: dict[str, str] = field(default_factory=dict)  # for the ranks (a mutated copy of the package)
    # layout -> {shape: how a rank's process ended in it without a report}: launched again once (see run_layout)
    crashes: dict[str, dict[str, str]] = field(default_factory=dict)
    _references: dict[tuple[Any, ...], Reference] = field(default_factory=dict)

    def reference(self, shape: str, split: tuple[int, int], before: tuple[int, int] | None = None) -> Reference:
        """The one-process reference; ``split`` (and ``before``, the split a resumed run's checkpoint was
        trained with) matter only to shapes with per-chunk statistics."""
        if not build(shape).per_chunk_statistics:
            split, before = (1, 1), None  # the split changes nothing: one reference for every layout
        key = (shape, split, before)
        if key not in self._references:
            folder = self.root / "reference" / f"{shape.replace('/', '-')}-{len(self._references)}"
            self._references[key] = reference(shape, folder, split=split, split_before=before)
        return self._references[key]

    def run_layout(self, layout: str, shapes: list[str] | None = None) -> list[str]:
        """Launch ``layout`` on every shape; judge its cells. Returns the problems (empty when all conform)."""
        nproc, strategy, replicas, microbatches = LAYOUTS[layout]
        shapes = shapes or cells()
        resume = {s: self.checkpoints[s][1] for s in shapes if s in self.checkpoints}
        resumed_from = {s: self.checkpoints[s][0] for s in resume}
        out = self.root / layout
        results: dict[int, dict[str, Any]] = {rank: {} for rank in range(nproc)}
        launches = self._kept(out, strategy, nproc, shapes, resume, results)
        remaining = [s for s in shapes if not any(s in results[rank] for rank in range(nproc))]
        while remaining:
            # a launch that ended early (a failure on some ranks only ends the processes) is run again for the
            # cells it left undecided
            launches += 1
            cfg = {"layout": layout, "strategy": strategy, "shapes": remaining, "resume": resume,
                   "checkpoints": str(out / f"runs-{launches}"), "out": str(out / f"reports-{launches}")}  # fmt: skip
            # one launch trains every remaining shape, each fresh and resumed with two optimizers: on two cores
            # a two-process layout takes 1-3 s a shape, a four-process one 3-6 s (66 s once, when every Trainer
            # added process groups), and a timeout ends the whole run, so the limit is generous and grows with
            # the shapes left
            limit = len(remaining) * (25 if nproc <= 2 else 150)
            script = "../conformance/worker.py"
            job = launch(script, cfg, nproc=nproc, timeout=limit, expect_success=False, env=self.env)
            for report in job.reports:
                results[report["rank"]].update(report["results"])
            # a cell any rank decided is decided: a rank that ended without a word on it failed there
            decided = [s for s in remaining if any(s in results[rank] for rank in range(nproc))]
            if not decided:  # nothing at all: the launch itself failed
                for s in remaining:
                    self.cells[(s, layout, "fresh")] = Cell("FAILED", f"launch failed (exit {job.returncode})")
                return [f"{layout}: the launch failed with exit code {job.returncode}\n{job.output[-6000:]}"]
            again = []
            for s in decided:
                ended = [rank for rank in range(nproc) if s not in results[rank]]
                if not ended:
                    continue
                # how those processes ended: their exit status and the end of their own logs
                codes = job.codes or [job.returncode] * nproc
                why = "; ".join(_ended(rank, codes[rank], Path(cfg["out"]) / f"rank{rank}.log") for rank in ended)
                told = [
                    run.get("error") for rank in range(nproc) if s in results[rank] for run in results[rank][s].values()
                ]
                if s not in self.crashes.get(layout, {}) and all(e is None or _LOST_PEER in e for e in told):
                    # a process that died with no word (a signal, an abort in a library's thread) while the others
                    # trained or lost only their connection to it: launched again once (the fresh run in a folder of
                    # its own), the crash kept and shown; a second one fails, as does a real error on any rank
                    self.crashes.setdefault(layout, {})[s] = why
                    again.append(s)
                    for rank in range(nproc):
                        results[rank].pop(s, None)
                    continue
                for rank in ended:
                    twice = ", twice" if s in self.crashes.get(layout, {}) else ""
                    lost = {"error": f"the rank's process ended without a report{twice}: {why}"}
                    results[rank][s] = {"fresh": lost, **({"resumed": lost} if s in resume else {})}
            remaining = [s for s in remaining if s not in decided or s in again]
        problems = []
        for s in shapes:
            runs = [results[rank][s] for rank in range(nproc)]
            for run in ("fresh", "resumed"):
                if run not in runs[0]:
                    continue
                before = LAYOUTS[resumed_from[s]][2:] if run == "resumed" else None
                ref = self.reference(s, (replicas, microbatches), before)
                label = f"{s} x {layout} ({run}{' from ' + resumed_from[s] if run == 'resumed' else ''})"
                cell = self._judge(layout, s, runs, run, ref)
                self.cells[(s, layout, run)] = cell
                if cell.verdict not in ("exact", "refused"):
                    problems.append(f"{label}: {cell.verdict}: {cell.detail}")
            fresh = runs[0]["fresh"]
            if "error" not in fresh:
                self.checkpoints[s] = (layout, fresh["checkpoint"])
                if s.startswith("routed-experts/") and replicas > 1:
                    self.rank_dependent_experts |= any(len({tuple(u) for u in step}) > 1 for step in fresh["experts"])
        return problems

    @staticmethod
    def _kept(out: Path, strategy: dict, nproc: int, shapes: list[str], resume: dict, results: dict) -> int:
        """Load the reports earlier launches of this layout left under ``out`` (a run of the whole matrix that
        ended early, continued with ``run.py --keep``): a cell counts only where that launch ran this
        strategy, resumed the same checkpoint and every rank reported it. Returns the number of the last launch
        (the next one follows it: no report is overwritten)."""
        launches = sorted((int(folder.name.partition("-")[2]), folder) for folder in out.glob("reports-*"))
        for _, folder in launches:
            cfg = json.loads((folder / "config.json").read_text())
            reports = [folder / f"rank{rank}.json" for rank in range(nproc)]
            if cfg["strategy"] != strategy or not all(report.exists() for report in reports):
                continue
            ranks = [json.loads(report.read_text())["results"] for report in reports]
            for s in shapes:
                same_start = cfg.get("resume", {}).get(s) == resume.get(s)
                if same_start and all(s in mine for mine in ranks):
                    for rank, mine in enumerate(ranks):
                        results[rank][s] = mine[s]
        return launches[-1][0] if launches else 0

    def _judge(self, layout: str, shape: str, runs: list[dict], run: str, ref: Reference) -> Cell:
        runs = [{**r, run: r.get(run, {"error": "the rank's process ended before this run"})} for r in runs]
        errors = [r[run].get("error") for r in runs]
        expected = REFUSED.get((layout, shape.partition("/")[0]))
        if any(errors):
            if not all(errors):
                return Cell("FAILED", f"some ranks failed, others did not: {errors}")
            # the same refusal on every rank (a message may name a parameter of the rank's own pipeline stage)
            if expected and all(expected in e for e in errors):
                return Cell("refused", errors[0][:300])
            if len(set(errors)) != 1:
                return Cell("FAILED", f"the ranks failed differently: {errors}")
            return Cell("FAILED", f"{errors[0]}\n{runs[0][run].get('tb', '')}")
        if expected:
            return Cell("DIFFERENT", f"trained where a refusal ({expected!r}) was expected")
        shape_model = build(shape)
        loss_tol, weight_tol = shape_model.loss_tolerance, shape_model.weight_tolerance
        # the global batch's loss, as rank 0 reports it
        losses = torch.tensor(runs[0][run]["losses"], dtype=torch.float64)
        want = torch.tensor(ref.losses, dtype=torch.float64)
        if run == "resumed":
            after = sum(1 for before in ref.steps_before if before >= CHECKPOINT_AT)
            if len(losses) != after:
                return Cell(
                    "DIFFERENT", f"resumed for {len(losses)} batches, the reference has {after} after the checkpoint"
                )
            want = want[-after:]
        if losses.shape != want.shape:
            return Cell("DIFFERENT", f"{len(losses)} batches, the reference {len(want)}")
        gap = float((losses - want).abs().max()) if len(want) else 0.0
        if gap > loss_tol:
            return Cell("DIFFERENT", f"loss off by {gap:.2e} (per batch: {losses.tolist()} vs {want.tolist()})")
        # every rank's own micro-batch losses, before any reduction, against its replica's in the reference
        _, _, replicas, microbatches = LAYOUTS[layout]
        pipelined = layout in PIPELINES
        own_gap = 0.0
        for rank, r in enumerate(runs):
            mine = r[run]["own_losses"]
            per_batch = ref.own[(replicas, microbatches)][r[run]["replica"]][-len(losses) :]
            expect = [v for batch in per_batch for v in batch if not (pipelined and v is None)]
            if pipelined and not mine:
                continue  # a rank without the last stage computes no loss
            if len(mine) != len(expect):
                return Cell(
                    "DIFFERENT", f"rank {rank} computed {len(mine)} micro-batch losses, its replica {len(expect)}"
                )
            for i, (a, b) in enumerate(zip(mine, expect)):
                if b is None:
                    if a == a:  # nothing counted: the mean is 0/0 on the rank too
                        return Cell("DIFFERENT", f"rank {rank} micro-batch {i}: {a} where nothing was counted")
                    continue
                own_gap = max(own_gap, abs(a - b))
                if not abs(a - b) <= loss_tol:
                    return Cell("DIFFERENT", f"rank {rank}'s own loss {i} off by {abs(a - b):.2e} ({a} vs {b})")
        if pipelined and not any(r[run]["own_losses"] for r in runs):
            return Cell("DIFFERENT", "no rank computed a micro-batch loss")
        # the weights consolidated from the final checkpoint
        ref_weights = ref.weights
        weights = torch.load(runs[0][run]["weights"])
        if set(weights) != set(ref_weights):
            return Cell("DIFFERENT", f"weights {sorted(set(weights) ^ set(ref_weights))} on one side only")
        worst = _worst(weights, ref_weights)
        if worst[0] > weight_tol:
            return Cell("DIFFERENT", f"consolidated weight {worst[1]} off by {worst[0]:.2e}")
        # every rank's own weights: against the reference, and equal (bitwise) to the other replicas of its stage
        held: dict[frozenset, tuple[int, dict]] = {}
        covered: set[str] = set()
        for rank, r in enumerate(runs):
            mine = torch.load(r[run]["own_weights"])
            unknown = set(mine) - set(ref_weights)
            if unknown:
                return Cell("DIFFERENT", f"rank {rank} holds {sorted(unknown)[:3]}, which the reference has not")
            rank_worst = _worst(mine, {k: ref_weights[k] for k in mine})
            if rank_worst[0] > weight_tol:
                return Cell("DIFFERENT", f"rank {rank}'s own {rank_worst[1]} off by {rank_worst[0]:.2e}")
            covered |= set(mine)
            key = frozenset(mine)
            if key in held:
                other, theirs = held[key]
                apart = [k for k in mine if not torch.equal(mine[k], theirs[k])]
                if apart:
                    gap_r = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in apart)
                    return Cell("DIFFERENT", f"replicas {other} and {rank} hold different {apart[:3]} ({gap_r:.2e})")
            else:
                held[key] = (rank, mine)
        if covered != set(ref_weights):
            return Cell("DIFFERENT", f"no rank holds {sorted(set(ref_weights) - covered)[:3]}")
        return Cell("exact", f"loss {gap:.1e}, own losses {own_gap:.1e}, weights {worst[0]:.1e}")

    def undecided(self) -> list[str]:
        out = []
        for s in cells():
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
        for s in cells():
            row = []
            for layout in layouts:
                fresh, resumed = self.cells.get((s, layout, "fresh")), self.cells.get((s, layout, "resumed"))
                text = mark[fresh.verdict] if fresh else "-"
                if resumed is not None and resumed.verdict != "refused":
                    text += " / resumed " + mark[resumed.verdict]
                if s in self.crashes.get(layout, {}):
                    text += " (launched twice: a process ended without a report)"
                row.append(text)
            lines.append(f"| {s} | " + " | ".join(row) + " |")
        return "\n".join(lines)

    def refusals(self) -> dict[tuple[str, str], str]:
        return {
            (s, lay): c.detail for (s, lay, run), c in self.cells.items() if c.verdict == "refused" and run == "fresh"
        }


def _worst(weights: dict, reference: dict) -> tuple[float, str]:
    return max(
        ((float((weights[k].double() - v.double()).abs().max()), k) for k, v in reference.items() if v.numel()),
        default=(0.0, ""),
    )


def summary(matrix: Matrix) -> dict[str, Any]:
    return {f"{s}|{lay}|{run}": (c.verdict, c.detail) for (s, lay, run), c in matrix.cells.items()}


# how gloo words a peer process that is gone (a reset or closed connection)
_LOST_PEER = "Connection"


def _ended(rank: int, returncode: int, log: Path) -> str:
    """What a rank that ended in a cell without a report left: its exit status (negative: the signal that ended
    it) and the end of its log (a crash's stack: the workers enable faulthandler)."""
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
    return f"rank {rank} ended without a report (exit code {returncode}); its log ends:\n{tail}"
