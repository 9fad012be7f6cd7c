"""Clipping and accumulation with the host step overlapped with backward: by value each gradient is
clamped and stepped as it lands; by norm each gradient's norm is taken as it lands and every
parameter is stepped the moment backward ends, before ``optimizer.step()``; accumulating backward
passes (``handle.accumulating()`` in a plain loop, Lightning's own outside the step's closure) step
nothing. The whole training state stays bitwise that of torch's clipping and the same host kernel
after backward, in a plain loop and under Lightning."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from exact import assert_same
from optimizer_models import (
    HOST_KERNEL,
    OPTIMIZERS,
    FailsInBackward,
    LitSharedReentrant,
    LitTiny,
    SharedUnderReentrantCheckpoint,
    SmallGPT,
    assert_given_back,
    assert_no_hazards_then_close,
    assert_same_fit,
    fit_tiny,
    offloading_optimizer,
    regression_batches,
    small_gpt_loss,
    tiny_net,
)
from torch import nn

import lightmem.model_state.grad_clip as grad_clip
import lightmem.model_state.overlap as overlap_module
from lightmem import offload_optimizer
from lightmem.model_state.landing import GradientLanding
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"
)

CLIPS = {"norm": ("clip_grad_norm", 0.05), "value": ("clip_grad_value", 0.01)}


def _clip_by_torch(optimizer, algorithm):
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if algorithm == "norm":
        return torch.nn.utils.clip_grad_norm_(params, CLIPS["norm"][1]).clone()
    torch.nn.utils.clip_grad_value_(params, CLIPS["value"][1])
    return None


def _train(optimizer_name, algorithm, offload=None, accumulate=1, steps=4, transport=None):
    """A plain loop with ``accumulate`` backward passes per step and StepLR. Without ``offload``
    the reference: torch's clipping, the optimizer constructed with the kernel lightmem runs on the
    host. Returns the model, optimizer, handle and the global norm of each step (by norm)."""
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters(), **({} if offload else HOST_KERNEL))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    handle = None
    if offload is not None:
        flag, value = CLIPS[algorithm]
        handle = offload_optimizer(
            model, optimizer, devices=("cpu",), transport=transport, overlap_step=offload == "overlap", **{flag: value}
        )
    torch.manual_seed(2)  # dropout
    norms = []
    batches = regression_batches(steps * accumulate)
    for index, (inputs, targets) in enumerate(batches):
        boundary = (index + 1) % accumulate == 0
        with handle.accumulating() if handle is not None and not boundary else contextlib.nullcontext():
            nn.functional.mse_loss(model(inputs), targets).backward()
        if not boundary:
            continue
        norm = _clip_by_torch(optimizer, algorithm) if handle is None else None
        optimizer.step()
        if algorithm == "norm":
            norms.append(norm if handle is None else handle.grad_norm.clone())
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, handle, norms


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("offload", ["overlap", "after-backward"])
def test_a_plain_loop_clipping_in_the_offloader_is_bitwise_torchs_clipping(optimizer, algorithm, accumulate, offload):
    model_a, opt_a, _, norms_a = _train(optimizer, algorithm, accumulate=accumulate)
    model_b, opt_b, handle, norms_b = _train(optimizer, algorithm, offload, accumulate=accumulate)
    assert handle.stats.overlapped_steps == (4 if offload == "overlap" else 0)
    if algorithm == "norm":
        assert max(norms_a) > CLIPS["norm"][1]  # the clipping scaled the gradients
        assert_same(norms_a, norms_b, "global norms")
    handle.wait_for_params()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_on_the_simulated_gpu_with_held_copies(algorithm):
    transport = SimulatedAsyncTransport(seed=5, max_delay_s=0.001)
    model_a, opt_a, _, norms_a = _train("adamw-decay", algorithm, accumulate=2)
    model_b, opt_b, handle, norms_b = _train("adamw-decay", algorithm, "overlap", accumulate=2, transport=transport)
    assert_same(norms_a, norms_b, "global norms")
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_no_hazards_then_close(transport)


class _Mixed(nn.Module):
    """fp32 and bf16 layers, a layer used only by the accumulating backward, one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.narrow = nn.Linear(16, 16).to(torch.bfloat16)
        self.last = nn.Linear(16, 16)
        self.side = nn.Linear(8, 16)
        self.unused = nn.Linear(3, 3)

    def forward(self, x, side=False):
        hidden = self.last(self.narrow(torch.relu(self.first(x)).to(torch.bfloat16)).float())
        return (hidden + self.side(x) if side else hidden).sum(-1)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_mixed_dtypes_groups_in_reverse_and_a_gradient_only_from_the_accumulating_backward(algorithm):
    """torch groups norms by dtype and device; ``side`` gets its gradient only from the backward
    inside ``accumulating()``, so the overlapped step never sees it land and must still clip it."""
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = _Mixed()
        params = list(model.parameters())
        groups = [{"params": params[4:][::-1]}, {"params": params[:4][::-1], "lr": 0.02}]
        optimizer = torch.optim.Adam(groups, lr=0.01, foreach=False)
        flag, value = CLIPS[algorithm]
        handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True, **{flag: value}) if offload else None
        generator = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(3):
            inputs = torch.randn(4, 8, generator=generator)
            with handle.accumulating() if offload else contextlib.nullcontext():
                (model(inputs, side=True) ** 2).mean().backward()
            (model(inputs * 2) ** 2).mean().backward()
            norm = None if offload else _clip_by_torch(optimizer, algorithm)
            optimizer.step()
            norms.append(handle.grad_norm.clone() if offload and algorithm == "norm" else norm)
            optimizer.zero_grad()
        if offload:
            assert handle.stats.overlapped_steps == 3
            handle.close()
        runs.append((model.state_dict(), optimizer.state_dict(), norms))
    assert_same(*runs, "training state and global norms")


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last, self.side = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(8, 1)

    def forward(self, x):
        return self.last(torch.relu(self.first(x)))


def _after_a_backward_that_raised(offload, accumulating, slow_landing=None):
    """``side``'s gradient lands from a backward that then raises; then (``accumulating``) a whole
    backward and the step, or (not) the step at once. Returns the state and the global norm."""
    torch.manual_seed(0)
    model = _TwoLayers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **({} if offload else HOST_KERNEL))
    handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True, clip_grad_norm=0.05) if offload else None
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
    failing = torch.randn(4, 8, generator=generator).requires_grad_()
    with handle.accumulating() if offload and accumulating else contextlib.nullcontext():
        with pytest.raises(FloatingPointError):
            (model.side(FailsInBackward.apply(failing)) ** 2).sum().backward()
    if accumulating:
        nn.functional.mse_loss(model(inputs), targets).backward()
    norm = None if offload else _clip_by_torch(optimizer, "norm")
    optimizer.step()
    if offload:
        norm = handle.grad_norm.clone()
        handle.close()
    return model.state_dict(), optimizer.state_dict()["state"], norm


@pytest.mark.parametrize("accumulating", [True, False], ids=["then-a-whole-backward", "then-the-step"])
def test_by_norm_after_a_backward_that_raised_the_step_clips_every_gradient(accumulating, monkeypatch):
    """The gradients of a backward that raised land only at the next backward or step: the norm
    counts them (the landing is slowed so the worker would win a race), and a step with no
    whole backward before it still clips."""
    landing = GradientLanding.land_all

    def slow_land_all(self):
        if self._landing:
            time.sleep(0.05)
        landing(self)

    expected = _after_a_backward_that_raised(False, accumulating)
    monkeypatch.setattr(GradientLanding, "land_all", slow_land_all)
    actual = _after_a_backward_that_raised(True, accumulating)
    assert_same(expected, actual, "training state and global norm")


def test_by_norm_a_parameter_shared_across_reentrant_segments_adds_as_without_the_overlap():
    # Its hook fires once per nested backward: by norm nothing was stepped yet, so the second
    # gradient adds to the first and the norms start over, instead of raising.
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = SharedUnderReentrantCheckpoint()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **({} if offload else HOST_KERNEL))
        handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True, clip_grad_norm=0.05) if offload else None
        norms = []
        for inputs, targets in regression_batches(3):
            nn.functional.mse_loss(model(inputs), targets).backward()
            norm = None if offload else _clip_by_torch(optimizer, "norm")
            optimizer.step()
            norms.append(handle.grad_norm.clone() if offload else norm)
            optimizer.zero_grad()
        if offload:
            handle.close()
        runs.append((model.state_dict(), optimizer.state_dict()["state"], norms))
    assert_same(*runs, "training state and global norms")


def test_by_norm_an_error_in_the_step_at_the_end_of_backward_is_raised_by_zero_grad(monkeypatch):
    def fails(self, subsets):
        raise MemoryError("no host memory for the step")

    model, optimizer, handle = _tiny(overlap_step=True, clip_grad_norm=0.05)
    monkeypatch.setattr(overlap_module.OverlappedStep, "_step_subsets", fails)
    _backward(model)
    with pytest.raises(RuntimeError, match=r"the host step overlapped with backward failed: MemoryError\('no host memory"):
        optimizer.zero_grad()
    monkeypatch.undo()
    optimizer.zero_grad()
    _backward(model)
    optimizer.step()  # the loop goes on
    handle.close()


# -- the order of events on the simulated GPU ---------------------------------------------------


def _gpt_after_each_step(loss_of, algorithm, steps):
    """Without lightmem: ``[k]`` holds every parameter of ``SmallGPT`` after ``k`` steps of fused
    AdamW with torch's clipping."""
    torch.manual_seed(0)
    model = SmallGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
    values = [[param.detach().clone() for param in model.parameters()]]
    for _ in range(steps):
        loss_of(model).backward()
        _clip_by_torch(optimizer, algorithm)
        optimizer.step()
        optimizer.zero_grad()
        values.append([param.detach().clone() for param in model.parameters()])
    return values


def _gpt_on_simulated_gpu(algorithm):
    """SmallGPT offloaded with the overlap on a simulated GPU whose copies to host run only when the
    host waits for them and whose compute lags; a hook before backward's last node (the embedding's)."""
    transport = SimulatedAsyncTransport(seed=1, max_delay_s=0.0)
    transport.hold_copies_to_host()
    transport.lag_compute()
    torch.manual_seed(0)
    model = SmallGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    flag, value = CLIPS[algorithm]
    handle = offload_optimizer(
        model, optimizer, devices=("cpu",), transport=transport, overlap_step=True, **{flag: value}
    )  # fmt: skip
    return model, optimizer, handle, transport


def _at_the_last_node(model, run):
    def on_embedding_output(module, args, out):
        out.grad_fn.register_prehook(lambda grad_outputs: run())

    model.embedding.register_forward_hook(on_embedding_output)


def test_by_value_all_but_the_first_layer_are_clamped_and_stepped_before_backward_reaches_it():
    loss_of = small_gpt_loss()
    expected = _gpt_after_each_step(loss_of, "value", steps=2)
    model, optimizer, handle, transport = _gpt_on_simulated_gpu("value")
    host_copies = optimizer.param_groups[0]["params"]  # the embedding's weight first
    seen = []

    def look():
        handle.wait_for_host_step()
        seen.append([host.detach().clone() for host in host_copies])

    _at_the_last_node(model, look)
    for step in range(2):
        loss_of(model).backward()
        (at_last_node,) = seen
        seen.clear()
        assert torch.equal(at_last_node[0], expected[step][0])  # the embedding: its gradient is not final yet
        for index in range(1, len(at_last_node)):
            assert torch.equal(at_last_node[index], expected[step + 1][index]), f"parameter {index}"
        optimizer.step()
        optimizer.zero_grad()
    handle.close()
    assert all(torch.equal(param, value) for param, value in zip(model.parameters(), expected[2]))
    assert_no_hazards_then_close(transport)


def test_by_norm_norms_are_taken_as_gradients_land_and_the_step_starts_when_backward_ends(monkeypatch):
    """Before backward's last node every other gradient's norm is taken and nothing is stepped;
    once ``backward()`` has returned, the step of every parameter runs without ``optimizer.step()``."""
    loss_of = small_gpt_loss()
    expected = _gpt_after_each_step(loss_of, "norm", steps=2)
    model, optimizer, handle, transport = _gpt_on_simulated_gpu("norm")
    host_copies = optimizer.param_groups[0]["params"]
    normed: list[int] = []  # id of each gradient whose norm was taken, in the order taken
    norms_of = grad_clip.GradClip.norms

    def norms_spy(self, grads):
        normed.extend(map(id, grads))
        return norms_of(self, grads)

    monkeypatch.setattr(grad_clip.GradClip, "norms", norms_spy)
    seen = []

    def look():
        handle.wait_for_host_step()
        seen.append(([host.detach().clone() for host in host_copies], [id(host.grad) for host in host_copies], list(normed)))

    _at_the_last_node(model, look)
    for step in range(2):
        normed.clear()
        loss_of(model).backward()
        (values, grads, normed_before) = seen.pop()
        assert grads[0] not in normed_before and grads[0] == id(None)  # the embedding's gradient: not yet
        assert sorted(normed_before) == sorted(grads[1:])  # every other norm: taken during backward
        assert all(torch.equal(value, before) for value, before in zip(values, expected[step]))  # nothing stepped
        handle.wait_for_host_step()  # no optimizer.step(): the step already runs
        assert all(torch.equal(host, value) for host, value in zip(host_copies, expected[step + 1]))
        optimizer.step()  # takes the step done: steps nothing more
        optimizer.zero_grad()
    assert handle.stats.overlapped_steps == 2
    handle.close()
    assert all(torch.equal(param, value) for param, value in zip(model.parameters(), expected[2]))
    assert_no_hazards_then_close(transport)


# -- what breaks the contract, and bad flags ----------------------------------------------------


def _tiny(**flags):
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer, offload_optimizer(model, optimizer, devices=("cpu",), **flags)


def _backward(model):
    inputs, targets = regression_batches(1)[0]
    nn.functional.mse_loss(model(inputs), targets).backward()


def test_clipping_again_by_hand_with_clip_grad_norm_set_is_raised_at_the_step():
    model, optimizer, handle = _tiny(overlap_step=True, clip_grad_norm=1e-3)
    _backward(model)
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1e-3)
    with pytest.raises(RuntimeError, match=r"since then the gradients of 6 parameters \(clipped, unscaled"):
        optimizer.step()
    optimizer.zero_grad()
    handle.close()


def test_accumulating_after_a_backward_that_steps_is_raised():
    model, optimizer, handle = _tiny(overlap_step=True)
    _backward(model)
    with pytest.raises(RuntimeError, match=r"accumulating\(\) came after a backward whose gradients were being stepped"):
        with handle.accumulating():
            pass
    handle.close()


def test_accumulating_without_overlap_changes_nothing():
    runs = []
    for inside in (False, True):
        model, optimizer, handle = _tiny()
        torch.manual_seed(2)  # dropout
        with handle.accumulating() if inside else contextlib.nullcontext():
            _backward(model)
        _backward(model)
        optimizer.step()
        handle.close()
        runs.append(model.state_dict())
    assert_same(*runs, "state_dict")


def test_by_norm_a_backward_that_raises_steps_nothing_and_the_loop_goes_on():
    runs = []
    for fails in (False, True):
        torch.manual_seed(0)
        first, last = nn.Linear(8, 16), nn.Linear(16, 1)
        model = nn.Sequential(first, last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True, clip_grad_norm=1e-3)
        inputs, targets = regression_batches(1)[0]
        if fails:
            with pytest.raises(FloatingPointError):
                nn.functional.mse_loss(last(FailsInBackward.apply(first(inputs))), targets).backward()
            optimizer.zero_grad()  # the last layer's gradient landed, and nothing was stepped: no error
        _backward(model)
        optimizer.step()
        optimizer.zero_grad()
        handle.close()
        runs.append((model.state_dict(), optimizer.state_dict()))
    assert_same(*runs, "training state")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"clip_grad_norm": 1.0, "clip_grad_value": 1.0},
            "offload_optimizer(clip_grad_norm=...) and offload_optimizer(clip_grad_value=...): choose one way to "
            "clip; got both",
        ),
        (
            {"clip_grad_norm": 0},
            "offload_optimizer(clip_grad_norm=...): expected a positive finite number (the largest norm or "
            "value); got 0",
        ),
        (
            {"clip_grad_value": float("inf")},
            "offload_optimizer(clip_grad_value=...): expected a positive finite number (the largest norm or "
            "value); got inf",
        ),
        (
            {"clip_grad_norm": "1"},
            "offload_optimizer(clip_grad_norm=...): expected a positive finite number (the largest norm or "
            "value); got '1'",
        ),
    ],
)
def test_bad_clipping_flags_fail_at_construction(flags, message):
    model = tiny_net()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError) as error:
        offload_optimizer(model, optimizer, devices=("cpu",), **flags)
    assert str(error.value) == message


# -- under Lightning: gradient_clip_val applied as gradients land ---------------------------------


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam", "adamw-decay"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_fit_with_clipping_and_accumulation_overlaps_bitwise(optimizer, algorithm, optimizer_offload_transport, caplog):
    clip_val = CLIPS[algorithm][1]
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm, optimizer=optimizer)
    expected = fit_tiny(None, **settings)
    callback = offloading_optimizer()
    with caplog.at_level("INFO"):
        actual = fit_tiny(callback, **settings)
    assert f"; host step overlapped with backward, clipping by {algorithm} {clip_val:g} as gradients land)." in caplog.text
    (stats,) = callback.optimizer_offload_stats
    assert (stats.steps, stats.overlapped_steps) == (4, 3)  # the first step watches, after backward
    assert_same_fit(expected, actual)


def test_either_lightning_package_clips_in_the_overlapped_step(lightning_package):
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    expected = fit_tiny(None, lightning_package, **settings)
    callback = offloading_optimizer()
    actual = fit_tiny(callback, lightning_package, **settings)
    assert callback.optimizer_offload_stats[0].overlapped_steps == 3
    assert_same_fit(expected, actual)


class _ChangesClipping(LitTiny):
    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 2:
            self.trainer.gradient_clip_val = 0.5


def test_clipping_changed_mid_fit_is_raised_at_lightnings_clipping():
    with pytest.raises(RuntimeError) as error:
        fit_tiny(offloading_optimizer(), module_class=_ChangesClipping, gradient_clip_val=0.05)
    assert str(error.value) == (
        "LightMem(offload_overlap_step=...): 6 parameters were stepped on the host as their gradients landed "
        "with clipping by norm 0.05 (the Trainer's gradient_clip_val and gradient_clip_algorithm at fit start), "
        "and this step asks for clipping by norm 0.5: they keep the step taken. Keep the clipping of a fit "
        "fixed, or turn offload_overlap_step off"
    )


def test_a_precision_plugin_that_clips_its_own_way_keeps_the_step_after_backward(caplog):
    from pytorch_lightning.plugins.precision import Precision

    class OwnClipping(Precision):
        def clip_grad_by_norm(self, optimizer, clip_val):
            super().clip_grad_by_norm(optimizer, clip_val)

    settings = dict(gradient_clip_val=0.05, plugins=[OwnClipping()])
    expected = fit_tiny(None, **settings)
    callback = offloading_optimizer()
    with caplog.at_level("INFO"):
        actual = fit_tiny(callback, **settings)
    assert "; host step after backward: precision plugin OwnClipping has its own clip_grad_by_norm)." in caplog.text
    assert callback.optimizer_offload_stats[0].overlapped_steps == 0
    assert_same_fit(expected, actual)


def test_a_fit_whose_first_step_turns_the_overlap_off_clips_once(caplog):
    # Reentrant checkpointing turns the overlap off after the first step: Lightning clips from then
    # on, and nothing else does.
    settings = dict(gradient_clip_val=0.05, module_class=LitSharedReentrant)
    expected = fit_tiny(None, **settings)
    clip_calls = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def counted(*args, **kwargs):
        clip_calls.append(1)
        return clip_grad_norm(*args, **kwargs)

    callback = offloading_optimizer()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", counted)
        actual = fit_tiny(callback, **settings)
    assert (callback.optimizer_offload_stats[0].overlapped_steps, len(clip_calls)) == (0, 4)
    assert_same_fit(expected, actual)


def test_a_precision_plugin_with_its_own_clipping_keeps_the_step_after_backward_without_gradient_clip_val(caplog):
    from pytorch_lightning.plugins.precision import Precision

    class AlwaysClips(Precision):
        def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 0.05)

    expected = fit_tiny(None, plugins=[AlwaysClips()])
    callback = offloading_optimizer()
    with caplog.at_level("INFO"):
        actual = fit_tiny(callback, plugins=[AlwaysClips()])
    assert "; host step after backward: precision plugin AlwaysClips has its own clip_gradients)." in caplog.text
    assert_same_fit(expected, actual)


def test_norms_taken_in_any_batches_give_clip_grad_norms_bits():
    # 50 random sets of 12 gradients (fp32 and fp64 mixed), their norms taken in random batches as
    # if landing: the total and the scaled gradients are bitwise clip_grad_norm_'s.
    clip = grad_clip.GradClip("norm", 0.7)
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        expected, actual = [], []
        for _ in range(12):
            shape = tuple(torch.randint(1, 40, (int(torch.randint(1, 3, (), generator=generator)),), generator=generator).tolist())
            dtype = torch.float64 if torch.rand((), generator=generator) < 0.2 else torch.float32
            param = nn.Parameter(torch.randn(shape, dtype=dtype, generator=generator))
            param.grad = torch.randn(shape, dtype=dtype, generator=generator) * 10
            twin = nn.Parameter(param.detach().clone())
            twin.grad = param.grad.clone()
            expected.append(param)
            actual.append(twin)
        total_expected = torch.nn.utils.clip_grad_norm_(expected, 0.7)
        norms: dict = {}
        order = torch.randperm(12, generator=generator).tolist()
        for start in range(0, 12, 5):
            norms.update(clip.norms([actual[index].grad for index in order[start : start + 5]]))
        total = clip.total([param.grad for param in actual], norms)
        clip.scale(actual, total)
        assert_same(total_expected, total, "global norm")
        assert_same([p.grad for p in expected], [p.grad for p in actual], "clipped gradients")
