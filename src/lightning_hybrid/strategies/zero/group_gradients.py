"""The gradients of one ZeRO-1/2 flat group, as every kind of them keeps them (``flat_gradients``,
``bucket_gradients``): which parameters produced one, what user code between backward and the step may do to
``.grad`` and what that means, and the placeholders that say where a gradient went."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.strategies._user_code import RUN_BACKWARD_INSIDE, UserGradientCode
from lightning_hybrid.strategies.zero.elsewhere import GradientElsewhere, is_gradient

__all__ = ["GroupGradients"]


class GroupGradients(ABC):
    """The gradients of one flat group: ``params`` at ``offsets`` of a buffer of ``padded`` elements."""

    averaged_every_backward = False  # whether the gradient is the replicas' mean after each backward
    holds_whole = True  # the window's whole gradient is in a buffer until the step (not ZeRO-2's default)

    def __init__(
        self,
        params: list[nn.Parameter],
        offsets: list[int],
        padded: int,
        *,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        device: torch.device,
        names: list[str],
        zero_stage: int = 1,
        user: UserGradientCode | None = None,
    ) -> None:
        self.params, self.offsets, self.padded, self.names = params, offsets, padded, names
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = padded // self.world
        self.dtype, self.device = dtype, device
        self.zero_stage, self.user = zero_stage, user or UserGradientCode()
        # the replicas' mean is in the buffer when backward ends, before user code reads .grad
        self.full = self.holds_whole and self.user.reads_after_backward
        self.used = [False] * len(params)  # this rank produced a gradient for it in this window
        # the segments of a persistent buffer that hold this window's gradient: the window's first gradient is
        # copied in, not added to zeros, and the rest is zeroed just before a reduction reads it (the buffer is
        # never zeroed whole per step: on the host a memset of the model's gradient bytes)
        self._written: set[int] = set()
        self.linked: set[int] = set()  # parameters whose .grad the pack made a view of the buffer
        self.released = False  # the pack took the model's .grad away at the step's start (shard kept)
        self._reduced = False  # reduced, not stepped yet: this rank's shard holds the mean, the rest is stale
        self.mask: list[bool] = [True] * len(params)  # the agreed "some replica has it", from the last reduction
        self._elsewhere: dict[int, GradientElsewhere] = {}
        self.hooked: set[int] = set()
        self.closed = False  # reduced: until the strategy's next backward, a gradient arriving comes late
        self.late: str | None = None  # the first parameter whose gradient arrived late on this rank
        self.watch_trainable()

    def watch_trainable(self) -> None:
        """Hook the parameters that are trainable now (a parameter unfrozen later is hooked at the next step;
        until then its gradient is collected when the window closes)."""
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self.hooked:
                self._hook(i, p)
                if self.user.reads_after_backward or self.user.reads_at_step:  # placeholders can be in .grad
                    p.register_hook(functools.partial(self._before_accumulating, i))
                self.hooked.add(i)

    def _before_accumulating(self, index: int, grad: Tensor) -> Tensor:
        # a late gradient (refused at the step, on every rank) must not fail on a placeholder on this rank alone
        if self.arrived_late(index) and type(self.params[index].grad) is GradientElsewhere:
            self.params[index].grad = None
        return grad

    @abstractmethod
    def _hook(self, index: int, param: nn.Parameter) -> None: ...

    def _refuse_graph(self, index: int) -> None:
        """Called when autograd accumulated a parameter's gradient: a backward with ``create_graph=True``
        (grad mode on inside it) accumulates out of place (``.grad`` becomes a new tensor holding the earlier
        gradient too) and keeps a graph a flat buffer cannot: refused, on every rank alike (each runs the same
        backward)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"backward(create_graph=True) reached {self.names[index]}: ZeRO-1/2 move gradients into flat"
                " buffers, which keep no graph (and an out-of-place"
                " accumulation would count an earlier micro-batch twice). For a gradient penalty use"
                " torch.autograd.grad(..., create_graph=True), which does not accumulate into .grad; for"
                " second-order training use zero_stage=0 or 3."
            )

    def segment(self, flat: Tensor, index: int) -> Tensor:
        off, p = self.offsets[index], self.params[index]
        return flat[off : off + p.numel()]

    def note_gradients(self) -> None:
        """Gradients that reached ``.grad`` without the hooks (a schedule's own accumulation) count as produced."""
        for i, p in enumerate(self.params):
            if is_gradient(p.grad):
                self.used[i] = True

    def after_backward(self) -> None:
        """A backward (or a pipeline schedule's backwards) finished: gradients that are not in the buffer yet
        (a schedule accumulated weight gradients itself) go there now, before ``zero_grad`` could unlink them."""
        self.note_gradients()

    def before_backward(self) -> str | None:
        """Another backward follows: the placeholders go; a gradient user code assigned where the pack had
        taken the parameter's is refused (returned as the problem: it cannot join what was reduced)."""
        problem = self.problem()
        for p in self.params:
            if p.grad is not None and (type(p.grad) is GradientElsewhere or problem):
                p.grad = None
        self.released = self.closed = False
        self.late = None
        return problem

    def arrived_late(self, index: int) -> bool:
        """Whether a gradient autograd is accumulating now comes after the window was reduced (a backward run
        in a hook, outside the strategy's backward): it would reach this replica only."""
        if self.closed:
            self.late = self.late or self.names[index]
        return self.closed

    def problem(self) -> str | None:
        """A gradient that arrived late, or one assigned where the pack had taken the parameter's (see
        :meth:`_taken`)."""
        if self.late:
            return (
                f"The gradient of {self.late} grew after zero_stage={self.zero_stage} had reduced the window: a"
                " backward ran outside the strategy's backward (in on_after_backward, on_before_optimizer_step or"
                f" another hook), so its gradients would reach this replica only. {RUN_BACKWARD_INSIDE}"
            )
        for i, p in enumerate(self.params):
            if is_gradient(p.grad) and self._taken(i):
                return (
                    f"A gradient was assigned to {self.names[i]}.grad where zero_stage={self.zero_stage} had"
                    f" taken the parameter's own: {self._elsewhere_message(i)}"
                )
        return None

    def _taken(self, index: int) -> bool:
        """Whether the pack took this parameter's ``.grad`` away (a real tensor there now is user code's)."""
        return self.released

    @abstractmethod
    def reduce(self, shard: nn.Parameter) -> None:
        """The window closed: ``shard.grad`` becomes this rank's slice of the replicas' mean gradient."""

    def after_mask(self, mask: list[bool]) -> None:
        """The agreed "some replica has a gradient for it" after a reduction: full groups show the mean in
        ``.grad`` of those (linked views), others hand the model's ``.grad`` over (:meth:`release`)."""
        self.mask = list(mask)
        if not self.full:
            self.release()
            return
        flat = self._buffer()
        for i, p in enumerate(self.params):
            if mask[i]:
                p.grad = self.segment(flat, i).view_as(p)
                self.linked.add(i)
            else:
                p.grad = None
                self.linked.discard(i)

    def edits(self) -> tuple[list[bool], list[bool]]:
        """After user code ran on the reduced (full) gradient: which parameters it changed by assignment or
        dropped (written into the buffer now), and which this replica has a gradient for."""
        changed, has = [False] * len(self.params), list(self.mask)
        if not self.full:
            return changed, has
        flat = self._buffer()
        for i, p in enumerate(self.params):
            segment = self.segment(flat, i)
            if i in self.linked and is_gradient(p.grad) and p.grad.data_ptr() == segment.data_ptr():
                continue
            if is_gradient(p.grad):
                with torch.no_grad():
                    segment.copy_(p.grad.reshape(-1))
                changed[i] = has[i] = True
            elif i in self.linked or p.grad is not None:
                with torch.no_grad():
                    segment.zero_()
                changed[i], has[i] = True, False
        return changed, has

    @torch.no_grad()
    def average_again(self) -> None:
        """Some replica changed the reduced gradient: the buffer becomes the replicas' mean of what they hold."""
        if self.full:
            flat = self._buffer()
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)

    def release(self) -> None:
        """From the step's start the model's ``.grad`` is taken away (the rank keeps its shard): a placeholder
        where user code can look at it, ``None`` elsewhere."""
        for i, p in enumerate(self.params):
            p.grad = self._placeholder(i) if self.user.reads_at_step or self.user.reads_after_backward else None
        self.linked.clear()
        self.released = True
        # from here the shard is what steps (clipping scales it): a later backward starts from it (_reopen)
        self._reduced = self._reduced or self.full

    @torch.no_grad()
    def _reopen(self) -> None:
        """Gradients arrive after the window was reduced and before its step (manual optimization clipped, then
        ran another backward): the buffer becomes a sum again, so that reducing it once more adds the new
        gradients to what was reduced (and clipped) before, exactly: this rank's shard back to the replicas'
        sum, the rest (this rank's own sums, or the mean others hold and step) zero."""
        if not self._reduced:
            return
        self._reduced = False
        flat, own = self._buffer(), self._shard_slice()
        flat[own].mul_(self.world)
        flat[: own.start].zero_()
        flat[own.stop :].zero_()
        self._written = set(range(len(self.params)))  # all of it is the window's now (sums and zeros)

    def _placeholder(self, index: int) -> GradientElsewhere:
        if index not in self._elsewhere:
            self._elsewhere[index] = GradientElsewhere(self.params[index], self._elsewhere_message(index))
        return self._elsewhere[index]

    def _elsewhere_message(self, index: int) -> str:
        return (
            f"{self.names[index]}.grad: under zero_stage={self.zero_stage} each data-parallel rank keeps only its"
            " shard of the reduced gradient from the optimizer step's start (the shard it steps), so no rank holds"
            " this gradient whole. In on_before_optimizer_step the optimizer's param groups hold this rank's"
            " shard (element-wise edits there are exact); edit or read whole gradients in on_after_backward, where"
            " they are the replicas' mean as under DDP; use gradient_clip_val for clipping by the global norm; or"
            " use zero_stage=0."
        )

    def after_step(self, shard: nn.Parameter) -> None:
        shard.grad = None
        self._forget()
        self.watch_trainable()

    def local_gradients(self) -> list[Tensor]:
        """The gradient accumulated so far in the window, as this rank holds it (for the noise scale)."""
        return [p.grad for p in self.params if is_gradient(p.grad)]

    def clear(self) -> None:
        """``optimizer.zero_grad()``: every gradient of the window is discarded, wherever it is held."""
        self._forget()

    def _forget(self) -> None:
        """No gradient of a window in the model's ``.grad`` and nothing known of one (a step or zero_grad)."""
        for p in self.params:
            p.grad = None
        self.linked.clear()
        self.released = self._reduced = self.closed = False
        self.late = None
        self.used = [False] * len(self.params)
        self._written = set()

    @abstractmethod
    def _buffer(self) -> Tensor:
        """The flat buffer gradients accumulate in."""

    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _take(self, index: int, flat: Tensor) -> None:
        """Make ``.grad`` of parameter ``index`` a view of its segment of ``flat``, keeping what it means: a view
        already is; a gradient user code assigned over the pack's view replaces the segment (``None`` there
        drops it); any other gradient (autograd's first of the window, a schedule's own weight gradients) is
        added to what the segment holds."""
        self._reopen()
        p, segment = self.params[index], self.segment(flat, index)
        grad = p.grad
        if not is_gradient(grad):
            if grad is None and index in self.linked:  # dropped by user code: as in one process
                segment.zero_()
                self._written.add(index)
                self.linked.discard(index)
                self.used[index] = False
            elif grad is not None:
                p.grad = None
            return
        if grad.data_ptr() == segment.data_ptr():  # backward accumulated into the view: the segment is this window's
            self.linked.add(index)
            self._written.add(index)
            return
        if index in self.linked or index not in self._written:  # replaced, or the window's first
            segment.copy_(grad.reshape(-1))
        else:
            segment.add_(grad.reshape(-1))
        p.grad = segment.view_as(p)
        self.linked.add(index)
        self._written.add(index)

    @torch.no_grad()
    def _zero_unwritten(self, flat: Tensor, members: Iterable[int], lo: int, hi: int) -> None:
        """Zeros in ``flat[lo:hi]`` (``members`` in the buffer's order) wherever no gradient of this window was
        written (an earlier window's is there), and in the gaps and padding, before a reduction reads it: one
        fill per stretch between written segments (a frozen backbone's parameters are one fill, not one each)."""
        start = lo  # where the stretch still to be zeroed begins
        for i in members:
            begin = self.offsets[i]
            if i in self._written:
                if start < begin:
                    flat[start:begin].zero_()
                start = max(start, begin + self.params[i].numel())
            else:
                self._written.add(i)
        if start < hi:
            flat[start:hi].zero_()

    def _zero_all_unwritten(self, flat: Tensor) -> None:
        self._zero_unwritten(flat, sorted(range(len(self.params)), key=self.offsets.__getitem__), 0, self.padded)

    def _take_all(self, flat: Tensor) -> None:
        for i in range(len(self.params)):
            self._take(i, flat)

    def _strays(self, flat: Tensor | None) -> bool:
        """Whether some ``.grad`` is not the pack's view (or was dropped from one)."""
        for i, p in enumerate(self.params):
            if is_gradient(p.grad):
                if flat is None or p.grad.data_ptr() != self.segment(flat, i).data_ptr():
                    return True
            elif p.grad is None and i in self.linked:
                return True
        return False

    def _shard_slice(self) -> slice:
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)

    @torch.no_grad()
    def _reduce_full(self, shard: nn.Parameter, flat: Tensor) -> None:
        """Full: the whole buffer all-reduced to the replicas' mean (what DDP moves); this rank's shard steps."""
        self._take_all(flat)
        self._zero_all_unwritten(flat)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        shard.grad = flat[self._shard_slice()]
