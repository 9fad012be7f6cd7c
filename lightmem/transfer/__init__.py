"""Moving tensors between the device and host memory: the layer both offloads stand on.

Activation offload (``lightmem.offload``) and model-state offload (``lightmem.model_state``) copy
tensors to the host and back the same way; what they share lives here, and imports nothing of
either:

- ``transport.py``: how a copy runs (CUDA side streams and events, or synchronous copies) and the
  waits that order it: the ``Transport`` protocol, ``CudaTransport``, ``SyncTransport``.
- ``page_lock.py``: page-locking host memory (``cudaHostRegister`` at exact size) on background
  threads, and what it cost.
- ``pool.py``: host buffers carved from a few large slabs, bounded by recent steps
  (``HostPool``), and the slab itself (``HostSlab``).
- ``arena.py``: host tensors carved from one page-locked allocation of their exact size
  (``HostArena``: model-state offload's host copies and gradient buffers).
- ``inflight.py``: device tensors held until their copy to host has run, bounded in bytes.
"""
