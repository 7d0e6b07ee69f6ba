"""Tensor-parallel peers hold one replica: what each holds whole must stay equal, checked after the first steps.

A parameter the plan keeps whole gets the same gradient on every peer only when it acts on whole activations.
One that acts on activations the plan split (a per-head norm inside split attention, a norm in a
sequence-parallel region without ``SequenceParallel()``) gets only its rank's part of the gradient, as under
torch's own tensor parallelism, and the peers' copies drift apart with nothing raised. No check before the
first step can see it (the plan names modules, not what flows into them); its effect shows after one update.

After each of the first :data:`CHECKED_STEPS` optimizer steps of a fit, every peer reduces each such parameter
to three float64 numbers (the sum of its magnitudes, and two projections on fixed position-dependent weights),
the peers gather them, and a difference beyond rounding noise stops every rank with the parameters named.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid.strategies.tensor.check import PlanCheck

__all__ = ["CHECKED_STEPS", "WholeOnPeers"]

CHECKED_STEPS = 2
_CHUNK = 2**22  # elements per read: bounded memory, whatever the parameter
_TOLERANCE = 1e-9  # relative to the parameter's magnitude: peers computing alike agree to the last bits


class WholeOnPeers:
    """The parameters of ``module`` every peer of ``group`` holds whole (``params``, by name), checked equal."""

    def __init__(
        self,
        params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup,
        device: torch.device,
        plan_check: PlanCheck | None = None,
    ) -> None:
        self.params, self.group, self.device, self.steps = params, group, device, 0
        self.plan_check = plan_check  # run after the first step, its verdict agreed with this one's

    def after_step(self) -> None:
        """One of the first steps of a fit ended on every rank: compare (a collective: every rank calls it)."""
        if self.steps >= CHECKED_STEPS:
            return
        self.steps += 1
        names: list[str] = []
        if self.params:  # the same parameters on every peer (a stage's blocks, split alike)
            mine = torch.stack([_summary(p) for _, p in self.params]).to(self.device, torch.float64)
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, mine, group=self.group)
            seen = torch.stack(rows).cpu()  # peers x parameters x 3
            scale = seen[:, :, 0].amax(dim=0).clamp_min(1e-30)
            apart = ((seen[:, :, 1:] - seen[:1, :, 1:]).abs().amax(dim=(0, 2)) > _TOLERANCE * scale).tolist()
            names = [name for (name, _), off in zip(self.params, apart) if off]
        problems = []
        if self.steps == 1 and self.plan_check is not None:
            found = self.plan_check.run(self.group, self.device)
            if found:
                problems.append(
                    f"The tensor-parallel plan changes what a block computes: {found}. A fused projection (q, k"
                    " and v in one Linear) split column-wise gives each rank a slice across q, k and v, not whole"
                    " heads; a module that takes a head count or a width from a constant, not from its weights,"
                    " computes with the whole model's number. Give fused projections one Linear each (or gather"
                    " their output: ColwiseParallel(output_layouts=Replicate())), and read sizes from the weights."
                )
        if names:
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            problems.append(
                f"After step {self.steps}, parameters the tensor-parallel plan keeps whole differ between"
                f" tensor-parallel peers: {shown}. Each acts on activations the plan split (a norm in a"
                " sequence-parallel region, a per-head norm inside split attention), so it got only its rank's part"
                " of the gradient and the peers' copies drift apart. Put such modules under a style"
                " (SequenceParallel() replicates the parameters and sums their gradients over the peers), or gather"
                " the activations before them (PrepareModuleInput to Replicate())."
            )
        agreed = agreed_problem(" ".join(problems) or None, device=self.device)  # the world: every rank stops, or none
        if agreed is not None:
            raise RuntimeError(agreed)


def _summary(param: Tensor) -> Tensor:
    """The sum of magnitudes and two position-weighted sums of this rank's values of ``param`` (float64)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    flat = local.detach().reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        values = flat[start : start + _CHUNK].to(torch.float64)
        positions = torch.arange(start + 1, start + 1 + values.numel(), dtype=torch.float64, device=values.device)
        out += torch.stack([values.abs().sum(), (values * positions.sin()).sum(), (values * positions.cos()).sum()])
    return out
