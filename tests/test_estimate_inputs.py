"""The estimator on ordinary inputs: known buffer values, clear errors, a lean batch check."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightmem import estimate_memory
from lightmem.estimate import EstimateError
from lightmem.estimate.trace.batch import inspect_batch
from lightmem.estimate.trace.tracer import StorageTracer


def _sum_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def _bn_net(momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 4), nn.BatchNorm1d(4, momentum=momentum),
    )  # fmt: skip


def test_batchnorm_with_momentum_none_is_estimated_like_the_default():
    images = torch.randn(4, 3, 8, 8)
    with_none = _bn_net(None)
    with_none[1].num_batches_tracked.fill_(7)
    cumulative = estimate_memory(with_none, images, _sum_loss, device="cpu")
    default = estimate_memory(_bn_net(0.1), images, _sum_loss, device="cpu")
    # The same tensors are allocated: momentum=None only changes the averaging factor.
    assert cumulative.peak_bytes == default.peak_bytes
    assert cumulative.breakdown == default.breakdown
    # The real buffers are read, never written.
    assert with_none[1].num_batches_tracked.item() == 7
    assert with_none[8].num_batches_tracked.item() == 0
    assert with_none[1].running_mean.abs().sum().item() == 0


class NumpyInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), Stats())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Stats(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_mean = x.detach().numpy().mean()
        return x


def test_numpy_in_forward_is_an_estimate_error_naming_the_module():
    with pytest.raises(EstimateError) as caught:
        estimate_memory(NumpyInForward(), torch.randn(4, 8), _sum_loss, device="cpu")
    assert str(caught.value) == (
        "the training step calls .numpy() (or another conversion to NumPy) in body.1 (Stats); fake "
        "tensors have no values to convert. Keep NumPy out of the training step's forward for the "
        "estimate (compute with torch ops, or pass loss_fn=... that skips it)."
    )


def test_a_wrong_input_shape_names_the_module_its_class_and_the_shapes():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(10, 3)))
    with pytest.raises(EstimateError) as caught:
        estimate_memory(model, torch.randn(4, 8), _sum_loss, device="cpu")
    assert str(caught.value) == (
        "the training step fails in 2.0 (Linear) at aten.addmm with inputs of shape [3], [4, 8], "
        "[10, 3]: a and b must have same reduction dim, but got [4, 8] X [10, 3]. A real step fails "
        "there too: check the batch's shapes and dtypes against the model."
    )


def test_a_failure_outside_every_module_names_the_operation():
    def bad_loss(model, x):
        return torch.mm(model(x), torch.zeros(5, 3)).sum()

    with pytest.raises(EstimateError) as caught:
        estimate_memory(nn.Linear(8, 3), torch.randn(4, 8), bad_loss, device="cpu")
    assert str(caught.value) == (
        "the training step fails outside the model's modules at aten.mm with inputs of shape [4, 3], "
        "[5, 3]: a and b must have same reduction dim, but got [4, 3] X [5, 3]. A real step fails "
        "there too: check the batch's shapes and dtypes against the model."
    )


def test_a_value_a_module_reads_is_stood_in_for_naming_the_statement_that_reads_it():
    class Reader(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    model = nn.Sequential(nn.Linear(8, 8), Reader())
    est = estimate_memory(model, torch.randn(4, 8), _sum_loss, device="cpu")
    line = Reader.forward.__code__.co_firstlineno + 1
    assert est.stand_ins == [f"a tensor read as a bool (`if t:`, bool(t)) at test_estimate_inputs.py:{line} read as False"]


class _Allocations(TorchDispatchMode):
    """Every op torch runs: the peak of bytes its outputs hold at once (``StorageTracer``) and the
    most elements of the batch one computing op reads (what bounds the op's own scratch memory)."""

    def __init__(self, batch: torch.Tensor) -> None:
        super().__init__()
        self.batch_storage = batch.untyped_storage()
        self.largest_read = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            for arg in pytree.tree_leaves((args, kwargs)):
                if isinstance(arg, torch.Tensor) and _same_storage(arg, self.batch_storage):
                    self.largest_read = max(self.largest_read, arg.numel())
        return func(*args, **(kwargs or {}))


def _same_storage(tensor: torch.Tensor, storage) -> bool:
    return tensor.untyped_storage()._cdata == storage._cdata


def _inspect_measured(batch: torch.Tensor):
    tracer = StorageTracer()
    tracer.excluded.add(tracer.track(batch))  # views of the batch allocate nothing
    reads = _Allocations(batch)
    with tracer, reads:
        info = inspect_batch(batch)
    tracer.window.end = tracer.now()
    return info, tracer.peak().bytes, reads.largest_read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_dense_input_check_allocates_at_most_a_tenth_of_the_batch(dtype):
    indices = torch.randint(0, 2000, (512,), generator=torch.Generator().manual_seed(0))
    one_hot = F.one_hot(indices, 2000).to(dtype)
    batch_bytes = one_hot.numel() * one_hot.element_size()
    info, extra_bytes, largest_read = _inspect_measured(one_hot)
    (item,) = info.sparse_inputs
    assert item.one_hot and item.zero_fraction == 1 - 1 / 2000
    assert 0 < extra_bytes <= batch_bytes // 10, (extra_bytes, batch_bytes)
    # No op sees more than 1% of the batch, so no op's scratch memory can be a copy of it.
    assert largest_read <= one_hot.numel() // 100


def test_the_dense_input_check_reads_a_non_contiguous_batch_in_pieces_too():
    base = torch.zeros(2000, 512)
    base[torch.arange(512) % 2000, torch.arange(512)] = 1.0
    transposed = base.t()  # (512, 2000), one 1 per row, not contiguous
    batch_bytes = transposed.numel() * 4
    info, extra_bytes, largest_read = _inspect_measured(transposed)
    (item,) = info.sparse_inputs
    assert item.one_hot and item.shape == (512, 2000)
    assert 0 < extra_bytes <= batch_bytes // 10, (extra_bytes, batch_bytes)
    assert largest_read <= transposed.numel() // 100


def test_a_mostly_zero_input_that_is_not_one_hot_is_told_apart():
    x = torch.zeros(64, 1000)
    x[:, :3] = 0.5
    (item,) = inspect_batch(x).sparse_inputs
    assert not item.one_hot and item.zero_fraction == 0.997
