"""``lightmem.linear_cross_entropy``: the loss and every gradient of ``F.cross_entropy(F.linear(hidden,
weight, bias).float(), target, ...)``, computed chunk by chunk, never holding more than a chunk of logits.

Tolerances (each gradient's largest difference over its largest value, the loss's difference over
the loss): float32 1e-6 for the loss and 2e-6 for the gradients (float32 rounding: the chunks sum
the weight's and bias's gradients in another order); bf16 2**-7 for the loss and 2**-6 for the
gradients (two bf16 steps at the largest value: each chunk's product is rounded to bf16 before the
float32 sum of the five chunks, where the reference rounds the full sum once); fp16 2**-9 and 2**-8
(the same, at fp16's step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import lightmem
from lightmem.loss import default_chunk_rows

ROWS, FEATURES, CLASSES, CHUNK = 37, 16, 50, 8  # 37 rows: the last chunk of 8 holds 5
TOLERANCE = {
    torch.float32: (1e-6, 2e-6),
    torch.bfloat16: (2**-7, 2**-6),
    torch.float16: (2**-9, 2**-8),
}
"""(loss, gradients): largest difference over the largest reference value."""


def _inputs(dtype: torch.dtype = torch.float32, bias: bool = True, ignored: int = -100, seed: int = 1):
    """Every fifth target is ``ignored``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, FEATURES, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(CLASSES, FEATURES, generator=generator) * 0.3).to(dtype).requires_grad_()
    head_bias = torch.randn(CLASSES, generator=generator).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    target[::5] = ignored
    return hidden, weight, head_bias, target


def _reference(hidden, weight, target, bias=None, class_weight=None, chunk_rows=None, softcap=None, **options):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:  # Gemma-2's final_logit_softcapping, as the model writes it
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), target, weight=class_weight, **options)


def _chunked(hidden, weight, target, bias=None, **options):
    return lightmem.linear_cross_entropy(hidden, weight, target, bias=bias, **options)


def _run(loss_fn, inputs, autocast=None, **options):
    """The loss and the gradients of hidden, weight and bias (a "none" loss is summed with row
    weights first, so that every row's gradient has its own scale)."""
    hidden, weight, bias, target = (t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs)
    context = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with context:
        loss = loss_fn(hidden, weight, target, bias=bias, **options)
    scalar = loss if loss.dim() == 0 else (loss * torch.linspace(0.5, 2.0, loss.numel()).reshape(loss.shape)).sum()
    scalar.backward()
    return loss.detach(), [t.grad for t in (hidden, weight, bias) if t is not None]


def _assert_close(expected, actual, dtype):
    loss_tolerance, grad_tolerance = TOLERANCE[dtype]
    (loss, grads), (got_loss, got_grads) = expected, actual
    assert got_loss.dtype == loss.dtype == torch.float32 and got_loss.shape == loss.shape
    assert (got_loss - loss).abs().max() <= loss_tolerance * loss.abs().max()
    assert len(grads) == len(got_grads)
    for reference, got in zip(grads, got_grads):
        assert got.dtype == reference.dtype and got.shape == reference.shape
        assert (got - reference).abs().max() <= grad_tolerance * reference.abs().max()


OPTIONS = {
    "plain": {},
    "ignore_index": {"ignore_index": 3},
    "label_smoothing": {"label_smoothing": 0.1},
    "class_weight": {"class_weight": torch.linspace(0.5, 1.5, CLASSES)},
    "all": {"label_smoothing": 0.2, "class_weight": torch.linspace(0.5, 1.5, CLASSES), "ignore_index": 7},
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_float32_loss_and_gradients_match_the_unchunked_loss(reduction, options):
    kwargs = {"reduction": reduction, **OPTIONS[options]}
    inputs = _inputs(ignored=kwargs.get("ignore_index", -100))
    expected = _run(_reference, inputs, **kwargs)
    _assert_close(expected, _run(_chunked, inputs, chunk_rows=CHUNK, **kwargs), torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_loss_and_gradients_match_the_unchunked_loss(dtype, reduction, options):
    # float32 inputs under autocast: the products in ``dtype``, the loss in float32, the
    # gradients of the float32 leaves in float32, as autocast's F.linear gives them.
    kwargs = {"reduction": reduction, **OPTIONS[options]}
    inputs = _inputs(ignored=kwargs.get("ignore_index", -100))
    expected = _run(_reference, inputs, autocast=dtype, **kwargs)
    _assert_close(expected, _run(_chunked, inputs, autocast=dtype, chunk_rows=CHUNK, **kwargs), dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soft_cap_is_applied_to_each_chunk_as_the_model_applies_it_to_the_logits(dtype, reduction):
    # A weight scaled so that the cap bites (logits up to about 60, capped at 5): the loss with the
    # cap is far from the loss without it, and the chunked loss is the capped one.
    hidden, weight, bias, target = _inputs()
    inputs = (hidden, (weight * 20).detach().requires_grad_(), bias, target)
    autocast = None if dtype == torch.float32 else dtype
    expected = _run(_reference, inputs, autocast=autocast, reduction=reduction, softcap=5.0)
    uncapped = _run(_reference, inputs, autocast=autocast, reduction=reduction)
    assert (uncapped[0] - expected[0]).abs().max() > 0.5 * expected[0].abs().max()
    _assert_close(expected, _run(_chunked, inputs, autocast=autocast, chunk_rows=CHUNK, reduction=reduction, softcap=5.0), dtype)


class _ProductDtypes(TorchDispatchMode):
    """The dtypes of every matrix product's output."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.dtypes.add(out.dtype)
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_every_product_runs_in_autocasts_dtype(dtype, reduction):
    with _ProductDtypes() as seen:
        _run(_chunked, _inputs(), autocast=dtype, chunk_rows=CHUNK, reduction=reduction)
    assert seen.dtypes == {dtype}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_give_half_precision_gradients_as_the_reference(dtype):
    # "bf16-true" / "16-true": the weights themselves in half precision, no autocast.
    inputs = _inputs(dtype)
    expected = _run(_reference, inputs)
    actual = _run(_chunked, inputs, chunk_rows=CHUNK)
    assert [grad.dtype for grad in actual[1]] == [dtype] * 3
    _assert_close(expected, actual, dtype)


def test_without_a_bias_only_hidden_and_weight_get_gradients():
    inputs = _inputs(bias=False)
    expected = _run(_reference, inputs)
    actual = _run(_chunked, inputs, chunk_rows=CHUNK)
    assert len(actual[1]) == 2
    _assert_close(expected, actual, torch.float32)


@pytest.mark.parametrize("chunk_rows", [1, ROWS, 1000])
def test_one_row_one_chunk_or_more_rows_than_there_are(chunk_rows):
    inputs = _inputs()
    expected = _run(_reference, inputs)
    _assert_close(expected, _run(_chunked, inputs, chunk_rows=chunk_rows), torch.float32)


def test_hidden_states_of_any_leading_shape_with_targets_of_that_shape_or_flattened():
    hidden, weight, bias, target = _inputs()
    batched = (hidden[:36].reshape(4, 9, FEATURES), weight, bias, target[:36].reshape(4, 9))
    flat = (hidden[:36], weight, bias, target[:36])
    loss, grads = _run(_chunked, batched, chunk_rows=CHUNK, reduction="none")
    flat_loss, flat_grads = _run(_chunked, flat, chunk_rows=CHUNK, reduction="none")
    assert loss.shape == (4, 9) and grads[0].shape == (4, 9, FEATURES)
    assert torch.equal(loss.flatten(), flat_loss) and torch.equal(grads[0].flatten(0, 1), flat_grads[0])
    assert torch.equal(grads[1], flat_grads[1]) and torch.equal(grads[2], flat_grads[2])
    # Targets flattened (as F.cross_entropy takes them beside flattened logits) give the same.
    flattened = (batched[0], weight, bias, target[:36])
    assert torch.equal(_run(_chunked, flattened, chunk_rows=CHUNK, reduction="none")[0], flat_loss)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_gives_the_references_loss_and_zero_gradients(reduction):
    hidden, weight, bias, target = _inputs()
    inputs = (hidden, weight, bias, torch.full_like(target, -100))
    expected = _run(_reference, inputs, reduction=reduction)
    actual = _run(_chunked, inputs, chunk_rows=CHUNK, reduction=reduction)
    # The mean over no targets is 0 / 0, as the reference's.
    assert torch.allclose(actual[0], expected[0], rtol=0, atol=0, equal_nan=True)
    assert actual[0].isnan().all() == (reduction == "mean")
    for reference, got in zip(expected[1], actual[1]):
        assert torch.equal(got, torch.zeros_like(got)) and torch.equal(reference, torch.zeros_like(reference))


def test_without_gradients_only_the_loss_is_computed():
    hidden, weight, bias, target = _inputs()
    with torch.no_grad():
        loss = lightmem.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_rows=CHUNK)
        expected = _reference(hidden, weight, target, bias)
    assert loss.grad_fn is None
    assert (loss - expected).abs() <= 1e-6 * expected.abs()


def test_a_second_backward_through_one_loss_says_why_it_cannot():
    hidden, weight, bias, target = _inputs()
    loss = lightmem.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_rows=CHUNK)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as raised:
        loss.backward()
    assert str(raised.value) == (
        "linear_cross_entropy: backward ran twice through one loss (retain_graph=True): its gradients were computed "
        "in forward and the first backward used them up. Compute the loss again instead."
    )


class _LargestLogits(TorchDispatchMode):
    """The most rows of any tensor whose last dimension is the class count, seen as an op output."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes, self.rows = classes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[-1] == self.classes:
                self.rows = max(self.rows, tensor.shape[0])
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_more_than_one_chunk_of_logits_exists_in_forward_or_backward(reduction):
    hidden, weight, bias, target = _inputs()
    with _LargestLogits(CLASSES) as chunked:
        loss = lightmem.linear_cross_entropy(hidden, weight, target, bias=bias, chunk_rows=CHUNK, reduction=reduction)
        loss.sum().backward()
    with _LargestLogits(CLASSES) as unchunked:
        _reference(hidden, weight, target, bias, reduction=reduction).sum().backward()
    assert (chunked.rows, unchunked.rows) == (CHUNK, ROWS)


def test_compiled_model_with_the_chunked_loss_gives_the_eager_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh(), torch.nn.Linear(FEATURES, CLASSES))
    hidden, _, _, target = _inputs()

    def step(body):
        model.zero_grad()
        loss = lightmem.linear_cross_entropy(body(hidden.detach()), model[2].weight, target, bias=model[2].bias, chunk_rows=CHUNK)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = step(model[:2])
    compiled = step(torch.compile(model[:2], backend="aot_eager"))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_default_chunk_rows():
    # The GPT of benchmarks/plans_hold.py at batch 55 (56,320 rows of 1024 features, 32,000
    # classes): 2048 rows, 250 MiB of float32 logits, where the whole would be 6.7 GiB.
    assert default_chunk_rows(56_320, 1024, 32_000) == 2048
    # Half the hidden states' float32 size when that is more: 1,048,576 rows of 4096 features.
    assert default_chunk_rows(1 << 20, 4096, 32_000) == 65_536
    # Few rows: at least 256 MiB of float32 logits per chunk (2048 rows of 32,000), at most every row.
    assert default_chunk_rows(4096, 64, 32_000) == 2048
    assert default_chunk_rows(10, 64, 32_000) == 10
    assert default_chunk_rows(0, 64, 32_000) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reduction": "avg"}, "linear_cross_entropy(reduction=...): expected one of 'mean', 'sum', 'none'; got 'avg'"),
        ({"label_smoothing": 1.5}, "linear_cross_entropy(label_smoothing=...): expected a number in [0, 1]; got 1.5"),
        ({"chunk_rows": 0}, "linear_cross_entropy(chunk_rows=...): expected an integer >= 1 or None; got 0"),
        ({"softcap": 0.0}, "linear_cross_entropy(softcap=...): expected a positive number or None; got 0.0"),
        ({"ignore_index": None}, "linear_cross_entropy(ignore_index=...): expected an int; got None"),
        ({"target": torch.zeros(ROWS)}, "linear_cross_entropy(target=...): expected class indices (an integer tensor); got torch.float32"),
        ({"target": torch.zeros(ROWS, 2, dtype=torch.long)}, "linear_cross_entropy(target=...): expected one class index per row of hidden, [37] (hidden's shape without its last dimension, or flattened); got [37, 2]"),
        ({"bias": torch.zeros(3)}, "linear_cross_entropy(bias=...): expected shape (50,); got [3]"),
        ({"class_weight": torch.zeros(3)}, "linear_cross_entropy(class_weight=...): expected shape (50,); got [3]"),
        ({"weight": torch.zeros(CLASSES, 3)}, "linear_cross_entropy: hidden's last dimension must be weight's in_features (3); got hidden of shape [37, 16]"),
        ({"weight": torch.zeros(CLASSES, FEATURES, dtype=torch.float64)}, "linear_cross_entropy: hidden (torch.float32), weight (torch.float64) and bias (torch.float32) must have one dtype, as for F.linear (or run under autocast)"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(change, message):
    hidden, weight, bias, target = _inputs()
    arguments = {"hidden": hidden, "weight": weight, "target": target, "bias": bias} | change
    with pytest.raises(ValueError) as raised:
        lightmem.linear_cross_entropy(**arguments)
    assert str(raised.value) == message
