"""Offload around each training forward, as a trainer drives it: enter before the forward, leave
before backward, pause while the machine is short of RAM."""

from __future__ import annotations

import psutil

from lightmem.config import format_bytes, warn_once
from lightmem.offload.context import ActivationOffloader
from lightmem.offload.stats import OffloadStats


class TrainingOffload:
    """Wraps one ``ActivationOffloader`` for a training loop.

    ``enter()`` before each training forward; ``exit()`` once the forward is over (before backward,
    or wherever a batch may end). While the machine's available RAM is under the offloader's
    ``host_min_available``, ``enter()`` offloads nothing, gives cached host buffers back and warns
    once, instead of letting the host OOM killer end the job.
    """

    def __init__(self, offloader: ActivationOffloader) -> None:
        self.offloader = offloader
        self.paused = False

    def enter(self) -> None:
        floor = self.offloader.host_min_available_bytes
        if psutil.virtual_memory().available < floor:
            if not self.paused:
                warn_once(
                    f"lightmem: available host memory fell under host_min_available ({format_bytes(floor)}); "
                    "offload is paused and cached host buffers were released so the host OOM killer does "
                    "not end the job."
                )
            self.paused = True
            self.offloader.release_host_memory()
            return
        self.paused = False
        self.exit()
        self.offloader.__enter__()

    def exit(self, exception: BaseException | None = None) -> None:
        """Leave the hooks if they are active; ``exception`` is what ended the forward, if anything."""
        if self.offloader.active:
            error_type = type(exception) if exception is not None else None
            self.offloader.__exit__(error_type, exception, exception.__traceback__ if exception else None)

    @property
    def stats(self) -> OffloadStats | None:
        """The traffic of the last batch; None when offload was paused for it."""
        return None if self.paused else self.offloader.stats

    def close(self) -> None:
        """Leave the hooks and give every cached host buffer back."""
        try:
            self.exit()
        finally:
            self.offloader.release_host_memory()
