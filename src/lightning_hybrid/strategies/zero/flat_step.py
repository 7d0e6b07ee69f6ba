"""The step side of the flat sharded optimizer (:class:`~.flat_optimizer.FlatShardedOptimizer` mixes it in):
``zero_grad`` wherever ZeRO holds gradients, the window's reduction into each rank's shard with its agreements,
what user code did to the gradients since (settled, or refused), and the parameters gathered after the step."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_hybrid._agree import agreed_problem, raise_agreed
from lightning_hybrid.strategies._user_code import UserGradientCode
from lightning_hybrid.strategies.zero.buckets import BucketQueue
from lightning_hybrid.strategies.zero.collectives import gather_shards

__all__ = ["FlatStep"]


class FlatStep:
    """Mixed into ``FlatShardedOptimizer``, whose attributes these are."""

    groups: list[Any]
    group: dist.ProcessGroup
    queue: BucketQueue
    problem: str | None
    user_problem: str | None
    user: UserGradientCode
    hold: bool

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: discard the window's gradients wherever they are held (the flat buffers,
        ZeRO-2's buckets and shard gradients), as it would discard ``.grad`` without ZeRO."""
        if self.hold:
            return
        for g in self.groups:
            g.grads.clear()
            g.shard.grad = None
            for c in g.chunks:
                c.tensor.grad = None
        self._zero_grad(set_to_none)  # the .grad of what the groups hold now (a group not flattened yet too)

    # ---------------------------------------------------------------------------------------- the step

    def step(self, closure: Any = None) -> Any:
        """``optimizer.step``: the closure first (backward, the reduction, the precision plugin's hooks), then,
        before the update, a gradient user code assigned to a model parameter where this rank steps its shard
        is refused on every rank (it would be ignored: the update reads the shard)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.user.reads_at_step:
            self._refuse_user_problems()
        self._step()
        return loss

    def before_backward(self) -> None:
        """Another backward follows: placeholders go; an assignment over one is kept as this rank's problem."""
        for g in self.groups:
            problem = g.grads.before_backward()
            self.user_problem = self.user_problem or problem

    def after_backward(self) -> None:
        """A backward (one micro-batch, or a pipeline schedule's) finished."""
        for g in self.groups:
            g.grads.after_backward()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """The window closed: each rank's shard gets its slice of the replicas' mean gradient; parameters no
        rank produced a gradient for get none (not stepped). One small all-reduce checks that every rank
        agrees on the groups, issued the same reductions and adopted added groups without a failure
        (``problem``); a second, only when some parameter went unused on some rank, agrees on which."""
        if self.user.reads_after_backward or self.user.reads_at_step:
            self._refuse_user_problems()
        problem, self.problem = self.problem, None
        values = [0] * 9 + [1]  # a rank that failed to adopt a group only says so (its groups may be half built)
        if problem is None:
            self.load_parameters_into_shards()  # a callback that rebound a parameter's .data: its values go back in
            for g in self.groups:
                g.grads.note_gradients()
            used = [u for g in self.groups for u in g.grads.used]
            values = [
                *(len(self.groups), -len(self.groups), len(used), -len(used)),
                *(self.queue.signature, -self.queue.signature),
                int(self.queue.pending()),
                int(any(not u and p.requires_grad for g in self.groups for u, p in zip(g.grads.used, g.params))),
                int(self.queue.late is not None),
                0,
            ]
        header = torch.tensor(values, dtype=torch.int64, device=self._device)
        dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self.group)
        *agreed, failed = header.tolist()
        if failed:  # every rank raises the failures' messages, naming the ranks
            raise_agreed(problem, RuntimeError, device=self._device)
        groups_max, groups_min, params_max, params_min, sig_max, sig_min, pending, unused, late = agreed
        if groups_max != -groups_min or params_max != -params_min:
            raise RuntimeError(
                "The data-parallel ranks hold different parameter groups for this optimizer"
                f" ({-groups_min}..{groups_max} flat groups, {-params_min}..{params_max} parameters): a callback"
                " changed the param groups on some ranks only. Change them on every rank."
            )
        if sig_max != -sig_min:
            raise RuntimeError(
                "The data-parallel ranks reduced different ZeRO-2 gradient buckets in this step (a backward that ran"
                " on some ranks only). Use ZeroConfig(reduce_gradients='once_per_step')."
            )
        if late:
            self.queue.raise_late(self.group, self._device)
        if pending:  # gradients that no backward boundary took (every rank flushes, so the order holds)
            self.queue.end_backward()
        for g in self.groups:
            if g.params:
                g.grads.reduce(g.shard)
                g.grads.closed = True  # until the strategy's next backward
        if unused:
            mask = torch.tensor(used, dtype=torch.uint8, device=self._device)
            dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
            used = [bool(u) for u in mask.tolist()]
        self._give_chunks(used)

    def _give_chunks(self, used: list[bool]) -> None:
        """The chunks this rank steps get their slice of the shard gradient, those of a parameter no replica has
        a gradient for none (as in one process: not stepped); the model's ``.grad`` follow (``after_mask``)."""
        first = 0
        for g in self.groups:
            grad = g.shard.grad
            for c in g.chunks:
                c.tensor.grad = None if grad is None or not used[first + c.index] else grad[c.start : c.stop]
            g.grads.after_mask(used[first : first + len(g.params)])
            first += len(g.params)

    @torch.no_grad()
    def settle(self) -> None:
        """The window was reduced before user code ran (``on_after_backward``, manual optimization): what it
        assigned or dropped is written into the buffers, and if any replica changed anything the buffers become
        the replicas' mean again; an assignment where ZeRO-2 handed the gradient off is refused. One all-reduce
        of flags agrees on all of it."""
        self._refuse_user_problems()
        changed: list[bool] = []
        has: list[bool] = []
        for g in self.groups:
            c, h = g.grads.edits()
            changed += c
            has += h
        flags = torch.tensor([*changed, *has], dtype=torch.uint8, device=self._device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        values = [bool(v) for v in flags.tolist()]
        n = len(changed)
        if any(values[:n]):
            for g in self.groups:
                g.grads.average_again()
        self._give_chunks(values[n:])
        for g in self.groups:
            g.grads.release()

    def _refuse_user_problems(self) -> None:
        """A gradient user code assigned where the pack took the parameter's (this rank's own problem, kept from
        a backward, or found now): every rank of the job raises the same message (one all-reduce of a flag over
        the world: every stage reaches this point of the step)."""
        problem, self.user_problem = self.user_problem, None
        problem = problem or next((p for g in self.groups if (p := g.grads.problem())), None)
        agreed = agreed_problem(problem, device=self._device)
        if agreed:
            raise RuntimeError(agreed)

    @torch.no_grad()
    def scale_gradients(self, scale: float) -> None:
        """Multiply the reduced gradients (this rank's shard of them) by ``scale``."""
        for g in self.groups:
            if g.shard.grad is not None:
                g.shard.grad.mul_(scale)

    @property
    def _device(self) -> torch.device:
        # where the backend communicates: gloo on the host, NCCL on the parameters' device
        if str(dist.get_backend(self.group)) == "gloo":
            return torch.device("cpu")
        return self.groups[0].flat.device if self.groups else torch.device("cpu")

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank's updated shard back into the full parameters, in place (the shard is its own slice of the
        output: nothing staged), while the gradient buffers are cleared."""
        pending = [gather_shards(g.flat, g.shard_numel, self.group) for g in self.groups if g.params]
        for g in (g for g in self.groups if g.params):
            g.grads.after_step(g.shard)  # gradient buffers only: no gathered parameter among them
            for c in g.chunks:
                c.tensor.grad = None
        for work in pending:
            work.wait()
