"""lightmem: train PyTorch Lightning models that do not fit in GPU memory, and see where every byte goes."""

from lightmem.auto_plan import PlanDoesNotFit
from lightmem.callback import LightMem
from lightmem.causal_lm import chunked_causal_lm_loss
from lightmem.devices import DeviceSpeeds, measure_device_speeds
from lightmem.checkpoint import apply_checkpointing
from lightmem.estimate import estimate_memory, frontier, max_batch_size, max_sequence_length, plan
from lightmem.loss import linear_cross_entropy
from lightmem.model_state.host_grads import named_grads
from lightmem.model_state.offloader import offload_optimizer
from lightmem.offload import offload_activations
from lightmem.tiling import apply_tiling

__all__ = [
    "DeviceSpeeds",
    "LightMem",
    "PlanDoesNotFit",
    "apply_checkpointing",
    "apply_tiling",
    "chunked_causal_lm_loss",
    "estimate_memory",
    "frontier",
    "linear_cross_entropy",
    "max_batch_size",
    "max_sequence_length",
    "measure_device_speeds",
    "named_grads",
    "offload_activations",
    "offload_optimizer",
    "plan",
]
__version__ = "0.1.0"
