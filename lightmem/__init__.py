"""lightmem: train PyTorch Lightning models that do not fit in GPU memory, and see where every byte goes."""

from lightmem.checkpoint import apply_checkpointing
from lightmem.offload import offload_activations

__all__ = ["apply_checkpointing", "offload_activations"]
__version__ = "0.1.0"
