"""A fake of the CUDA runtime binding torch ships (``torch.cuda.cudart()``), with CUDA's last-error
rule behind it, for tests of page-locking on a machine without a GPU."""

from __future__ import annotations

from lightmem.transfer import page_lock

TORCH_CUDART_BINDINGS = (
    "cudaGetErrorString", "cudaProfilerStart", "cudaProfilerStop", "cudaHostRegister",
    "cudaHostUnregister", "cudaStreamCreate", "cudaStreamDestroy", "cudaMemGetInfo",
)  # fmt: skip
"""What ``torch.cuda.cudart()`` binds (torch/csrc/cuda/shared/cudart.cpp): no cudaGetLastError."""


class FakeCudart:
    """torch's ``_cudart`` binding, exactly: CUDA's last-error rule behind it; a call to anything
    torch does not bind is recorded in ``missing`` (and raises, as it would on a GPU)."""

    def __init__(self, register_code: int = 0, raises: bool = False, unregister_code: int = 0) -> None:
        self.register_code = register_code
        self.unregister_code = unregister_code
        self.raises = raises
        self.last_error = 0
        self.registered: dict[int, int | None] = {}  # pointer -> device current at registration
        self.unregistered: set[int] = set()
        self.missing: list[str] = []
        self.library = FakeRuntimeLibrary(self)

    def __getattr__(self, name):
        self.missing.append(name)
        raise AttributeError(f"module 'torch._C._cudart' has no attribute '{name}'")

    def cudaGetErrorString(self, code):  # noqa: N802 - CUDA's names
        return f"error {code}"

    def cudaProfilerStart(self):  # noqa: N802
        return 0

    def cudaProfilerStop(self):  # noqa: N802
        return 0

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802
        if self.raises:
            raise RuntimeError("CUDA driver error: initialization error")
        if self.register_code:
            self.last_error = self.register_code  # a failed call leaves it set, as CUDA does
            return self.register_code
        self.registered[ptr] = FakeDevice.current
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        if self.unregister_code:
            self.last_error = self.unregister_code
            return self.unregister_code
        self.unregistered.add(ptr)
        return 0

    def cudaStreamCreate(self, stream):  # noqa: N802
        return 0

    def cudaStreamDestroy(self, stream):  # noqa: N802
        return 0

    def cudaMemGetInfo(self, device):  # noqa: N802
        return 0, 0


class FakeRuntimeLibrary:
    """The CUDA runtime library torch loaded, as ctypes sees it: cudaGetLastError resets the error."""

    def __init__(self, cudart: FakeCudart) -> None:
        self._cudart = cudart

    def cudaGetLastError(self):  # noqa: N802
        error, self._cudart.last_error = self._cudart.last_error, 0
        return error


class FakeDevice:
    """``torch.cuda.device(index)``: which device is current while it is entered."""

    current: int | None = None

    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self):
        self.previous, FakeDevice.current = FakeDevice.current, self.index

    def __exit__(self, *exc):
        FakeDevice.current = self.previous


def use_fake_runtime(monkeypatch, cudart):
    monkeypatch.setattr(page_lock, "_cudart", lambda: cudart)
    monkeypatch.setattr(page_lock, "_runtime_library", lambda: cudart.library)
    monkeypatch.setattr(page_lock, "_cuda_bindings_runtime", lambda: None)



def use_simulated_runtime(monkeypatch, transport):
    """lightmem's page-locking calls reach the simulated GPU's runtime (``page_locking=True``)."""
    monkeypatch.setattr(page_lock, "_cudart", lambda: transport.runtime)
    monkeypatch.setattr(page_lock, "_runtime_library", lambda: None)
    monkeypatch.setattr(page_lock, "_cuda_bindings_runtime", lambda: None)
