"""Which kernel steps on the host: torch's fused CPU kernel when the optimizer left foreach/fused
unset and one exists (Adam, AdamW, SGD, Adagrad), bitwise the same optimizer constructed with
``fused=True`` stepping without lightmem; the user's explicit choice otherwise; the for-loop where
no fused kernel exists. In a plain loop and under both Lightning packages."""

from __future__ import annotations

import copy

import pytest
import torch
from exact import assert_same, assert_state_equal
from lit_models import cpu_trainer
from optimizer_models import (
    HOST_KERNEL,
    OPTIMIZERS,
    assert_given_back,
    lit_tiny_class,
    regression_batches,
    regression_loader,
    tiny_net,
)
from torch import nn

from lightmem import LightMem, offload_optimizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _train(make_optimizer, offload: bool, clip: str = "norm", steps: int = 4, accumulate: int = 2):
    """Accumulation, clipping (by norm or value) over the optimizer's params, StepLR."""
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    handle = offload_optimizer(model, optimizer, devices=("cpu",)) if offload else None
    batches = iter(regression_batches(steps * accumulate))
    torch.manual_seed(2)  # dropout
    for _ in range(steps):
        for _ in range(accumulate):
            inputs, targets = next(batches)
            (nn.functional.mse_loss(model(inputs), targets) / accumulate).backward()
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        else:
            torch.nn.utils.clip_grad_value_(params, 0.01)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, handle


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("name", ["adamw-decay", "adam", "sgd-momentum", "adagrad"])
def test_an_optimizer_that_left_the_kernel_unset_steps_bitwise_like_its_fused_kernel(name, clip):
    model_a, opt_a, _ = _train(
        lambda params: OPTIMIZERS[name](params, **HOST_KERNEL), offload=False, clip=clip
    )
    model_b, opt_b, handle = _train(OPTIMIZERS[name], offload=True, clip=clip)
    assert (handle.host_kernel.name, handle.stats.host_kernel) == ("fused", "fused")
    assert opt_b.param_groups[0]["fused"] is True  # while offloaded the groups say what runs ...
    assert_given_back(model_a, model_b, opt_a, opt_b)  # ... and a state_dict says what the user chose
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert (handle.host_kernel.name, handle.stats.host_kernel) == ("fused", "fused")  # what stepped


def test_the_exactness_test_tells_the_fused_kernel_from_the_for_loop():
    # Negative control: for AdamW the two kernels give other last bits, so the test above would
    # fail had the host step run the for-loop.
    model_a, _, _ = _train(lambda params: OPTIMIZERS["adamw-decay"](params, foreach=False), offload=False)
    model_b, _, handle = _train(OPTIMIZERS["adamw-decay"], offload=True)
    handle.close()
    assert not torch.equal(model_a[0].weight, model_b[0].weight)


@pytest.mark.parametrize(
    ("kernel", "name"),
    [
        ({"foreach": False}, "for-loop"),
        ({"fused": False}, "for-loop"),
        ({"foreach": True}, "foreach"),
        ({"fused": True}, "fused"),
    ],
)
def test_an_explicit_choice_is_kept(kernel, name):
    def make(params):
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, **kernel)

    model_a, opt_a, _ = _train(make, offload=False)
    model_b, opt_b, handle = _train(make, offload=True)
    assert handle.host_kernel.name == name
    assert (
        str(handle.host_kernel)
        == f"AdamW step: {name}, {next(iter(kernel))}={next(iter(kernel.values()))} in its param groups"
    )
    handle.close()
    assert_state_equal(model_a, model_b, opt_a, opt_b)  # groups as constructed, the same bits


def test_an_optimizer_without_a_fused_kernel_keeps_the_for_loop_and_says_why():
    def make(params):
        return torch.optim.RMSprop(params, lr=0.01, momentum=0.9)

    model_a, opt_a, _ = _train(make, offload=False)
    model_b, opt_b, handle = _train(make, offload=True)
    assert (
        str(handle.host_kernel)
        == "RMSprop step: for-loop, RMSprop has no fused CPU kernel and foreach is not faster on CPU"
    )
    handle.close()
    assert_state_equal(model_a, model_b, opt_a, opt_b)


def test_radam_without_a_fused_kernel_steps_with_foreach_bitwise_like_its_foreach():
    # RAdam's foreach step was faster than its for-loop on CPU; it has no fused kernel.
    model_a, opt_a, _ = _train(
        lambda params: torch.optim.RAdam(params, lr=0.01, foreach=True), offload=False, steps=7
    )
    model_b, opt_b, handle = _train(lambda params: torch.optim.RAdam(params, lr=0.01), offload=True, steps=7)
    assert str(handle.host_kernel) == (
        "RAdam step: foreach, lightmem's choice: foreach/fused were unset, no fused CPU kernel, foreach faster on CPU"
    )
    assert opt_b.param_groups[0]["foreach"] is True  # while offloaded: foreach runs
    expected, actual = opt_a.state_dict(), opt_b.state_dict()
    assert actual["param_groups"][0]["foreach"] is None  # saved as the user constructed it
    expected["param_groups"][0]["foreach"] = None
    assert_same(expected, actual, "optimizer")
    handle.close()
    assert (opt_b.param_groups[0]["foreach"], opt_b.defaults["foreach"]) == (None, None)  # as constructed
    assert_state_equal(model_a, model_b)


def test_a_subclass_with_its_own_step_keeps_its_choice():
    class ScaledAdam(torch.optim.Adam):  # its step may not honour fused
        def step(self, closure=None):
            return super().step(closure)

    model = tiny_net()
    optimizer = ScaledAdam(model.parameters(), lr=0.01)
    with offload_optimizer(model, optimizer, devices=("cpu",)) as handle:
        assert (handle.host_kernel.name, optimizer.param_groups[0]["fused"]) == ("custom", None)
        assert str(handle.host_kernel) == "ScaledAdam step: custom, ScaledAdam's own step, as constructed"


def test_param_groups_choose_each_for_itself():
    model = tiny_net()
    weights, biases = (
        [p for p in model.parameters() if p.dim() > 1],
        [p for p in model.parameters() if p.dim() == 1],
    )
    optimizer = torch.optim.SGD(
        [{"params": weights}, {"params": biases, "foreach": False}], lr=0.1, momentum=0.9
    )
    with offload_optimizer(model, optimizer, devices=("cpu",)) as handle:
        assert [group["fused"] for group in optimizer.param_groups] == [True, None]
        assert handle.host_kernel.name == "fused+for-loop"
        assert str(handle.host_kernel) == (
            "SGD step: fused in group 0, lightmem's choice: foreach/fused were unset; "
            "for-loop in group 1, foreach=False in its param groups"
        )
    assert [group["fused"] for group in optimizer.param_groups] == [None, None]
    assert optimizer.defaults["fused"] is None


def _resume_offloaded(saved):
    """A fresh model and optimizer (foreach/fused unset), offloaded, load ``saved`` and train on."""
    torch.manual_seed(0)
    model = tiny_net()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    with offload_optimizer(model, optimizer, devices=("cpu",)) as handle:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        assert (handle.host_kernel.name, optimizer.param_groups[0]["fused"]) == ("fused", True)
        _train_more(model, optimizer)
        state = optimizer.state_dict()
    return model, state


def _fused_adam(params):
    return OPTIMIZERS["adam"](params, **HOST_KERNEL)


def test_an_offloaded_state_dict_round_trips():
    model, optimizer, handle = _train(OPTIMIZERS["adam"], offload=True, steps=2)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})  # as on disk
    handle.close()
    # lightmem's choice is not saved as the user's: resumed, the groups are given back unset too.
    assert saved["optimizer"]["param_groups"][0]["fused"] is None
    resumed_model, resumed_state = _resume_offloaded(saved)
    reference_model, reference_opt, _ = _train(_fused_adam, offload=False, steps=2)
    _train_more(reference_model, reference_opt)
    assert_state_equal(reference_model, resumed_model)
    expected = reference_opt.state_dict()
    expected["param_groups"][0]["fused"] = None  # lightmem's choice is not saved as the user's
    assert_same(expected, resumed_state, "optimizer")


def test_a_checkpoint_that_left_the_kernel_unset_gets_the_fused_kernel_again():
    # Saved without lightmem by an optimizer with foreach/fused unset: its groups say fused=None.
    model, optimizer, _ = _train(OPTIMIZERS["adam"], offload=False, steps=2)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})  # as on disk
    assert saved["optimizer"]["param_groups"][0]["fused"] is None
    resumed_model, resumed_state = _resume_offloaded(saved)
    optimizer.param_groups[0]["fused"] = True  # the reference goes on with the fused kernel
    _train_more(model, optimizer)
    assert_state_equal(model, resumed_model)
    expected = optimizer.state_dict()
    expected["param_groups"][0]["fused"] = None  # lightmem's choice is not saved as the user's
    assert_same(expected, resumed_state, "optimizer")


def _train_more(model, optimizer):
    torch.manual_seed(7)
    for inputs, targets in regression_batches(2):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("kernel", [None, {"foreach": False}], ids=["unset", "foreach=False"])
def test_either_lightning_package_fits_with_the_kernel_chosen(lightning_package, kernel):
    module_class = lit_tiny_class(lightning_package)
    settings = dict(accumulate_grad_batches=2, gradient_clip_val=0.5, gradient_clip_algorithm="norm")

    def fit(callbacks, module_kernel):
        lightning_package.seed_everything(0, verbose=False)
        module = module_class(kernel=module_kernel)
        trainer = cpu_trainer(callbacks, lightning_package, **settings)
        trainer.fit(module, regression_loader())
        return module, trainer.optimizers[0]

    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    module_b, opt_b = fit([callback], kernel)
    assert callback.optimizer_offload_stats[0].host_kernel == ("fused" if kernel is None else "for-loop")
    if kernel is None:
        module_a, opt_a = fit([], HOST_KERNEL)
        assert_given_back(module_a, module_b, opt_a, opt_b)
    else:
        module_a, opt_a = fit([], kernel)
        assert_state_equal(module_a, module_b, opt_a, opt_b)
