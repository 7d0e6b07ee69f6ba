"""The only place lightning-hybrid touches private torch names (checked on torch 2.13).

Each has a fallback, so a rename in a future release costs a detail, not a crash.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DCP_PRIVATE_GLOBALS",
    "PARAMETER_ATTRIBUTES_OF_TORCH",
    "RaisingTensor",
    "clear_forward_hooks",
    "default_store",
    "dtensor_offsets",
    "grad_scaler_growth_tracker",
    "init_optimizer_state",
    "mul_",
    "note_failed_fit",
    "own_parameters",
    "post_accumulate_hooks",
    "tensor_hooks",
    "queue_backward_callback",
    "replace_optimizer_step",
    "side_effect_free_stage",
    "wait_for_gloo_at_exit",
]


def default_store() -> dist.Store | None:
    """The key-value store of the default process group (torch 2.13: ``distributed_c10d._get_default_store``),
    or ``None`` when there is none or torch no longer offers it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # a missing store only costs the caller a detail
        return None


class RaisingTensor(Tensor):
    """A tensor with a shape, strides, dtype and device and no storage, on which every operation raises
    ``RuntimeError(message)`` (torch 2.13: built by ``Tensor._make_wrapper_subclass`` as DTensor builds its
    wrappers; ``__torch_dispatch__`` sees every operation; ``torch._C._disabled_torch_function_impl`` keeps
    ``__torch_function__`` out of the way, and ``torch.utils._pytree.tree_leaves`` finds it among the arguments)."""

    message: str

    @staticmethod
    def __new__(cls, like: Tensor, message: str) -> RaisingTensor:
        t = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False
        )
        t.message = message
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[attr-defined]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_leaves

        message = next(a.message for a in tree_leaves((args, kwargs)) if isinstance(a, RaisingTensor))
        raise RuntimeError(message)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self.message})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(self.message)


def tensor_hooks(param: Tensor) -> list[Callable[[Tensor], Any]]:
    """The hooks ``param.register_hook`` registered on a leaf (torch 2.13: ``Tensor._backward_hooks``, an ordered
    dict; ``Tensor.__deepcopy__`` leaves it behind). Empty when torch keeps them elsewhere."""
    hooks = getattr(param, "_backward_hooks", None)
    return list(hooks.values()) if hooks else []


def post_accumulate_hooks(param: Tensor) -> list[Callable[[Tensor], Any]]:
    """The hooks ``param.register_post_accumulate_grad_hook`` registered (torch 2.13:
    ``Tensor._post_accumulate_grad_hooks``, an ordered dict or None)."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


def clear_forward_hooks(module: torch.nn.Module) -> None:
    """Drop every forward and forward pre-hook of ``module`` and its submodules (on a private copy: the hooks
    were copied with the module)."""
    for m in module.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs):
            hooks.clear()
        m._forward_pre_hooks_with_kwargs.clear()
        m._forward_hooks_always_called.clear()


def dtensor_offsets(tensor: Any) -> tuple[int, ...]:
    """The whole tensor's index of a DTensor's first local element on this rank (torch 2.13:
    ``tensor._utils.compute_local_shape_and_global_offset``, which knows FSDP2's strided shards)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(o) for o in offsets)


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """The parameters ``module`` registers itself, as the live dict (``nn.Module._parameters``): a value
    replaced there keeps its key's position, so ``named_parameters()`` keeps its order."""
    found = getattr(module, "_parameters", None)
    if not isinstance(found, dict):
        raise RuntimeError(f"torch {torch.__version__}: nn.Module keeps its parameters elsewhere; update the pack")
    return found


def mul_(tensors: list[Tensor], factor: float) -> None:
    """Multiply every tensor in place by ``factor``: one fused kernel per device where torch offers it
    (torch 2.13: ``torch._foreach_mul_``), else one multiply per tensor."""
    foreach = getattr(torch, "_foreach_mul_", None)
    if foreach is not None:
        foreach(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state as its first step would, without changing a parameter (a step with zero
    gradients at LR 0; torch 2.13: ``checkpoint.state_dict._init_optim_state``, what DCP does before it loads
    optimizer state). A no-op when the state exists or some parameter has a gradient."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    init = getattr(dcp_state_dict, "_init_optim_state", None)
    if init is not None:
        init(optimizer)
        return
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def replace_optimizer_step(optimizer: torch.optim.Optimizer, step: Callable[..., Any]) -> None:
    """Make ``step(optimizer, closure=None)`` the optimizer's own ``step`` (a method of the instance: an LR
    scheduler made later rebinds what it wraps to it). The step it replaces may be an LR scheduler's wrapper,
    which counts the optimizer's steps; the new one calls it, so it keeps the wrapper's mark (torch 2.13:
    ``_wrapped_by_lr_sched``), or the scheduler's first step would warn that the optimizer's step was
    overridden after it was made."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (called from inside a backward hook;
    torch 2.13: ``Variable._execution_engine.queue_callback``, what DDP and FSDP2 use for their final
    reductions). Without it, raises: the caller then has no per-backward boundary and must say so."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise RuntimeError("this torch offers no autograd queue_callback; use reduce_gradients='once_per_step'")
    queue(callback)


def side_effect_free_stage(stage_class: type, begin: Callable[[], None], end: Callable[[], None]) -> type:
    """A ``PipelineStage`` subclass whose shape inference leaves no trace.

    torch 2.13's stages infer their input and output shapes at the first step by running the stage: forward on
    a copy of the first micro-batch (first stage) or on uninitialised tensors (the others), then a backward
    through the inputs that calls the loss function (``_forward_metadata_inference``,
    ``_backward_metadata_inference``, then ``_post_metadata_inference_cleanup``; torch forks the RNG around
    them itself). That forward updates BatchNorm's running statistics (with garbage on the later stages), and
    the loss function sees a micro-batch that is not one. ``begin()`` runs before each inference call (it may
    run several times), ``end()`` after the clean-up. Without those private methods (another torch), the
    class is ``stage_class`` itself."""
    names = ("_forward_metadata_inference", "_backward_metadata_inference", "_post_metadata_inference_cleanup")
    if not all(callable(getattr(stage_class, n, None)) for n in names):
        return stage_class
    forward, backward, cleanup = (getattr(stage_class, n) for n in names)

    def inferring(inner: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            begin()
            return inner(self, *args, **kwargs)

        return method

    def cleaned(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return cleanup(self, *args, **kwargs)
        finally:
            end()

    return type(
        "SideEffectFreeStage", (stage_class,), dict(zip(names, (inferring(forward), inferring(backward), cleaned)))
    )


# ------------------------------------------------------------------------------------------ a clean exit

_GLOO_WORKER = "pt_gloo_runloop"  # torch 2.13: the name ProcessGroupGloo gives its worker threads
_exit_wait_installed = False


def wait_for_gloo_at_exit() -> None:
    """Before the interpreter finalises, let gloo's worker threads finish with Python (registered once).

    A finished job could abort at exit ("terminate called without an active exception", SIGABRT, so torchrun
    and Slurm report a failure and a requeue policy restarts it): a ProcessGroupGloo worker drops its last
    reference to a finished collective after ``wait()`` returned, which decrefs the Python objects of tensors
    Python had already dropped and so needs the GIL. When the main thread reaches ``Py_FinalizeEx`` first, the
    worker gets the GIL during finalisation, CPython 3.11 ends it with ``pthread_exit`` and the unwind through
    a noexcept destructor calls ``std::terminate`` (pytorch/pytorch#38228). ``destroy_process_group`` does not
    help: gloo's ``shutdown`` does nothing and the process group lives until its last reference dies, during
    finalisation. The handler runs before that, in ``atexit`` (after every handler registered later, so after
    any collective they issue): it releases the GIL until every gloo worker is parked in its idle wait (an
    untimed condition-variable wait, read from ``/proc/self/task/<tid>/syscall``), at most 2 seconds (a rank
    leaving with a collective in flight must not hang), about 5 ms in a normal exit. Loggers, ``atexit``
    handlers and the exit code are untouched, except when a fit that failed ends the process with a thread still
    in native code (see ``_quiet_gloo``). Where ``/proc`` cannot tell (another OS, an unknown CPU) it
    only pauses 50 ms with the GIL released, which narrows the race without closing it."""
    global _exit_wait_installed
    note_failed_fit(None)  # called as a fit sets up: it has not failed
    if not _exit_wait_installed:
        atexit.register(_quiet_gloo)
        _exit_wait_installed = True


_failed_fit: tuple[int, float] | None = None  # (exit code, when) of a fit that is ending the process
_PACK_THREADS = "lightning-hybrid-"  # the prefix of every thread the pack starts
_RECENT_S = 120.0  # a process that ran on this long after the failed fit was not ended by it


def note_failed_fit(exception: BaseException | None) -> None:
    """Record, for the exit hook, a fit that ends the process: a KeyboardInterrupt (Lightning then calls
    ``exit(1)``) or a ``SystemExit`` (the pack's preemption exits, 75 and 74), with the code the process exits
    with. Any other exception reaches the user's script, which may catch it and go on: not recorded (an
    uncaught one is seen at exit through ``sys.last_value``). ``None``: a fit starts."""
    global _failed_fit
    if exception is None:
        _failed_fit = None
    elif isinstance(exception, KeyboardInterrupt):
        _failed_fit = (1, time.monotonic())
    elif isinstance(exception, SystemExit):
        code = exception.code
        _failed_fit = (code if isinstance(code, int) else (0 if code is None else 1), time.monotonic())


def _exit_code() -> int | None:
    """The code the process is exiting with, where the pack can tell: a recent failed fit's, or 1 after an
    uncaught error; ``None`` when it cannot (then the hook never forces the exit)."""
    if _failed_fit is not None and time.monotonic() - _failed_fit[1] < _RECENT_S:
        return _failed_fit[0]
    if getattr(sys, "last_value", None) is not None:
        return 1
    return None


def _quiet_gloo(timeout: float = 2.0, settle: int = 3) -> None:
    """The exit hook (see ``wait_for_gloo_at_exit``). A thread of the pack (a background checkpoint write in a
    collective, a heartbeat in a store call) or a gloo worker still inside a collective after ``timeout``
    would come back from native code during finalisation and abort the process the same way (4 of 98 Ctrl-Cs
    of a soak): then, when the process is ending because a fit failed (``_exit_code``), it leaves without
    finalising, with that fit's exit code. Otherwise the exit goes on as before."""
    try:
        deadline, calm = time.monotonic() + timeout, 0
        while True:
            busy = _busy_pack_threads()
            states = [_gloo_idle(tid) for tid in _gloo_workers()] if os.path.isdir("/proc/self/task") else [None]
            if any(s is None for s in states) and not busy:
                time.sleep(0.05)  # no insight: a pause with the GIL released is the best there is
                return
            calm = calm + 1 if all(states) and not busy else 0
            if calm >= settle:
                return
            if time.monotonic() >= deadline:
                code = _exit_code()
                if code is not None and (busy or not all(states)):
                    _leave_without_finalising(busy, code)
                return
            time.sleep(0.002)  # the GIL is free: a worker waiting for it takes it now, while Python is whole
    except Exception:  # an exit hook never raises
        return


def _busy_pack_threads() -> list[str]:
    here = threading.current_thread()
    return [
        t.name for t in threading.enumerate() if t.name.startswith(_PACK_THREADS) and t is not here and t.is_alive()
    ]


def _leave_without_finalising(busy: list[str], code: int) -> None:
    """``os._exit(code)``, logs and streams flushed (``atexit`` handlers registered before the pack's are
    skipped: the price of not aborting)."""
    logging.getLogger(__name__).warning(
        f"exiting with code {code} without finalising the interpreter: {', '.join(busy) or 'a gloo collective'}"
        " still in native code would abort it (std::terminate) when it returns"
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream
            stream.flush()
    os._exit(code)


def _gloo_workers() -> list[str]:
    tids = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == _GLOO_WORKER:
                        tids.append(tid)
            except OSError:
                pass  # the thread just ended
    except OSError:
        pass
    return tids


def _gloo_idle(tid: str) -> bool | None:
    """True: parked in an untimed futex wait (gloo's idle wait); False: busy; None: cannot tell."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except FileNotFoundError:
        return True  # ended
    except OSError:
        return None
    futex = {"x86_64": "202", "aarch64": "98", "arm64": "98"}.get(os.uname().machine)
    if futex is None:
        return None  # the futex call's number on this CPU is not known here
    if len(fields) < 5 or fields[0] != futex:
        return False  # running, or in another call (a socket read of an unfinished collective)
    op, timeout = int(fields[2], 16), int(fields[4], 16)
    # FUTEX_WAIT_BITSET without a timeout: a condition-variable wait. Not FUTEX_WAIT (a mutex, with work left)
    # and not a timed wait (CPython's GIL wait has a timeout)
    return (op & 0x7F) == 9 and timeout == 0


# Private names torch 2.13's DCP pickles into a checkpoint's `.metadata` (the safe loader allows them by name).
DCP_PRIVATE_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # maps a layout's name to torch.strided & co.
}


def grad_scaler_growth_tracker(state_dict: dict[str, Any]) -> int | None:
    """The growth tracker of a torch ``GradScaler.state_dict()`` (its ``_growth_tracker`` key), or None when
    ``state_dict`` is not one."""
    value = state_dict.get("_growth_tracker")
    return None if value is None else int(value)


# attributes torch itself sets on a parameter (a Parameter made from a tensor subclass carries this one)
PARAMETER_ATTRIBUTES_OF_TORCH = frozenset({"_is_param"})
