"""The host step overlapped with backward: parameters stepped as their gradients land.

Backward makes the gradients of the last layers final long before it ends. With the overlap on,
each final gradient is handed to a worker thread, which waits for its copy to host, lands it
(``master.grad``) and runs the optimizer's own step on the parameters landed so far, while
backward goes on (torch's CPU kernels release the GIL). ``optimizer.step()`` then steps only what
is left.

The gradient norm lightmem logs is taken the same way: each gradient's norm as it lands
(``takes_norms``, before a clamp by value), their total once the step is taken (``norm_of``).

With clipping (``GradClip``): by value, each gradient is clamped as it lands and stepped at once;
by norm, each gradient's norm is taken as it lands, and at the end of backward (``end_backward()``)
the worker scales every gradient by the total and steps them all, without waiting for
``optimizer.step()``: the norm's pass over the gradients hides behind backward, and the step starts
the moment the last gradient has landed.

Why the result is bitwise that of one step after backward: the optimizers allowed here
(``OVERLAPPABLE``: torch's own step) keep their state per parameter and their kernels (for-loop,
foreach, fused) are elementwise per tensor, so stepping a parameter in one call or another gives
the same bits, provided the step sees the same gradient and hyperparameters (clipping by norm
included: ``grad_clip.py`` takes the per-tensor norms torch takes). That is the contract the
caller keeps: nothing between backward and ``optimizer.step()`` changes a gradient (clipping
other than the one configured, unscaling, a further accumulating backward) or a param group (an
LR change). What
can be checked is checked at ``optimizer.step()`` (a gradient written in place or replaced, a
hyperparameter changed) and raised, since a parameter already stepped cannot be un-stepped.

The worker runs the step on a stand-in for the optimizer (its ``__dict__``, its ``state``
object, param groups holding the landed subset), through the step function beneath torch's
hook wrapper: the optimizer's step hooks (lightmem's own, the user's, LR schedulers' counters)
run once, at ``optimizer.step()``, never per subset, and the user's ``param_groups`` are never
rewritten while backward runs.
"""

from __future__ import annotations

import atexit
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightmem.model_state.grad_clip import GradClip, tensor_norms, total_norm

OVERLAPPABLE = (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop",
)  # fmt: skip
"""torch optimizers whose step keeps state per parameter and updates each tensor on its own."""


def overlap_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be split across parameters, or None when it can."""
    step = inspect.unwrap(type(optimizer).step)
    torch_steps = {
        inspect.unwrap(getattr(torch.optim, name).step): name for name in OVERLAPPABLE if hasattr(torch.optim, name)
    }
    if step not in torch_steps:
        return (
            f"{type(optimizer).__name__}'s step is not one lightmem knows to be per parameter "
            f"(torch's {', '.join(OVERLAPPABLE)})"
        )
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "differentiable=True steps keep autograd history across parameters"
    return None


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step beneath torch's wrapper that runs the step hooks."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


def _kept(value: Any) -> Any:
    """A hyperparameter as it is now (a tensor one may be changed in place later)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


@dataclass
class _Landing:
    """A gradient on its way to the host: where it lands and the event of its copy."""

    master: torch.nn.Parameter
    group: int
    buffer: torch.Tensor
    staged: bool  # add to master.grad (accumulation) instead of becoming it
    event: Any
    version: int = -1  # the gradient's version once landed (-1: not landed yet)

    def land(self, host_wait: Callable[[Any], None]) -> None:
        host_wait(self.event)
        with torch.no_grad():
            if self.staged:
                self.master.grad.add_(self.buffer)  # type: ignore[union-attr]
            else:
                self.master.grad = self.buffer
        self.version = self.master.grad._version  # type: ignore[union-attr]


_LIVE: weakref.WeakSet[OverlappedStep] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # A daemon worker killed at interpreter exit in the middle of a torch kernel aborts the process.
    for overlapped in list(_LIVE):
        overlapped.close()


class OverlappedStep:
    """One worker thread that lands gradients and steps their parameters while backward runs.

    ``begin()`` at the first gradient of a backward (it snapshots the param groups' hyperparameters
    the step will use), ``submit()`` per final gradient, ``land_now()`` at the end of backward
    (the training thread lands what the worker has not), ``join()`` before the rest of the step
    (raises what the worker raised), ``commit()`` once the step has taken them. ``stepped`` are
    the parameters stepped and not yet committed, with the gradient each was stepped with and its
    version when it landed (plus the worker's own clipping writes).

    With ``clip`` by norm nothing is stepped before ``end_backward()`` (after ``land_now()``):
    then the worker scales every gradient of the optimizer's parameters by the global norm
    (``grad_norm``) and steps them all.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, host_wait: Callable[[Any], None], batch_bytes: int,
        device: torch.device | None = None, clip: GradClip | None = None,
    ) -> None:  # fmt: skip
        self.optimizer = optimizer
        self.clip = clip
        self._norms: dict[int, torch.Tensor] = {}  # id(gradient) -> its norm, as each lands (by norm, or takes_norms)
        self.takes_norms = False
        """This step takes each gradient's 2-norm as it lands, before any clipping (``norm_of``)."""
        self._landed: list[_Landing] = []  # by norm: landed this backward, stepped at its end
        self._end_of_backward = False  # by norm: every gradient handed over; clip and step them
        self.grad_norm: torch.Tensor | None = None
        """By norm: the global norm of the last step's gradients (what ``clip_grad_norm_`` returns)."""
        self._backward_ended = False  # end_backward() ran for this step
        self._device = device  # the training device: the worker's current CUDA device
        # Each call of the step costs tens of microseconds of Python holding the GIL, which
        # backward's hooks want too: the worker is woken per ``batch_bytes`` handed over, not per
        # gradient (and at the end of backward for the rest).
        self._batch_bytes = batch_bytes
        self._unsignalled_bytes = 0
        self._go = False
        self._step = _unhooked_step(optimizer)
        self._host_wait = host_wait
        self._cond = threading.Condition()
        self._ready: list[_Landing] = []
        self._busy = False
        self._batch_landed = False  # the batch the worker holds is landed (it may be stepping it)
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._groups: list[dict[str, Any]] | None = None  # hyperparameters at begin()
        self._params: list[list[torch.nn.Parameter]] = []  # each group's parameters at begin()
        self._after: Any = None  # event the host copies must be read by before the first step
        self.stepped: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []  # (master, grad, its version)
        self.stepped_bytes = 0
        self._state_entries = 0  # optimizer.state's entries at begin()

    @property
    def pending(self) -> bool:
        """Gradients were handed over since the last commit (or a step already ran for them)."""
        return self._groups is not None

    def begin(self, copies_back: Any, take_norms: bool = False) -> None:
        """The first gradient of a backward whose step follows: the hyperparameters the step uses
        are those the param groups hold now; ``copies_back`` is read before any host copy is
        rewritten; with ``take_norms`` each gradient's norm is taken as it lands (for ``norm_of``)."""
        self.takes_norms = take_norms
        self._groups = [
            {name: _kept(value) for name, value in group.items() if name != "params"}
            for group in self.optimizer.param_groups
        ]
        self._params = [list(group["params"]) for group in self.optimizer.param_groups]  # what the step covers
        self._after = copies_back
        self._state_entries = len(self.optimizer.state)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightmem-host-step", daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def submit(self, landing: _Landing) -> None:
        with self._cond:
            self._ready.append(landing)
            self._unsignalled_bytes += landing.master.nbytes
            if self._unsignalled_bytes >= self._batch_bytes:
                self._signal()

    def _signal(self) -> None:
        """With ``_cond`` held: the worker takes what is ready."""
        self._unsignalled_bytes = 0
        self._go = True
        self._cond.notify_all()

    def end_backward(self) -> None:
        """After ``land_now()``: every gradient of the step is handed over. By norm, the worker
        clips and steps them all now (otherwise each batch was stepped as it landed). Once per
        step: ``optimizer.step()`` calls it too, for a backward that raised before its end."""
        if self.clip is None or not self.clip.by_norm:
            return
        with self._cond:
            if self._backward_ended:
                return
            self._backward_ended = self._end_of_backward = True
            self._cond.notify_all()

    def land_now(self) -> None:
        """At the end of backward, in the training thread: every gradient handed over is in
        ``master.grad`` when this returns (as without the overlap), while the steps go on.
        Whatever the caller then writes into a gradient shows in its version (``changes``)."""
        with self._cond:
            while self._busy and not self._batch_landed:
                self._cond.wait()
            batch, self._ready = self._ready, []
        for landing in batch:
            landing.land(self._host_wait)
        with self._cond:
            self._ready = batch + self._ready
            if self._ready:
                self._signal()

    def join(self) -> None:
        """Wait until every gradient handed over is landed and its parameter stepped; raise what
        the worker raised (once)."""
        self.idle()
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"lightmem: the host step overlapped with backward failed: {error!r}") from error

    def idle(self) -> None:
        """Wait until the worker has done everything handed over (what it raised stays for ``join``)."""
        with self._cond:
            if self._ready:
                self._signal()
            while self._ready or self._busy or self._end_of_backward:
                self._cond.wait()

    def changes(self) -> list[str]:
        """What changed since the parameters were stepped: hyperparameters, gradients (after ``join``)."""
        changed = []
        if self._groups is not None and len(self._groups) != len(self.optimizer.param_groups):
            changed.append(f"the number of param groups ({len(self._groups)} -> {len(self.optimizer.param_groups)})")
        for index, (group, seen) in enumerate(zip(self.optimizer.param_groups, self._groups or [])):
            for name, value in seen.items():
                if not _same(value, group.get(name)):
                    changed.append(f"param group {index}'s {name!r} ({value!r} -> {group.get(name)!r})")
        # Checked against each gradient as it landed (a step never writes a gradient): a write
        # in between, even one racing the step, shows.
        touched = sum(master.grad is not grad or grad._version != version for master, grad, version in self.stepped)
        if touched:
            changed.append(f"the gradients of {touched} parameters (clipped, unscaled, accumulated or replaced)")
        return changed

    def order_new_state(self) -> None:
        """State entries the step created go in the order one step over all parameters creates
        them (param groups' order), not in the order gradients landed: ``state_dict()`` keeps the
        order of ``optimizer.state``. Call once the whole step is over."""
        state = self.optimizer.state
        if len(state) <= self._state_entries:
            return
        params = (param for group in self.optimizer.param_groups for param in group["params"])
        position = {id(param): index for index, param in enumerate(params)}
        entries = list(state.items())
        new = sorted(entries[self._state_entries :], key=lambda entry: position.get(id(entry[0]), len(position)))
        state.clear()
        state.update(entries[: self._state_entries] + new)

    def commit(self) -> None:
        """``optimizer.step()`` is over: what was stepped belongs to it."""
        self.stepped = []
        self.stepped_bytes = 0
        self._groups = None
        self._params = []
        self._after = None
        self._norms.clear()
        self._landed.clear()
        self._backward_ended = False
        self.takes_norms = False

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    # -- the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        device = self._device
        if device is not None and device.type == "cuda" and device.index is not None:
            # The current CUDA device is per thread: left at 0, the optimizer's capture check would
            # make a context on GPU 0 for a fit on another one.
            torch.cuda.set_device(device)
        while True:
            with self._cond:
                while not ((self._go and self._ready) or self._end_of_backward) and not self._closing:
                    self._cond.wait()
                if not (self._ready or self._end_of_backward):
                    return
                batch, self._ready = self._ready, []
                last, self._end_of_backward = self._end_of_backward, False
                self._go = False
                self._busy = True
                self._batch_landed = False
            try:
                self._land_and_step(batch, last)
            except BaseException as error:  # surfaced at optimizer.step(); the worker goes on landing
                with self._cond:
                    if self._error is None:
                        self._error = error
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _land_and_step(self, batch: list[_Landing], last: bool = False) -> None:
        if self._after is not None:
            self._host_wait(self._after)  # the previous step's copies to the device have read the host copies
            self._after = None
        try:
            for landing in batch:
                if landing.version < 0:
                    landing.land(self._host_wait)
        finally:
            with self._cond:
                self._batch_landed = True
                self._cond.notify_all()
        if self._error is not None or self._groups is None:
            return  # a failed batch before: land the rest (close() gives them back), step nothing
        clip = self.clip
        if clip is not None and clip.by_norm:
            self._norms.update(clip.norms([landing.master.grad for landing in batch]))  # type: ignore[misc]
            self._landed += batch
            if last:
                self._clip_and_step_all()
            return
        if self.takes_norms:  # before clipping by value writes them
            self._norms.update(tensor_norms([landing.master.grad for landing in batch]))  # type: ignore[misc]
        if clip is not None:
            clip.clamp([landing.master for landing in batch])
        subsets: dict[int, list[torch.nn.Parameter]] = {}
        for landing in batch:
            subsets.setdefault(landing.group, []).append(landing.master)
        self._step_subsets(subsets)
        writes = 0 if clip is None else clip.writes
        for landing in batch:
            self._stepped(landing.master, landing.version + writes)

    def _clip_and_step_all(self) -> None:
        """By norm, once every gradient of the step has landed: the global norm from the norms
        taken as they landed (a gradient landed by an earlier backward of the step, accumulated,
        has its norm taken now), every gradient scaled by it, every parameter stepped."""
        clip = self.clip
        assert clip is not None
        params = [param for group in self._params for param in group]
        with_grads = [param for param in params if param.grad is not None]
        grads = [param.grad for param in with_grads]
        # Each gradient's version when it landed this backward, or now (an earlier backward's).
        landed_at = {id(landing.master): landing.version for landing in self._landed}
        versions = [landed_at.get(id(param), param.grad._version) for param in with_grads]  # type: ignore[union-attr]
        self.grad_norm = self.norm_of(grads, clip.norm_type)  # type: ignore[arg-type]
        clip.scale(params, self.grad_norm)
        subsets = {index: [param for param in group if param.grad is not None] for index, group in enumerate(self._params)}
        self._step_subsets({index: subset for index, subset in subsets.items() if subset})
        for param, version in zip(with_grads, versions):
            self._stepped(param, version + clip.writes)

    def norm_of(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of ``grads`` (every gradient of the step, in the parameters' order) from
        the norms taken as they landed; one not taken (landed by an earlier, accumulating backward
        of the step) is taken now. Once the worker is idle, before anything clips those."""
        missing = [grad for grad in grads if id(grad) not in self._norms]
        if missing:
            self._norms.update(tensor_norms(missing, norm_type))
        return total_norm(grads, self._norms, norm_type)

    def _step_subsets(self, subsets: dict[int, list[torch.nn.Parameter]]) -> None:
        """The optimizer's own step over ``subsets`` (param group index -> its parameters to step),
        with the hyperparameters of ``begin()``, through a stand-in that shares the optimizer's state."""
        stand_in = object.__new__(type(self.optimizer))
        stand_in.__dict__.update(self.optimizer.__dict__)
        stand_in.param_groups = [{**self._groups[index], "params": params} for index, params in subsets.items()]  # type: ignore[index]
        self._step(stand_in)

    def _stepped(self, master: torch.nn.Parameter, version: int) -> None:
        """``master`` is stepped. Kept with it: the version its gradient has if nothing but the
        worker wrote it since it landed (its version at landing plus the clipping's writes), so
        that any other write shows in ``changes()``."""
        self.stepped.append((master, master.grad, version))  # type: ignore[arg-type]
        self.stepped_bytes += master.nbytes
