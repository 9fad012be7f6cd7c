"""Tools for lightmem's own tests and benchmarks; users do not need them to train.

- ``simulated.py``: ``SimulatedAsyncTransport``, an asynchronous CPU transport that keeps CUDA's
  stream rules (the only GPU the CPU test suite has); ``streams.py``: its parts (streams, events,
  copies, caching allocators, the runtime's page-locking calls).
- ``cuda_tensor.py``: tensors that report ``cuda:0`` and raise CUDA's same-device error
  (``simulated_cuda()``, ``SimulatedCudaFit`` for a Lightning fit on them).
- ``device.py``: a simulated training device of a given capacity, for ``plan="auto"``.
- ``measure.py``: the measuring harness benchmarks and accuracy tests use.
"""
