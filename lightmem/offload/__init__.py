"""Activation offload: saved tensors to host memory during forward, back during backward."""

from lightmem.offload.context import ActivationOffloader, offload_activations
from lightmem.offload.stats import OffloadStats

__all__ = ["ActivationOffloader", "OffloadStats", "offload_activations"]
