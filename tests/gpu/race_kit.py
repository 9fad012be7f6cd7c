"""Tools that make a missing stream wait show as a wrong result on a real GPU.

Three ingredients, after the usual way such races are provoked:

- activations of 64 MiB, so a copy takes milliseconds rather than microseconds;
- ``torch.cuda._sleep`` queued on one stream, so it runs ~0.1 s behind the others and any work
  that is not ordered after it by an event wait overtakes it;
- freed device memory (and the host buffers of the previous step) filled with NaN, so reading a
  buffer before it was written gives NaN instead of a stale but correct copy.

``wait_kinds`` / ``drop_wait`` wrap the transport's ``record`` and ``wait`` to name each wait by
(stream that waits, stream the event was recorded on), so a negative control removes exactly one
kind of wait and must then produce a wrong result.

A delay is a time, so the host must queue the work it delays within it: the step after the
first waited for the host memory being page-locked in the background (the first step's was
pageable), and on an H100 the ~0.1 s stall on the copy stream had run out before the copies were
queued, so the control for the in-flight bound could not fail (issue 39). ``settle_host_memory``
page-locks the step's host memory before the stall, and ``offloaded_step`` checks that its
forward waited for no page-locking.

A delay alone is not always enough: on an H100 (issue 39) two controls still gave right gradients,
because another wait covered for the missing one or the freed memory was not handed out again.
``EXPOSING`` names, per kind of wait, the delay and what else makes that wait the only thing
between the step and a wrong result (``Exposure``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS across streams

from typing import Any

import pytest
import torch
from torch import nn

from lightmem import offload_activations
from lightmem.offload import hooks
from lightmem.transfer import page_lock

ROWS = WIDTH = 4096
ACTIVATION_BYTES = ROWS * WIDTH * 4  # 64 MiB of float32
SLEEP_CYCLES = 400_000_000  # ~0.2 s at 2 GHz, far longer than copying 64 MiB
ROLES = ("compute", "to_host", "to_device")



@dataclass(frozen=True)
class Exposure:
    """What makes the absence of one kind of wait give wrong gradients on a fast GPU.

    ``delay``: the stream held ~0.1 s behind (one of ``DELAYS``, see ``offloaded_step``);
    ``flags``: ``offload_activations`` flags; ``reload_in_flight``: entries whose copy to host
    still runs are reloaded instead of served from the device tensor they hold (``reloading_in_flight``);
    ``nan_after_forward``: right after the forward, every free cached block is filled with NaN on
    the compute stream while the copies to host are still held back, so a block let go before its
    copy read it holds NaN when that copy runs, whichever block the allocator gave the forward's
    next tensors.
    """

    delay: str
    flags: dict[str, Any] = field(default_factory=dict)
    reload_in_flight: bool = False
    nan_after_forward: bool = False


# Each kind of wait of the protocol (lightmem/offload/hooks.py), keyed (stream that waits, stream
# that recorded the event), and what exposes its absence.
EXPOSING = {
    # The copy to host would read an activation compute has not written yet.
    ("to_host", "compute"): Exposure("compute_in_forward"),
    # The reload would read a host buffer before its copy to host wrote it (the previous step's NaN).
    # Redundant in the protocol as it stands: a reloaded entry's copy was seen complete, or compute
    # waited for it (the in-flight bound) before the point the reload waits for, so the H100 gave
    # right gradients without it. Only entries reloaded while their copy still runs, with no compute
    # wait for any copy (a bound above the 7 x 64 MiB), leave it alone between the two.
    ("to_device", "to_host"): Exposure("copy_to_host", {"max_inflight_bytes": "1GiB"}, reload_in_flight=True),
    # Backward would read a reload buffer before its copy wrote it.
    ("compute", "to_device"): Exposure("copy_to_device"),
    # The reload copy would overwrite memory of an earlier reload that lagging compute still reads.
    ("to_device", "compute"): Exposure("compute_in_backward"),
    # Past max_inflight_bytes (7 x 64 MiB > 256 MiB) an activation is freed before its copy to host
    # read it. Waiting for the allocator to hand that block to a later activation was not enough:
    # on the H100, and on the H200 with the device cache emptied first, the freed block stayed
    # intact and the late copy read the right bytes. Writing NaN into every free block after the
    # forward (queued on compute, ordered after the bound's waits when they are kept) does not
    # depend on the allocator's choice.
    ("compute", "to_host"): Exposure("copy_to_host", nan_after_forward=True),
}
DELAYS = tuple(dict.fromkeys(exposure.delay for exposure in EXPOSING.values()))


class Mlp(nn.Module):
    """``depth`` x (Linear -> GELU) of width 4096: each saved activation is 64 MiB at 4096 rows.

    A step saves 2 * depth + 1 activations: the input, each Linear output (GELU input), each GELU
    output (the next Linear's input, or the loss's ``square`` input for the last one).
    """

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x


def make_model(device: torch.device | str, depth: int = 3) -> Mlp:
    torch.manual_seed(0)
    return Mlp(depth).to(device)


def make_input(device: torch.device | str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, generator=generator).to(device)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def loss_under(model: nn.Module, x: torch.Tensor, offloader: Any | None) -> torch.Tensor:
    """``loss_of`` with its saved tensors through ``offloader`` (None: plain autograd)."""
    with offloader if offloader is not None else contextlib.nullcontext():
        return loss_of(model, x)


def stall(stream: torch.cuda.Stream) -> None:
    """Queue ~0.1 s of sleep on ``stream``: what is queued on it next runs that much later."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)


def fill_free_memory_with_nan(device: torch.device) -> None:
    """Hand every cached free block of activation size out once, fill it with NaN, free it again."""
    reserved = torch.cuda.memory_reserved(device)
    chunks = []
    while len(chunks) < 64:
        chunks.append(torch.full((ACTIVATION_BYTES // 4,), float("nan"), device=device))
        if torch.cuda.memory_reserved(device) > reserved:  # the cache is used up: this one is new
            break
    del chunks


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def baseline_step(model: nn.Module, x: torch.Tensor, backward_passes: int = 1) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, x)
    for index in range(backward_passes):
        loss.backward(retain_graph=index + 1 < backward_passes)
    torch.cuda.synchronize(x.device)
    return grads(model)


@contextlib.contextmanager
def reloading_in_flight():
    """Inside, an entry whose copy to host still runs is reloaded from its host buffer when
    backward reaches it, instead of being served from the device tensor it holds."""
    served_view = hooks.served_view
    hooks.served_view = lambda *args: None
    try:
        yield
    finally:
        hooks.served_view = served_view


def settle_host_memory(offloader: Any) -> None:
    """Page-lock the host memory the next step will use, now (``prepare_host(wait=True)``): its
    forward then never waits for page-locking, which would let a timed stall run out."""
    offloader.prepare_host(offloader.host_bytes_peak_in_use, wait=True)


def page_lock_waits() -> int:
    """Requests so far that waited for a chunk being page-locked (``registration_stats``)."""
    return page_lock.registration_stats().chunk_waits


def offloaded_step(
    model: nn.Module, x: torch.Tensor, offloader: Any, delay: str | None = None, backward_passes: int = 1,
    nan_after_forward: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """One step through ``offloader`` with ``delay`` (one of ``DELAYS``) queued where it bites.

    A first step on a NaN input leaves NaN in the host buffers the pool hands out again.
    ``nan_after_forward``: free memory is filled with NaN right after the forward (see ``Exposure``).
    """
    device = x.device
    compute, to_host, to_device = offloader.transport.streams(device)
    with offloader:
        poisoned = loss_of(model, torch.full_like(x, float("nan")))
    poisoned.backward()
    del poisoned
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    offloader.live_entries  # let go of the saved tensors whose copies have run
    settle_host_memory(offloader)
    fill_free_memory_with_nan(device)
    torch.cuda.synchronize(device)
    waits = page_lock_waits()
    if delay == "compute_in_forward":
        stall(compute)
    elif delay == "copy_to_host":
        stall(to_host)
    with offloader:
        loss = loss_of(model, x)
    assert page_lock_waits() == waits, "the forward waited for page-locking: a stall may have run out before it"
    if nan_after_forward:
        fill_free_memory_with_nan(device)  # queued on compute behind the forward, copies still held
    if delay in ("copy_to_device", "compute_in_backward"):
        torch.cuda.synchronize(device)
        offloader.live_entries
        if delay == "compute_in_backward":
            stall(compute)
            fill_free_memory_with_nan(device)  # runs after the stall: a reload must wait for it
        else:
            fill_free_memory_with_nan(device)
            torch.cuda.synchronize(device)
            stall(to_device)
    for index in range(backward_passes):
        loss.backward(retain_graph=index + 1 < backward_passes)
    torch.cuda.synchronize(device)
    return grads(model)


def exposed_step(model: nn.Module, x: torch.Tensor, offloader: Any, exposure: Exposure) -> dict[str, torch.Tensor]:
    """``offloaded_step`` under ``exposure`` (its flags are the offloader's: see ``exposed_offloader``)."""
    with reloading_in_flight() if exposure.reload_in_flight else contextlib.nullcontext():
        return offloaded_step(model, x, offloader, exposure.delay, nan_after_forward=exposure.nan_after_forward)


def exposed_offloader(model: nn.Module, exposure: Exposure) -> Any:
    return offload_activations(model, **exposure.flags)


def _tag_waits(transport: Any, device: torch.device, on_wait: Any) -> None:
    """Route the transport's waits through ``on_wait(kind, stream, event, original_wait)``."""
    streams = dict(zip(ROLES, transport.streams(device)))
    recorded: dict[int, tuple[str, Any]] = {}  # holds each event, so its id is not reused
    original_record, original_wait = transport.record, transport.wait

    def role(stream: Any) -> str:
        return next(name for name, known in streams.items() if known == stream)

    def record(stream: Any) -> Any:
        event = original_record(stream)
        recorded[id(event)] = (role(stream), event)
        return event

    def wait(stream: Any, event: Any) -> None:
        after = recorded[id(event)][0] if event is not None else None
        on_wait((role(stream), after), stream, event, original_wait)

    transport.record = record
    transport.wait = wait


def wait_kinds(transport: Any, device: torch.device) -> set[tuple[str, str]]:
    """Collect the kinds of cross-stream wait the transport is asked for (same-stream ones are no-ops)."""
    kinds: set[tuple[str, str]] = set()

    def on_wait(kind, stream, event, original_wait):
        if kind[1] is not None and kind[0] != kind[1]:
            kinds.add(kind)
        original_wait(stream, event)

    _tag_waits(transport, device, on_wait)
    return kinds


def drop_wait(transport: Any, device: torch.device, kind: tuple[str, str]) -> list[tuple[str, str]]:
    """Remove every wait of ``kind``; the returned list grows by one per wait removed."""
    dropped: list[tuple[str, str]] = []

    def on_wait(seen, stream, event, original_wait):
        if seen == kind:
            dropped.append(seen)
            return
        original_wait(stream, event)

    _tag_waits(transport, device, on_wait)
    return dropped


def differs(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(expected[name], actual[name]) for name in expected)


def step_on_host_copies(
    model: nn.Module, host: list[torch.Tensor], optimizer: torch.optim.Optimizer, clip: bool = True
) -> None:
    """The reference for optimizer offload on a GPU: the gradients to ``host`` (CPU copies of the
    parameters that ``optimizer`` steps), clipping by norm 1.0, the step, the parameters copied back."""
    for param, copy in zip(model.parameters(), host):
        copy.grad = param.grad.cpu()
        param.grad = None
    if clip:
        torch.nn.utils.clip_grad_norm_(host, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for param, copy in zip(model.parameters(), host):
            param.copy_(copy)


@pytest.fixture(autouse=True)
def deterministic():
    """Deterministic kernels for a test module that imports this fixture (bitwise comparisons)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
