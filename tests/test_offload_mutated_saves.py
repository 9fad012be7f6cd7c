"""A tensor an op saves and then writes (rrelu's noise) comes back with the values the op wrote.

Autograd packs an op's inputs before its kernel runs. An op with a mutable argument that it also
saves (schema ``Tensor(b!) noise``) writes that argument after the pack; plain autograd keeps a
reference and reads the written values in backward, so the offloader must copy after the op.
"""

from __future__ import annotations

import copy
import sys
import types
import unittest
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightmem import offload_activations
from lightmem.testing.simulated import SimulatedAsyncTransport


def _rrelu_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 512), nn.RReLU(0.1, 0.9), nn.Linear(512, 1024), nn.RReLU(), nn.BatchNorm1d(1024),
        nn.Linear(1024, 8),
    )  # fmt: skip


def _train(model: nn.Module, context=None, steps: int = 3) -> tuple[dict, dict, torch.Tensor]:
    """Train a copy in train mode; return its state_dict, optimizer state and the RNG state after."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(steps, 512, 512, generator=torch.Generator().manual_seed(1))  # 1 MiB inputs
    torch.manual_seed(2)
    for step in range(steps):
        if context is None:
            loss = model(data[step]).square().mean()
        else:
            with context(model):
                loss = model(data[step]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict(), optimizer.state_dict(), torch.get_rng_state()


def _assert_same_training_state(expected, actual) -> None:
    (state, optim, rng), (state_o, optim_o, rng_o) = expected, actual
    assert state.keys() == state_o.keys()
    for name in state:
        assert torch.equal(state[name], state_o[name]), f"{name} differs"
    for index, slots in optim["state"].items():
        for slot, value in slots.items():
            assert torch.equal(value, optim_o["state"][index][slot]), f"optimizer {index}.{slot} differs"
    assert torch.equal(rng, rng_o)


@pytest.mark.parametrize("min_bytes", [0, "1MiB"], ids=["min_bytes=0", "default-1MiB"])
@pytest.mark.parametrize("transport", ["sync", "simulated"])
def test_rrelu_in_train_mode_trains_bitwise_equal(min_bytes, transport):
    model = _rrelu_model()
    expected = _train(model)
    sim = SimulatedAsyncTransport(seed=3, max_delay_s=0.001) if transport == "simulated" else None
    contexts = []

    def offload(m):
        contexts.append(offload_activations(m, min_bytes=min_bytes, devices=("cpu",), transport=sim))
        return contexts[-1]

    actual = _train(model, offload)
    _assert_same_training_state(expected, actual)
    # RReLU's noise (one per sample and feature: 1 MiB for the first, 2 MiB for the second) moved
    assert contexts[-1].stats.offloaded_bytes >= 512 * 1024 * 4 + 512 * 512 * 4
    if sim is not None:
        assert sim.stale_reads == 0
        sim.close()


# -- every op whose autograd formula saves one of its mutable arguments -------------------------


def _import_op_db():
    try:
        import expecttest  # noqa: F401  (PyTorch's test utilities import it at module level)
    except ImportError:
        # Only its TestCase base class is used by the module that defines op_db; the samples do
        # not depend on it.
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


class _MutatedArguments(TorchDispatchMode):
    """Records the storages an op writes through a mutable argument other than ``self``/``out``."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()
        self._written: dict = {}  # op overload -> indices of its mutable arguments (schema, cached)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = self._written.get(func)
        if written is None:
            written = self._written[func] = tuple(
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write and not a.is_out and a.name != "self"
            )
        for index, name in written:
            value = args[index] if index < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                self.storages.add(value.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _samples(opinfo):
    """The op's float64 CPU samples, from its sample function. (``OpInfo.sample_inputs`` wraps that
    function in a tracker that walks the Python stack twice per call: a minute over the whole op_db
    once the test session has imported many modules.)"""
    torch.manual_seed(0)
    return iter(opinfo.sample_inputs_func(opinfo, "cpu", torch.float64, True))


def _saves_a_mutated_argument(opinfo, sample) -> bool:
    packed: set[int] = set()

    def pack(tensor):
        if tensor.untyped_storage().nbytes():
            packed.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _MutatedArguments() as mode:
        opinfo.op(sample.input, *sample.args, **sample.kwargs)
    return bool(packed & mode.storages)


def _ops_that_save_a_mutated_argument() -> list:
    found = []
    for opinfo in _import_op_db():
        if not opinfo.supports_autograd or torch.float64 not in opinfo.supported_dtypes("cpu"):
            continue
        try:
            sample = next(_samples(opinfo))
            if _saves_a_mutated_argument(opinfo, sample):
                found.append(opinfo)
        except Exception:  # samples this build cannot run (missing backends, etc.): not our class
            continue
    return found


def _input_grads(opinfo, sample, offload: bool) -> list[torch.Tensor]:
    sample = sample.transform(lambda t: t.detach().clone().requires_grad_(t.requires_grad))
    inputs = [t for t in (sample.input, *sample.args) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.manual_seed(0)
    if offload:
        with offload_activations(None, devices=("cpu",), min_bytes=0):
            out = opinfo.op(sample.input, *sample.args, **sample.kwargs)
    else:
        out = opinfo.op(sample.input, *sample.args, **sample.kwargs)
    outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t.requires_grad]
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outputs)
    return list(torch.autograd.grad(loss, inputs, allow_unused=True))


def test_every_op_that_saves_a_mutated_argument_gives_bitwise_equal_gradients():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = _ops_that_save_a_mutated_argument()
        assert "nn.functional.rrelu" in {op.name for op in ops}  # the walk finds the class
        checked = 0
        for opinfo in ops:
            for sample in _samples(opinfo):
                expected = _input_grads(opinfo, sample, offload=False)
                actual = _input_grads(opinfo, sample, offload=True)
                for e, a in zip(expected, actual):
                    assert (e is None and a is None) or torch.equal(e, a), f"{opinfo.name}: {sample}"
                checked += 1
    assert checked > len(ops)


def test_sabotage_copying_at_pack_time_is_detected(monkeypatch):
    """Without waiting for the saving op to return, RReLU's noise is copied before it is written."""
    from lightmem.offload import hooks

    counter = iter(range(1 << 62))
    monkeypatch.setattr(hooks, "_sequence_nr", lambda: next(counter))  # every pack looks like a new op
    model = _rrelu_model()
    expected = _train(model, steps=1)
    actual = _train(model, lambda m: offload_activations(m, min_bytes=0, devices=("cpu",)), steps=1)
    assert not torch.equal(expected[0]["0.weight"], actual[0]["0.weight"])
