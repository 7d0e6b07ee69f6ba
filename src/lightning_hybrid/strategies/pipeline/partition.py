"""Where the pipeline cuts ``self.layers``: consecutive blocks per stage, balanced by cost or as the user says.

Pure arithmetic: every rank reaches the same split from the same input (bad input fails everywhere).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Union

__all__ = ["PipelineSplit", "partition_layers"]


@dataclass(frozen=True)
class PipelineSplit:
    """How the blocks of ``self.layers`` are cut into pipeline stages.

    By default stages are balanced by parameter count. Give at most one of ``layers_per_stage`` (how many
    consecutive blocks each stage holds) or ``split_points`` (the block indices at which stage 1, 2, ...
    begin). ``first_stage_extra`` / ``last_stage_extra`` add cost, in units of the mean block, to the first
    and last stage when balancing, for work the parameter count misses (embedding lookups, the loss).

    Args:
        layers_per_stage: the number of consecutive blocks of each stage, in stage order (summing to the
            number of blocks).
        split_points: the block indices at which stage 1, 2, ... begin (increasing).
        first_stage_extra: cost added to the first stage when balancing, in units of the mean block.
        last_stage_extra: cost added to the last stage when balancing, in units of the mean block.
    """

    layers_per_stage: Union[list[int], None] = None
    split_points: Union[list[int], None] = None
    first_stage_extra: float = 0.0
    last_stage_extra: float = 0.0

    def __post_init__(self) -> None:
        if self.layers_per_stage is not None and self.split_points is not None:
            raise ValueError("PipelineSplit takes `layers_per_stage` or `split_points`, not both")
        if self.first_stage_extra < 0 or self.last_stage_extra < 0:
            raise ValueError(
                f"first_stage_extra ({self.first_stage_extra}) and last_stage_extra ({self.last_stage_extra})"
                " must be >= 0"
            )


def partition_layers(costs: list[float], num_stages: int, split: Union[PipelineSplit, None] = None) -> list[range]:
    """Cut ``len(costs)`` consecutive blocks into ``num_stages`` non-empty stages.

    Returns one ``range`` of block indices per stage. Balanced splits minimise the largest stage cost
    (exact dynamic programme; cheap for the hundreds of blocks real models have).
    """
    split = split or PipelineSplit()
    n = len(costs)
    if n < num_stages:
        raise ValueError(
            f"The model has {n} blocks in `self.layers` but the pipeline needs {num_stages} stages"
            " (pipeline_parallel_size x stages_per_rank), and every stage needs at least one block. Use fewer"
            " stages or split the model into more blocks."
        )
    if split.layers_per_stage is not None:
        counts = list(split.layers_per_stage)
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"layers_per_stage={counts} must have {num_stages} entries, each >= 1, adding up to the {n}"
                " blocks of `self.layers`."
            )
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    if split.split_points is not None:
        points = list(split.split_points)
        full = [0, *points, n]
        if len(points) != num_stages - 1 or any(b <= a for a, b in itertools.pairwise(full)):
            raise ValueError(
                f"split_points={points} must be {num_stages - 1} strictly increasing block indices between 1"
                f" and {n - 1} (each stage needs at least one block)."
            )
        return [range(full[i], full[i + 1]) for i in range(num_stages)]

    mean = sum(costs) / n if n else 1.0
    extra_first, extra_last = split.first_stage_extra * mean, split.last_stage_extra * mean
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def stage_cost(i: int, j: int, s: int) -> float:  # blocks [i, j) as stage s
        return prefix[j] - prefix[i] + (extra_first if s == 0 else 0.0) + (extra_last if s == num_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest possible largest-stage cost putting blocks [0, j) into stages 0..s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = stage_cost(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], stage_cost(i, j, s))
                if value < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = value, i
    ranges, j = [], n
    for s in range(num_stages - 1, 0, -1):
        i = cut[s][j]
        ranges.append(range(i, j))
        j = i
    ranges.append(range(0, j))
    return ranges[::-1]
