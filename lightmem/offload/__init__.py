"""Activation offload: saved tensors to host memory during forward, back during backward.

``offload_activations`` (``LightMem(offload=True)`` under Lightning) owns, one job per module:

- ``context.py``: ``offload_activations`` and ``ActivationOffloader``, the context manager.
- ``hooks.py``: pack and unpack of every saved tensor (lifetimes follow the autograd graph).
- ``policy.py``: which saved tensors move (one decision, run by the estimator too).
- ``protocol.py``: entries, handles and the prefetch walk, shared with the estimator.
- ``scope.py``: which module's forward runs, and from what size its saved tensors may move;
  ``stats.py``: ``OffloadStats``.
- ``training.py``: offload around each training forward, as a trainer drives it.

Copies, page-locked host buffers and the in-flight bound come from ``lightmem.transfer``, the layer
model-state offload (``lightmem.model_state``) uses too; the two offloads never import each other.
"""

from lightmem.offload.context import ActivationOffloader, offload_activations
from lightmem.offload.stats import OffloadStats

__all__ = ["ActivationOffloader", "OffloadStats", "offload_activations"]
