"""``offload_activations``: the context manager users put around a forward pass."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from torch import nn

from lightmem.config import (
    available_ram_bytes,
    parse_devices,
    parse_patterns,
    parse_size,
    total_ram_bytes,
    warn_once,
)
from lightmem.offload.hooks import Offloader
from lightmem.offload.pool import HostPool
from lightmem.offload.scope import ModuleScope
from lightmem.offload.stats import OffloadStats
from lightmem.offload.transport import CudaTransport, SyncTransport, Transport

DEFAULT_MIN_BYTES = "1MiB"
DEFAULT_HOST_BUDGET = 0.5
DEFAULT_PREFETCH = "256MiB"
DEFAULT_HOST_MIN_AVAILABLE = 0.10


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
            one of them runs are offloaded.
        exclude: glob patterns (or class names) of modules whose saved tensors stay on the device.
            The innermost matching module decides; ``exclude`` wins over ``include``.
        host_budget: hard cap on host bytes held: bytes, a size string, or a fraction of the RAM
            available when the context is built (default 0.5). Past it, tensors stay on the device,
            are counted in ``stats.budget_kept_bytes``, and one warning says so.
        prefetch: bytes of reloads kept in flight ahead of backward (0 disables prefetch).
        host_min_available: never grow host buffers when it would leave less than this much RAM
            available to the machine: bytes, a size string, or a fraction of total RAM (default 0.10).
        transport: how copies run; by default CUDA side streams when CUDA is available, otherwise
            synchronous copies.

    Raises:
        ValueError: a flag has a bad value, or a pattern matches no module (with the closest names).

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
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        host_budget: int | float | str | None = DEFAULT_HOST_BUDGET,
        prefetch: int | str = DEFAULT_PREFETCH,
        host_min_available: int | float | str = DEFAULT_HOST_MIN_AVAILABLE,
        transport: Transport | None = None,
        flag_names: dict[str, str] | None = None,
    ) -> None:
        names = flag_names or {}

        def flag(name: str) -> str:
            return names.get(name, f"offload_activations({name}=...)")

        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"{flag('model')}: expected an nn.Module or None; got {type(model).__name__}")
        self.model = model
        self.min_bytes = parse_size(min_bytes, flag=flag("min_bytes"))
        self.devices = parse_devices(devices, flag=flag("devices"))
        include = parse_patterns(include, flag=flag("include"))
        exclude = parse_patterns(exclude, flag=flag("exclude"))
        if host_budget is None:
            host_budget = DEFAULT_HOST_BUDGET
        self.host_budget_bytes = parse_size(
            host_budget, flag=flag("host_budget"), fraction_of=available_ram_bytes
        )
        self.prefetch_bytes = parse_size(prefetch, flag=flag("prefetch"))
        self.host_min_available_bytes = parse_size(
            host_min_available,
            flag=flag("host_min_available"),
            fraction_of=total_ram_bytes,
            fraction_name="total RAM",
        )
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
            )
        if transport is None:
            transport = _default_transport(self.devices)
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
            pool=self._pool,
            transport=transport,
            budget_note=f"host_budget {self.host_budget_bytes} bytes, host_min_available "
            f"{self.host_min_available_bytes} bytes",
        )
        if self._scope is not None:
            self._offloader.scope = self._scope
        self._active = False

    def __enter__(self) -> ActivationOffloader:
        if self._active:
            raise RuntimeError("offload_activations: this context is already active; it cannot be nested")
        protected: set[int] = set()
        if self.model is not None:
            for tensor in self.model.parameters():
                protected.add(tensor.untyped_storage().data_ptr())
            for tensor in self.model.buffers():
                protected.add(tensor.untyped_storage().data_ptr())
        self._pool.end_step()  # a step boundary: the pool trims to what recent steps used
        self._offloader.begin(protected)
        if self._scope is not None:
            self._scope.attach()
        torch._C._autograd._push_saved_tensors_default_hooks(self._offloader.pack, self._offloader.unpack)
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._active:
            return
        self._active = False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            if top is None or top[0] != self._offloader.pack:
                raise RuntimeError(
                    "offload_activations: other saved-tensor hooks were entered inside this context "
                    "and are still active; exit them first (saved-tensor hooks are a stack)"
                )
            torch._C._autograd._pop_saved_tensors_default_hooks()
        finally:
            if self._scope is not None:
                self._scope.detach()
            self._offloader.end()

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
        """Give cached host buffers back to the OS (buffers still in use are kept)."""
        self._pool.clear()


def _default_transport(devices: tuple[str, ...]) -> Transport:
    if "cuda" in devices:
        if torch.cuda.is_available():
            return CudaTransport()
        if devices == ("cuda",):
            warn_once(
                "lightmem: CUDA is not available, so offload_activations(devices=('cuda',)) has "
                "nothing to offload; saved tensors stay where they are"
            )
    return SyncTransport()


offload_activations = ActivationOffloader
"""The public name (DESIGN.md): ``with offload_activations(model, min_bytes="1MiB") as off: ...``."""
