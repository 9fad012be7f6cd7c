"""Model-state offload: gradients, optimizer state and the optimizer's step on the host.

``offload_optimizer(model, optimizer)`` (``LightMem(offload_optimizer=True)`` under Lightning)
keeps the parameters on the device and everything else a step holds for them in host memory.
Copies run through ``lightmem.transfer``, the layer activation offload uses too.
"""

from lightmem.model_state.host_grads import named_grads
from lightmem.model_state.offloader import OptimizerOffloader, OptimizerOffloadStats, offload_optimizer

__all__ = ["OptimizerOffloadStats", "OptimizerOffloader", "named_grads", "offload_optimizer"]
