"""Worker: LAMB's per-tensor norms over real ZeRO shards (flat chunks and FSDP2 rows) against one process.

The tensors are crafted so each rank's part has a very different norm (rows of 1 and rows of 100): a norm
taken over a rank's part only is far off. A negative control steps the flat shards with the partition's
all-reduce taken away, and must differ. Adagrad (which creates its state in its constructor) is sharded too.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from common import rank, run_worker, write_report
from torch import nn

from lightning_hybrid.optim import LAMB, TensorPartition
from lightning_hybrid.strategies.zero.flat_optimizer import FlatShardedOptimizer


def _tensors() -> list[torch.Tensor]:
    a = torch.ones(6, 5, dtype=torch.float64)
    a[5:] = 100.0  # the last row: rank 1's part of the flat buffer (rank 0 holds the first 25 elements)
    b = torch.linspace(-1, 1, 7, dtype=torch.float64)
    c = torch.full((3, 4), 0.5, dtype=torch.float64)
    return [a, b, c]


def _grad(step: int, t: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 10 + t.numel())
    return torch.randn(t.shape, generator=g, dtype=t.dtype)


def _groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.05}]  # two groups: tensors numbered across


def _reference(make, steps: int) -> list[torch.Tensor]:
    params = [nn.Parameter(t.clone()) for t in _tensors()]
    opt = make(_groups(params))
    for step in range(steps):
        for p in params:
            p.grad = _grad(step, p)
        opt.step()
    return [p.detach() for p in params]


def _flat(make, steps: int, *, reduce_norms: bool = True) -> list[torch.Tensor]:
    params = [nn.Parameter(t.clone()) for t in _tensors()]
    opt = make(_groups(params))
    names = {p: f"p{i}" for i, p in enumerate(params)}
    sharded = FlatShardedOptimizer(opt, names=names, group=dist.group.WORLD, zero_stage=1, bucket_numel=8)
    if isinstance(opt, LAMB):
        partition = sharded.tensor_partition()
        if not reduce_norms:
            partition = TensorPartition(partition.segments, partition.num_tensors, group=None)
        opt.set_tensor_partition(partition)
    for step in range(steps):
        for p in params:
            p.grad = _grad(step, p)
        sharded.reduce_gradients()
        sharded.swap_in()  # the param groups hold this rank's chunks while it steps
        opt.step()
        sharded.swap_out()
        sharded.gather_parameters()
    return [p.detach().clone() for p in params]


def _max_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _fsdp(steps: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        layer = nn.Linear(4, 6, bias=False).double()
        with torch.no_grad():
            layer.weight.copy_(torch.ones(6, 4))
            layer.weight[3:] *= 100.0  # rank 1's rows
        return layer

    ref, sharded = build(), build()
    fully_shard(sharded, mesh=init_device_mesh("cpu", (2,)))
    opt_ref, opt = LAMB(ref.parameters(), lr=0.1), LAMB(sharded.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 8 * 4, dtype=torch.float64).view(8, 4)
    for _ in range(steps):
        ref(x).pow(2).sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
        # each rank sees half the batch; FSDP averages, so the gradient is the full batch's mean x 2 / 2
        half = x[rank() * 4 : (rank() + 1) * 4]
        (sharded(half).pow(2).sum() * 2).backward()
        opt.step()
        opt.zero_grad()
    return float((sharded.weight.full_tensor() - ref.weight.detach()).abs().max())


def main(cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo")
    lamb = lambda groups: LAMB(groups, lr=0.1, weight_decay=0.01)  # noqa: E731
    adagrad = lambda groups: torch.optim.Adagrad(groups, lr=0.1, initial_accumulator_value=0.3)  # noqa: E731
    want = _reference(lamb, 3)
    report = {
        "rank": rank(),
        "flat": _max_err(_flat(lamb, 3), want),
        "flat_without_all_reduce": _max_err(_flat(lamb, 3, reduce_norms=False), want),
        "adagrad": _max_err(_flat(adagrad, 3), _reference(adagrad, 3)),
        "fsdp": _fsdp(3),
    }
    dist.barrier()  # every rank's collectives are done
    write_report(cfg["out"], report)
    # what is under test is reported: leave without tearing gloo down, which on torch 2.13 can abort at
    # interpreter exit ("terminate called without an active exception") after FSDP2's async collectives
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    run_worker(main)
