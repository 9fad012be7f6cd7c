from __future__ import annotations

import copy
import gc
import importlib
import os
import sys
import threading
from contextlib import nullcontext

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _page_locking_ends_with_its_test(monkeypatch):
    """Host memory a test page-locked through a fake or simulated runtime is given back through
    that runtime, before the test's monkeypatches are undone (this fixture needs ``monkeypatch``,
    so it is torn down first): pools the test dropped are collected, and the background threads
    page-locking chunks (lightmem.transfer.page_lock) have ended."""
    yield
    from lightmem.transfer import page_lock

    threads = [thread for thread in threading.enumerate() if thread.name.startswith(page_lock.THREAD_NAME)]
    if threads or page_lock.registration_stats().pinned_bytes:
        gc.collect()
        for thread in threads:
            thread.join(timeout=30)


@pytest.fixture(autouse=True)
def _allocator_settings_end_with_their_test():
    """The allocator settings a test sets, or a benchmark's ``main()`` it calls
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, as plan="auto" sets them), end with it:
    the estimator reads them, so a later test in the same process would plan for expandable
    segments it never asked for (``test_optimizer_offload_estimate`` found 175 images where 151 fit)."""
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    before = {name: os.environ.get(name) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run_grads(model, loss_fn, context=None, autocast: bool = False, seed: int = 1234, before_backward=None):
    """One forward (inside ``context(model_copy)``) and backward on a deep copy of ``model``;
    ``before_backward()``, when given, runs between the two.

    Returns the gradients by parameter name and the context used.
    """
    model = copy.deepcopy(model)
    ctx = context(model) if context is not None else nullcontext()
    torch.manual_seed(seed)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    with amp:
        with ctx:
            loss = loss_fn(model)
    if before_backward is not None:
        before_backward()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, ctx


def assert_bitwise_equal(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert expected[name].dtype == actual[name].dtype, name
        assert torch.equal(expected[name], actual[name]), f"gradient of {name} differs"


@pytest.fixture
def cpu_offload():
    """Factory for an offload context that drives the full path on CPU tensors."""
    from lightmem import offload_activations

    def make(model=None, **kwargs):
        kwargs.setdefault("devices", ("cpu",))
        kwargs.setdefault("min_bytes", 0)
        return offload_activations(model, **kwargs)

    return make


@pytest.fixture(params=["pytorch_lightning", "lightning.pytorch"])
def lightning_package(request):
    """Each Lightning package in turn: ``pytorch_lightning``, and ``lightning.pytorch`` (``import lightning as L``)."""
    return importlib.import_module(request.param)


@pytest.fixture(params=["sync", "simulated"])
def optimizer_offload_transport(request, monkeypatch):
    """Optimizer offload in a Lightning fit on each transport in turn: synchronous copies, and the
    simulated GPU (which must see no stale read, reuse hazard, unordered free or host race)."""
    if request.param == "sync":
        yield None
        return
    import lightmem.model_state.offloader as optimizer_offload
    from lightmem.testing.simulated import SimulatedAsyncTransport

    simulated = SimulatedAsyncTransport(seed=1, max_delay_s=0.001)
    monkeypatch.setattr(optimizer_offload, "default_transport", lambda devices: simulated)
    yield simulated
    hazards = (simulated.stale_reads, simulated.reuse_hazards, simulated.unordered_source_frees, simulated.host_races)
    simulated.close()
    assert hazards == (0, 0, 0, 0)
