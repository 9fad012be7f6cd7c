"""Parameters back on the device after the host step, and the waits that protect them.

After each step the updated host copies are queued to the device on the host-to-device stream,
after compute's last use of the device parameters. Two rules keep every read and write in order
(docs/gpu-path.md says why a compute-stream wait never protects a host read):

- whatever reads a parameter next on a compute stream (the next forward, a parent module reading
  a child's weight, a parametrization, ``load_state_dict``) runs after the copies:
  ``wait_for_params`` makes that stream wait for them, on the device (the host runs on), once per
  stream and step;
- nothing on the host rewrites a host copy a queued copy may still read: ``host_wait`` before the
  next step, a landing or a write into the host copies.
"""

from __future__ import annotations

from typing import Any

import torch

from lightmem.model_state.device_dtype import DeviceDtype
from lightmem.model_state.host_copies import Slot, Written
from lightmem.model_state.stats import OptimizerOffloadStats
from lightmem.transfer.transport import Transport


class ParamsBack:
    """The copies of the stepped host copies to their device parameters, and the waits after them."""

    def __init__(
        self,
        transport: Transport,
        device: torch.device,
        device_dtype: DeviceDtype | None,
        stats: OptimizerOffloadStats,
    ) -> None:
        self.transport = transport
        self.device = device
        self._device_dtype = device_dtype
        self._stats = stats
        self.copies_back: Any = None
        """The event of the last copies of the parameters to the device, until the host saw them run."""
        self._ordered_streams: list[Any] = []  # compute streams ordered after those copies

    def send(self, stepped: list[Slot]) -> None:
        """Queue the copies of ``stepped``'s host copies to their device parameters; the current
        compute stream waits for them."""
        transport = self.transport
        with torch.no_grad():
            if transport.synchronous:
                for slot in stepped:
                    transport.copy_to_device(slot.param.detach(), self._copy_source(slot), None)
            elif stepped:
                compute, _, to_device = transport.streams(self.device)
                # The device parameters are rewritten only after compute's last use of them (backward).
                transport.wait(to_device, transport.record(compute))
                for slot in stepped:
                    transport.copy_to_device(slot.param.detach(), self._copy_source(slot), to_device)
                self.copies_back = transport.record(to_device)
                self._ordered_streams = []
                # Whatever reads a parameter next on this stream (the next forward, a parent module
                # reading a child's weight, a parametrization, weight averaging, load_state_dict)
                # runs after the copies: a wait on the device, so the host runs on.
                self.wait_for_params()
        for slot in stepped:  # the copy bumped the version as it was queued
            if slot.seen is None:
                slot.seen = Written(slot.param)
            else:
                slot.seen.after_own_write(slot.param)
        moved = sum(slot.param.nbytes for slot in stepped)
        self._stats.param_bytes_in = moved
        self._stats.total_param_bytes_in += moved

    def _copy_source(self, slot: Slot) -> torch.Tensor:
        """What travels to ``slot``'s device parameter: its host copy, or with ``device_dtype`` that
        copy rounded into its page-locked bf16 tensor, rewritten only once the host saw the copies
        of the last step complete (the step waited before it ran; waited again here, a no-op then)."""
        if self._device_dtype is None:
            return slot.master.detach()
        self.host_wait()
        return self._device_dtype.rounded(slot)

    def wait_for_params(self) -> None:
        """Make the device parameters current for work queued from now on on the current compute
        stream: it waits (on the device, the host does not) for the copies of the last step."""
        if self.copies_back is None or self.transport.synchronous:
            return
        compute, _, _ = self.transport.streams(self.device)
        if any(stream == compute for stream in self._ordered_streams):
            return
        self.transport.wait(compute, self.copies_back)
        self._ordered_streams.append(compute)

    def host_wait(self) -> None:
        """Block the host until the copies of the last step have run: the host copies they read may
        be rewritten, and no compute stream has anything left to wait for."""
        if self.copies_back is not None:
            self.transport.host_wait(self.copies_back)
            self.copies_back = None
            self._ordered_streams = []
