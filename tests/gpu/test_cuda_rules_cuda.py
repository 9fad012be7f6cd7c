"""The hazards of issue 30 on a real GPU: skipped where CUDA is not available.

The CPU suite shows each on the simulated GPU (tests/test_optimizer_offload_cuda_rules.py,
tests/test_offload_cuda_path.py); here the copy streams are delayed with ``torch.cuda._sleep`` so a
missing wait reads a parameter before its copy back, or a gradient buffer before its copy landed.
The reference is the same model and optimizer stepping CPU copies of the parameters (the host
kernel), so the comparison is bitwise.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from gpu.race_kit import deterministic, step_on_host_copies  # noqa: F401 - deterministic is an autouse fixture  # noqa: E402
from lightmem import offload_activations, offload_optimizer  # noqa: E402
from lightmem.transfer import pool  # noqa: E402

SLEEP_CYCLES = 100_000_000  # ~50 ms: far longer than the copies it delays


class _Encoder(nn.Module):
    """MultiheadAttention reads out_proj.weight without calling out_proj; a loss scale outside it."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 8, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, 1)
        self.log_scale = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.head(self.layer(x)).mean(dim=1) * self.log_scale.exp()


def _batches(steps: int):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, 1024, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(steps)]


def _model():
    torch.manual_seed(0)
    return _Encoder().cuda()


def _reference(steps: int, between=None):
    model = _model()
    host = [p.detach().cpu().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.AdamW(host, lr=1e-3, weight_decay=0.1, fused=True)
    for step, (inputs, targets) in enumerate(_batches(steps)):
        nn.functional.mse_loss(model(inputs.cuda()), targets.cuda()).backward()
        step_on_host_copies(model, host, optimizer)
        if between is not None:
            between(model, step)
            # What the next step starts from is what the model holds now: a load_state_dict sets
            # the host copies too (lightmem's load post-hook does the same). Without this the
            # reference steps the pre-load copies and writes them over the loaded weights.
            with torch.no_grad():
                for param, master in zip(model.parameters(), host):
                    master.copy_(param)
    return model


def _offloaded(steps: int, between=None, **kwargs):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    off = offload_optimizer(model, optimizer, **kwargs)
    _, to_host, to_device = off.transport.streams(torch.device("cuda"))
    for step, (inputs, targets) in enumerate(_batches(steps)):
        with torch.cuda.stream(to_host):
            torch.cuda._sleep(SLEEP_CYCLES)  # gradient copies land late
        nn.functional.mse_loss(model(inputs.cuda()), targets.cuda()).backward()
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
        optimizer.step()
        with torch.cuda.stream(to_device):
            torch.cuda._sleep(SLEEP_CYCLES)  # ... and so do the parameter copies queued next
        optimizer.zero_grad()
        if between is not None:
            between(model, step)
    off.close()
    return model


def _assert_same(expected: nn.Module, actual: nn.Module) -> None:
    """Every entry of the state dicts bitwise equal; names all that differ (a module's own
    parameters, such as ``log_scale``, come first in a state dict)."""
    differing = [
        name for (name, a), (_, b) in zip(expected.state_dict().items(), actual.state_dict().items())
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert not differing, differing


def test_attention_parameters_and_every_gradient_are_read_after_their_copies():
    # The first gradient of backward (the head's) is over a bound of 0 alone: the host step must
    # still wait for it; MultiheadAttention's out_proj weight must be read after its copy back.
    _assert_same(_reference(3), _offloaded(3, max_grad_inflight_bytes=0))


def test_weight_averaging_and_load_state_dict_between_steps_see_the_copies():
    averaged: dict[int, torch.optim.swa_utils.AveragedModel] = {}
    torch.manual_seed(5)
    loaded = _Encoder().state_dict()

    def between(model, step):
        averaged.setdefault(id(model), torch.optim.swa_utils.AveragedModel(model)).update_parameters(model)
        if step == 1:
            model.load_state_dict(loaded)

    expected, actual = _reference(3, between), _offloaded(3, between)
    _assert_same(expected, actual)
    _assert_same(averaged[id(expected)], averaged[id(actual)])


def test_page_locked_host_memory_of_optimizer_offload_is_registered_at_its_exact_size():
    before = pool.registration_stats().pinned_bytes
    host_allocator = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else None
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    off = offload_optimizer(model, optimizer)
    nn.functional.mse_loss(model(_batches(1)[0][0].cuda()), torch.zeros(8, 1, device="cuda")).backward()
    optimizer.step()
    stats = off.stats
    assert pool.registration_stats().pinned_bytes - before == stats.host_param_bytes + stats.host_grad_bytes
    if host_allocator is not None:  # nothing went through torch's power-of-two pinned allocator
        after = torch.cuda.host_memory_stats()
        assert after.get("allocated_bytes.current", 0) == host_allocator.get("allocated_bytes.current", 0)
    off.close()
    assert pool.registration_stats().pinned_bytes == before


class _TwoStreams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-2.0, 2.0, 16 * 2**20, device="cuda"))
        self.side = torch.cuda.Stream()

    def forward(self):
        x = self.weight * 2.0
        first = x.sin()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            second = x.cos()  # the same storage, saved on another stream
        torch.cuda.current_stream().wait_stream(self.side)
        return (first + second).sum()


def test_one_storage_saved_on_two_streams_is_read_by_each_after_its_reload():
    torch.manual_seed(0)
    model = _TwoStreams()
    model().backward()
    expected = model.weight.grad.clone()
    model.weight.grad = None
    with offload_activations(model, min_bytes=0) as off:
        loss = model()
    torch.cuda.synchronize()
    loss.backward()
    torch.cuda.synchronize()
    assert off.stats.deduplicated_bytes > 0
    assert torch.equal(model.weight.grad, expected)
