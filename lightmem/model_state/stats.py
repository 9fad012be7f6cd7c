"""What model-state offload held and moved: ``OptimizerOffloadStats``, the handle's ``stats``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimizerOffloadStats:
    """What model-state offload held and moved. Byte counts of host memory are current values;
    ``grad_bytes_out``, ``param_bytes_in`` and ``waited_s`` cover the last optimizer step (and the
    backward passes accumulated into it); ``steps`` and the ``total_`` figures the whole run."""

    host_param_bytes: int = 0
    """Host copies of the parameters the optimizer steps (with ``device_dtype``: the fp32 masters
    and their bf16 copies that travel to the device)."""
    host_grad_bytes: int = 0
    """Host gradient buffers (accumulators and accumulation staging; with ``device_dtype``: the
    bf16 buffers the gradients land in and the masters' fp32 gradients)."""
    host_state_bytes: int = 0
    """Optimizer state (momentum, Adam moments, step counters) on the host."""
    grad_bytes_out: int = 0
    param_bytes_in: int = 0
    waited_s: float = 0.0
    """Time the training thread or compute stream waited for gradient and parameter copies."""
    peak_device_grad_bytes: int = 0
    """The most gradient bytes held on the device waiting for their copy to host (whole run)."""
    steps: int = 0
    total_grad_bytes_out: int = 0
    total_param_bytes_in: int = 0
    overlapped_bytes: int = 0
    """With ``overlap_step``: bytes of the parameters whose host step was over when the last
    backward ended (hidden behind backward); 0 without it."""
    overlapped_steps: int = 0
    """Optimizer steps (whole run) that took parameters stepped while backward ran."""
    host_kernel: str = ""
    """The implementation running the host step: "fused", "foreach", "for-loop" or "custom"."""
    grad_norm: float | None = None
    """The global 2-norm of the gradients the last step took (accumulated, before clipping),
    bitwise ``torch.nn.utils.get_total_norm``, where it was taken for that step (``clip_grad_norm``;
    under Lightning, a step whose metrics are read); None otherwise."""

    @property
    def host_bytes(self) -> int:
        """All host bytes model-state offload holds."""
        return self.host_param_bytes + self.host_grad_bytes + self.host_state_bytes
