"""``offload_activations``: the context manager users put around a forward pass."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from types import TracebackType

import torch
from torch import nn

from lightmem.compile_blocks import block_compile
from lightmem.config import (
    DEFAULT_HOST_BUDGET,
    DEFAULT_HOST_MIN_AVAILABLE,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    OffloadSettings,
    parse_size,
    warn_once,
)
from lightmem.offload.hooks import Offloader
from lightmem.offload.scope import ModuleScope
from lightmem.offload.stats import OffloadStats
from lightmem.transfer.pool import HostPool
from lightmem.transfer.transport import Transport, default_transport

_TORCH_FUNC_REFUSES_HOOKS = "don't yet support saved tensor hooks"  # torch.func's own error
TORCH_FUNC_MESSAGE = (
    "offload_activations: torch.func.grad/vjp/jacrev/hessian (also inside vmap) cannot run while "
    "saved-tensor hooks are active, and activation offload is made of them (a torch limitation). "
    "Call the torch.func transform outside the offload context (before entering it or after leaving "
    "it); under LightMem, call it outside training_step or set LightMem(offload=False). Excluding "
    "modules does not help: the hooks stay active for the whole forward."
)


class ActivationOffloader:
    """Offload the tensors autograd saves during forward to host memory, and back for backward.

    ``offload_activations(...)`` builds one. It is a reusable context manager: enter it around
    each forward; the backward that follows may run after the ``with`` block. ``stats`` describes
    the last use (its forward and the backward after it) and resets on every entry.

    Args:
        model: the model whose parameters and buffers must never be offloaded (recognised by
            storage, so views and compiled graphs are covered) and whose module names
            ``include`` / ``exclude`` refer to. Optional without patterns.
        min_bytes: offload a saved tensor only if the storage it keeps alive is at least this big.
        devices: device types whose saved tensors move to host. ``("cpu",)`` drives the whole
            path on a CPU-only machine (useful for tests; it saves nothing there).
        include: glob patterns (or class names) of modules; when given, only tensors saved while
            one of them runs are offloaded. A dict ``{pattern: min_bytes}`` gives each module a
            threshold of its own (never below ``min_bytes``).
        exclude: glob patterns (or class names) of modules whose saved tensors stay on the device.
            The innermost matching module decides; ``exclude`` wins over ``include``.
        host_budget: hard cap on host bytes held: bytes, a size string, or a fraction of the RAM
            available when the context is built (default 0.5). Past it, tensors stay on the device,
            are counted in ``stats.budget_kept_bytes``, and one warning says so.
        prefetch: bytes of reloads kept in flight ahead of backward (0 disables prefetch).
        max_inflight_bytes: most bytes of saved tensors held on the device while their copy to
            host has not finished (default 256 MiB). Past it the compute stream waits for the
            oldest copy (counted in ``stats.inflight_waits``) and its device memory is freed; 0
            makes every copy to host synchronous with compute.
        host_min_available: never grow host buffers when it would leave less than this much RAM
            available to the machine: bytes, a size string, or a fraction of total RAM (default 0.10).
        transport: how copies run; by default CUDA side streams when CUDA is available, otherwise
            synchronous copies.
        settings: the flags above already parsed (``lightmem.config.OffloadSettings``); when
            given, the keyword flags are ignored. ``LightMem`` passes the settings it parsed.

    Raises:
        ValueError: a flag has a bad value, or a pattern matches no module (with the closest names).
        RuntimeError: the context is entered while active (also from another thread: saved-tensor
            hooks are per thread, so a forward in another thread is not offloaded), or exited out
            of order (its hooks are removed anyway); a ``torch.func`` transform ran inside it.

    Example::

        >>> import torch
        >>> from lightmem import offload_activations
        >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
        >>> with offload_activations(model, min_bytes="64KiB", devices=("cpu",)) as off:
        ...     loss = model(torch.randn(512, 256)).sum()
        >>> loss.backward()
        >>> off.stats.offloaded_tensors
        3
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        min_bytes: int | str = DEFAULT_MIN_BYTES,
        devices: Iterable[str] = ("cuda",),
        include: Iterable[str] | Mapping[str, int | str] | None = None,
        exclude: Iterable[str] | None = None,
        host_budget: int | float | str | None = DEFAULT_HOST_BUDGET,
        prefetch: int | str = DEFAULT_PREFETCH,
        max_inflight_bytes: int | str = DEFAULT_MAX_INFLIGHT,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        transport: Transport | None = None,
        settings: OffloadSettings | None = None,
    ) -> None:
        user_built = settings is None
        if settings is None:  # called by a user: parse the keyword flags here, once
            settings = OffloadSettings.parse(
                min_bytes=min_bytes, devices=devices, include=include, exclude=exclude,
                host_budget=host_budget, prefetch=prefetch, max_inflight_bytes=max_inflight_bytes,
                host_min_available=host_min_available,
            )  # fmt: skip
        flag = settings.flag
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"{flag('model')}: expected an nn.Module or None; got {type(model).__name__}")
        self.model = model
        self.settings = settings
        # A model compiled whole hands its saved tensors to the hooks only when its graph has run: it is
        # compiled one block at a time while the context is active (lightmem.compile_blocks).
        self._block_compile, self.compile_warning = block_compile(model) if model is not None else (None, None)
        self.compile_note = self._block_compile.message if self._block_compile is not None else None
        """The line saying that the model compiled whole is compiled one block at a time, or None."""
        if user_built and (self.compile_note or self.compile_warning):
            warn_once(self.compile_note or self.compile_warning)
        self.min_bytes = settings.min_bytes
        self.devices = settings.devices
        include, exclude = settings.include, settings.exclude
        self.host_budget_bytes = settings.host_budget_bytes
        self.prefetch_bytes = settings.prefetch_bytes
        self.max_inflight_bytes = settings.max_inflight_bytes
        self.host_min_available_bytes = settings.host_min_available_bytes
        self._scope: ModuleScope | None = None
        if include is not None or exclude is not None:
            if model is None:
                raise ValueError(
                    f"{flag('include')}, {flag('exclude')}: module patterns need the model; "
                    "pass it as the first argument"
                )
            self._scope = ModuleScope(
                model,
                include,
                exclude,
                include_flag=flag("include"),
                exclude_flag=flag("exclude"),
                include_min_bytes=settings.include_min_bytes,
            )
        if transport is None:
            transport = default_transport(self.devices)
        self.transport = transport
        self._pool = HostPool(
            transport,
            budget_bytes=self.host_budget_bytes,
            min_available_bytes=self.host_min_available_bytes,
        )
        self._offloader = Offloader(
            min_bytes=self.min_bytes,
            devices=self.devices,
            prefetch_bytes=self.prefetch_bytes,
            max_inflight_bytes=self.max_inflight_bytes,
            pool=self._pool,
            transport=transport,
            budget_note=f"host_budget {self.host_budget_bytes} bytes, host_min_available "
            f"{self.host_min_available_bytes} bytes",
        )
        if self._scope is not None:
            self._offloader.scope = self._scope
        self._active = False
        self._thread: int | None = None  # the thread that entered (saved-tensor hooks are per thread)
        self._entering = threading.Lock()

    @torch.compiler.disable  # entered in a compiled function: Dynamo runs the with-block's frame eagerly
    def __enter__(self) -> ActivationOffloader:
        with self._entering:
            if self._active:
                if self._thread != threading.get_ident():
                    raise RuntimeError(
                        "offload_activations: this context is already active in another thread; "
                        "saved-tensor hooks are per thread, so give each thread its own context"
                    )
                raise RuntimeError("offload_activations: this context is already active; it cannot be nested")
            self._active = True
            self._thread = threading.get_ident()
        try:
            self._push()
        except BaseException:
            self._active = False
            raise
        return self

    def _push(self) -> None:
        protected: set[int] = set()
        if self.model is not None:
            _add_state_storages(self.model, protected)
        self._pool.end_step()  # a step boundary: the pool trims to what recent steps used
        self._offloader.begin(protected)
        if self._scope is not None:
            self._scope.attach()
        if self._block_compile is not None:
            self._block_compile.attach()
        torch._C._autograd._push_saved_tensors_default_hooks(self._offloader.pack, self._offloader.unpack)

    @torch.compiler.disable
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._active:
            return
        if self._thread != threading.get_ident():
            raise RuntimeError(
                "offload_activations: exited from another thread than the one that entered it; "
                "saved-tensor hooks are per thread, so enter and exit the context in the same thread"
            )
        if (
            isinstance(exc, RuntimeError)
            and _TORCH_FUNC_REFUSES_HOOKS in str(exc)
            and not str(exc).startswith(TORCH_FUNC_MESSAGE)
        ):
            exc.args = (f"{TORCH_FUNC_MESSAGE}\n(torch said: {exc})",)  # the user sees lightmem's words
        try:
            above = self._pop_own_hooks()
        finally:
            self._active = False
            self._thread = None
            if self._scope is not None:
                self._check_scope_applied()
                self._scope.detach()
            if self._block_compile is not None:
                self._block_compile.detach()
            self._offloader.end()
        if above is None:
            message = (
                "offload_activations: its saved-tensor hooks were already removed by the exit of a "
                "context entered before it (contexts exited out of order); exit contexts in the "
                "reverse order of entering them"
            )
        elif above:
            message = (
                f"offload_activations: exited out of order: {above} saved-tensor hooks context(s) "
                "entered after it are still active. lightmem removed its own hooks and left those in "
                "place; exit contexts in the reverse order of entering them"
            )
        else:
            return
        if exc is None:
            raise RuntimeError(message)
        warn_once(message)  # do not hide the exception already on its way

    def _check_scope_applied(self) -> None:
        """Warn when tensors were saved but no module of include/exclude ran its rule: a graph that
        Dynamo compiled before the scope's hooks were attached runs those modules without them
        (Dynamo does not guard on module hooks)."""
        if self._scope.entered == 0 and self._offloader.stats.packed_tensors:
            flag = self.settings.flag
            warn_once(
                f"{flag('include')}/{flag('exclude')}: tensors were saved but no selected module ran in this "
                "forward. If the model is compiled, it was compiled and run before this offload context was "
                "first entered, so its compiled graph does not see the rules (its saved tensors follow the "
                "default): enter the context before the model's first compiled training forward, or call "
                "torch._dynamo.reset() once after building it."
            )

    def _pop_own_hooks(self) -> int | None:
        """Remove this context's hooks from the thread's hook stack, wherever they are.

        Returns how many hooks above ours were put back, or None when ours were not on the stack.
        """
        pack = self._offloader.pack
        above = []
        while True:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is None:
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
            if top[0] == pack:
                break
            above.append(top)
        for hooks in reversed(above):
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
        return None if top is None else len(above)

    @property
    def active(self) -> bool:
        return self._active

    @property
    def stats(self) -> OffloadStats:
        """Counters for the last use of this context (forward and the backward after it)."""
        return self._offloader.refresh_stats()

    @property
    def live_entries(self) -> int:
        """Offloaded storages still owned by some autograd graph (0 once all graphs are freed)."""
        return self._offloader.live_entries

    @property
    def host_bytes_held(self) -> int:
        """Bytes of host buffers held by the pool, in use or cached for the next step."""
        return self._pool.held_bytes

    @property
    def host_bytes_in_use(self) -> int:
        """Bytes of host buffers currently holding offloaded storages."""
        return self._pool.in_use_bytes

    @property
    def host_bytes_peak_in_use(self) -> int:
        """The most bytes of host buffers holding offloaded storages at once during the last use."""
        return self._pool.step_peak_in_use_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of saved storages on the device that lightmem knows of (kept or reloaded)."""
        return self._offloader.resident_bytes

    def release_host_memory(self) -> None:
        """Give cached host buffers back to the OS (buffers still in use are kept); page-locking
        under way is cancelled (a registration already in its call is waited for, then undone)."""
        self._pool.clear()

    def prepare_host(
        self, nbytes: int | str = 0, *, device: torch.device | int | str | None = None, wait: bool = False
    ) -> int:
        """Page-lock host memory for ``nbytes`` of offloaded activations ahead of need, on
        background threads, so that the first steps copy into page-locked memory.

        Without it the first step of a large offload copies into pageable memory (the CUDA
        runtime stages those copies, synchronously) and the next step boundary page-locks it.
        Call it before the first forward with the host bytes one step will hold: the planner's
        prediction, or ``stats.peak_host_bytes`` of a step already run. The pool page-locks
        ``HEADROOM`` (1.25) times that in chunks, within ``host_budget`` and
        ``host_min_available``; requests of the first forward wait for a chunk under way rather
        than take pageable memory. Memory the steps do not use goes back after
        ``TRIM_WINDOW_STEPS`` (8) steps. Without CUDA it does nothing.

        Args:
            nbytes: host bytes one step holds: bytes or a size string (``"48GiB"``); 0 asks for
                nothing more (with ``wait``: waits for what is under way).
            device: the CUDA device whose context registers the memory (default: that of the
                model's first CUDA parameter, else the current device).
            wait: return only once every chunk is page-locked (a loop that would rather wait
                here than in its first forward).

        Returns:
            The bytes queued for page-locking now: 0 without CUDA, or when the pool already
            holds or is page-locking that much, or when the budget leaves no room.

        Raises:
            ValueError: ``nbytes`` is not a size.

        Example::

            >>> import torch
            >>> from lightmem import offload_activations
            >>> model = torch.nn.Linear(8, 8)
            >>> off = offload_activations(model, devices=("cpu",))
            >>> off.prepare_host("1GiB")  # nothing to page-lock without CUDA
            0
        """
        wanted = parse_size(nbytes, flag="prepare_host(nbytes)")
        if device is not None:
            device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        elif self.model is not None:
            device = next((p.device for p in self.model.parameters() if p.device.type == "cuda"), None)
        queued = self._pool.prepare(wanted, device) if wanted else 0
        if wait:
            self._pool.wait_for_chunks()
        return queued


def _add_state_storages(module: nn.Module, protected: set[int]) -> None:
    """Add the storage pointers of every parameter and buffer of ``module`` and its submodules.

    The same tensors as ``parameters()`` and ``buffers()``, walked without their generators,
    names and identity memo (a set of pointers needs none): it runs at every enter, and on a
    4-layer GPT-2 the generators made about 1,900 Python calls per step.
    """
    for tensors in (module._parameters.values(), module._buffers.values()):
        for tensor in tensors:
            # Not None, and no subclass (FSDP2's sharded DTensors: no plain storage, never saved).
            if type(tensor) is torch.Tensor or type(tensor) is nn.Parameter:
                storage = tensor.untyped_storage()
                if storage.nbytes():  # a storage freed by resize_(0) has no pointer to protect
                    protected.add(storage.data_ptr())
    for child in module._modules.values():
        if child is not None:
            _add_state_storages(child, protected)


offload_activations = ActivationOffloader
"""The public name: ``with offload_activations(model, min_bytes="1MiB") as off: ...``."""
