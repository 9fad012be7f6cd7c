"""Model-state offload: gradients, optimizer state and the optimizer's step on the host.

``offload_optimizer(model, optimizer)`` (``LightMem(offload_optimizer=True)`` under Lightning)
keeps the parameters on the device and puts everything else a step holds for them in host memory.
It owns, one job per module:

- ``offloader.py``: ``offload_optimizer`` and ``OptimizerOffloader``, the lifecycle: refuse what
  cannot be served (``refusals.py``), build the parts below, wire them into the user's model and
  optimizer, point the optimizer at the host copies and give everything back at ``close()``.
- ``host_copies.py``: each offloaded parameter's host copy and gradient buffers, and the host
  arenas they are carved from.
- ``landing.py``: gradients out during backward, landed where the step reads them.
- ``step.py``: the optimizer's step on the host, between torch's step hooks.
- ``params_back.py``: parameters back on the device, and the waits that protect every read.
- ``user_changes.py``: device parameters the user wrote, param groups added or assigned.
- ``overlap_control.py`` and ``overlap.py``: the host step overlapped with backward (when, its
  contract; the worker thread).
- ``host_kernel.py`` (the fastest CPU step), ``grad_clip.py`` (clipping, the gradient norm),
  ``device_dtype.py`` (bf16 on the device, fp32 masters), ``host_grads.py`` (``named_grads``),
  ``stats.py`` (``OptimizerOffloadStats``).
- ``trainer_optimizers.py``: Lightning's optimizer plumbing (every optimizer of a Trainer, its
  strategy, clipping, fine-tuning callbacks, restored state).

Copies run through ``lightmem.transfer``, the layer activation offload (``lightmem.offload``) uses
too; the two offloads never import each other.
"""

from lightmem.model_state.host_grads import named_grads
from lightmem.model_state.offloader import OptimizerOffloader, OptimizerOffloadStats, offload_optimizer

__all__ = ["OptimizerOffloadStats", "OptimizerOffloader", "named_grads", "offload_optimizer"]
