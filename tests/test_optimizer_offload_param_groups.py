"""A param group added while offloaded (``optimizer.add_param_group``: Lightning's
``BackboneFinetuning`` unfreezing a backbone) is offloaded like the groups at the start: its
gradients, state and step on the host, bitwise the training without lightmem, and ``close()``
gives every group back."""

from __future__ import annotations

import contextlib

import pytest
import torch
from exact import assert_same
from lit_models import cpu_trainer
from optimizer_models import (
    HOST_KERNEL,
    assert_given_back,
    assert_no_hazards_then_close,
    regression_batches,
    regression_loader,
    run_two_process_script,
)
from torch import nn

from lightmem import LightMem, offload_optimizer
from lightmem.testing.simulated import SimulatedAsyncTransport

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning"
)


def _aligned_bytes(module):
    """Host bytes of ``module``'s parameters in an arena: each starts on a 64-byte line."""
    return sum(-(-param.nbytes // 64) * 64 for param in module.parameters())


def _net():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _train(offload=None, steps=5, unfreeze_after=2, **flags):
    """The body frozen and out of the optimizer, added as a param group of its own after
    ``unfreeze_after`` steps (with an LR of its own). Without ``offload`` the reference."""
    torch.manual_seed(0)
    model = _net()
    body = list(model[:2].parameters())
    for param in body:
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(model[3].parameters(), lr=0.01, weight_decay=0.1, **({} if offload else HOST_KERNEL))
    handle = offload(model, optimizer, **flags) if offload else None
    host_bytes = []
    for step, (inputs, targets) in enumerate(regression_batches(steps)):
        if step == unfreeze_after:
            for param in body:
                param.requires_grad_(True)
            optimizer.add_param_group({"params": body, "lr": 0.001})
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if handle is not None:
            host_bytes.append(handle.stats.host_param_bytes)
    return model, optimizer, handle, host_bytes


def _offloading(transport=None):
    return lambda model, optimizer, **flags: offload_optimizer(model, optimizer, devices=("cpu",), transport=transport, **flags)


@pytest.mark.parametrize("mode", ["sync", "simulated", "overlap"])
def test_a_group_added_while_offloaded_is_offloaded_and_bitwise(mode):
    transport = SimulatedAsyncTransport(seed=2, max_delay_s=0.001) if mode == "simulated" else None
    model_a, opt_a, _, _ = _train()
    model_b, opt_b, handle, host_bytes = _train(_offloading(transport), overlap_step=mode == "overlap")
    assert host_bytes[2] - host_bytes[1] == _aligned_bytes(model_b[:2])  # the body's host copies, from the step it joined
    assert all(param.device.type == "cpu" and param is not device for group in opt_b.param_groups for param, device in zip(group["params"], model_b.parameters()))
    assert opt_b.param_groups[1]["fused"] is True  # the host kernel chosen for the new group too
    handle.wait_for_params()
    assert_given_back(model_a, model_b, opt_a, opt_b)  # state_dict while offloaded
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert [id(param) for param in opt_b.param_groups[1]["params"]] == [id(param) for param in model_b[:2].parameters()]
    assert_no_hazards_then_close(transport)


def _unfrozen_mid_training(offload=None, steps=4, accumulate=2, **flags):
    """A bias frozen in the optimizer from the start, unfrozen after the first step; two backward
    passes per step. Without ``offload`` the reference."""
    torch.manual_seed(0)
    model = _net()
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, **({} if offload else HOST_KERNEL))
    handle = offload(model, optimizer, **flags) if offload else None
    batches = iter(regression_batches(steps * accumulate))
    for step in range(steps):
        if step == 1:
            model[0].bias.requires_grad_(True)
        for index in range(accumulate):
            inputs, targets = next(batches)
            accumulating = handle is not None and flags.get("overlap_step") and index < accumulate - 1
            with handle.accumulating() if accumulating else contextlib.nullcontext():
                nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, handle


@pytest.mark.parametrize("mode", ["sync", "simulated", "overlap"])
def test_a_parameter_frozen_at_the_start_and_unfrozen_later_is_stepped_bitwise(mode):
    # Its first gradients come while it has no hook: they land from the device at the end of that
    # backward (by then accumulated there), and the hook takes it from the next backward on.
    transport = SimulatedAsyncTransport(seed=6, max_delay_s=0.001) if mode == "simulated" else None
    model_a, opt_a, _ = _unfrozen_mid_training()
    model_b, opt_b, handle = _unfrozen_mid_training(_offloading(transport), overlap_step=mode == "overlap")
    handle.close()
    assert_given_back(model_a, model_b, opt_a, opt_b)
    assert_no_hazards_then_close(transport)


def test_a_group_torch_refuses_leaves_nothing_offloaded():
    model = _net()
    optimizer = torch.optim.AdamW(model[3].parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",))
    host_bytes = handle.stats.host_param_bytes
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names"):
        optimizer.add_param_group({"params": list(model[0].parameters()), "param_names": ["weight", "bias"]})
    assert (handle.stats.host_param_bytes, len(handle.host_copies())) == (host_bytes, 2)
    optimizer.add_param_group({"params": list(model[0].parameters())})  # the same group, valid: taken
    assert len(handle.host_copies()) == 4
    handle.close()


def test_adding_a_parameter_the_optimizer_already_holds_is_refused():
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",))
    with pytest.raises(ValueError) as error:
        optimizer.add_param_group({"params": list(model[0].parameters())})
    assert str(error.value) == (
        "offload_optimizer: add_param_group got 2 parameter(s) the optimizer already holds (while offloaded "
        "its groups hold their host copies, so a check for parameters already in the optimizer does not "
        "find them); leave them out of the new group"
    )
    handle.close()


def test_adding_a_group_with_bf16_device_parameters_is_refused():
    model = _net()
    optimizer = torch.optim.AdamW(model[3].parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",), device_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"add_param_group while offloaded with offload_optimizer\(device_dtype=...\)"):
        optimizer.add_param_group({"params": list(model[0].parameters())})
    handle.close()


# -- under Lightning: BackboneFinetuning ---------------------------------------------------------


def _lit_backbone_class(package):
    class LitBackbone(package.LightningModule):
        def __init__(self, kernel=None):
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.head = nn.Linear(16, 1)
            self.kernel = kernel or {}

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return nn.functional.mse_loss(self.head(self.backbone(inputs)), targets)

        def configure_optimizers(self):
            # As BackboneFinetuning asks: only what is trainable when the fit starts.
            return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01, **self.kernel)

    return LitBackbone


def _fit(package, callbacks, kernel):
    package.seed_everything(0, verbose=False)
    module = _lit_backbone_class(package)(kernel)
    finetuning = package.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = cpu_trainer([finetuning, *callbacks], package, max_steps=-1, max_epochs=3)
    trainer.fit(module, regression_loader(batches=3))
    return module, trainer, torch.get_rng_state()


def test_backbone_finetuning_offloads_the_unfrozen_backbone(lightning_package):
    module_a, trainer_a, rng_a = _fit(lightning_package, [], HOST_KERNEL)
    callback = LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    module_b, trainer_b, rng_b = _fit(lightning_package, [callback], None)
    (stats,) = callback.optimizer_offload_stats
    assert stats.host_param_bytes == _aligned_bytes(module_b.head) + _aligned_bytes(module_b.backbone)
    assert len(trainer_b.optimizers[0].param_groups) == 2
    assert_given_back(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])
    assert_same(rng_a, rng_b, "RNG state")


def _fit_and_resume(package, tmp_path, lightmem, kernel, offload_class=LightMem):
    """Two epochs (the backbone joins at the second), a checkpoint, then a third epoch resumed
    from it in a new Trainer: BaseFinetuning restores its two param groups at fit start."""

    def callbacks():
        finetuning = package.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)
        offload = [offload_class(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])] if lightmem else []
        return [*offload, finetuning]  # LightMem first: it offloads before BaseFinetuning restores its groups

    package.seed_everything(0, verbose=False)
    module = _lit_backbone_class(package)(kernel)
    first = cpu_trainer(callbacks(), package, max_steps=-1, max_epochs=2, default_root_dir=tmp_path)
    first.fit(module, regression_loader(batches=3))
    path = tmp_path / "two_epochs.ckpt"
    first.save_checkpoint(path)
    module = _lit_backbone_class(package)(kernel)
    second = cpu_trainer(callbacks(), package, max_steps=-1, max_epochs=3, default_root_dir=tmp_path)
    second.fit(module, regression_loader(batches=3), ckpt_path=path)
    return module, second


def test_backbone_finetuning_resumes_with_both_groups_offloaded(lightning_package, tmp_path, monkeypatch):
    module_a, trainer_a = _fit_and_resume(lightning_package, tmp_path / "a", False, HOST_KERNEL)
    device_params: set[int] = set()
    loaded_into_device_params = []
    load_state_dict = torch.optim.Optimizer.load_state_dict

    def recording_load(optimizer, state):
        groups = optimizer.param_groups
        loaded_into_device_params.append(any(id(p) in device_params for group in groups for p in group["params"]))
        load_state_dict(optimizer, state)

    class Recording(LightMem):
        def on_fit_start(self, trainer, pl_module):
            device_params.update(map(id, pl_module.parameters()))
            super().on_fit_start(trainer, pl_module)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", recording_load)
    module_b, trainer_b = _fit_and_resume(lightning_package, tmp_path / "b", True, None, Recording)
    # The checkpoint's state loaded into host copies only: the restored backbone group was offloaded first.
    assert loaded_into_device_params == [False]
    assert len(trainer_b.optimizers[0].param_groups) == 2
    (callback,) = [callback for callback in trainer_b.callbacks if isinstance(callback, LightMem)]
    (stats,) = callback.optimizer_offload_stats
    assert stats.host_param_bytes == _aligned_bytes(module_b.head) + _aligned_bytes(module_b.backbone)
    assert_given_back(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])


def _two_group_run(offload, change, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    groups = [{"params": list(model[0].parameters()), "lr": 0.1}, {"params": list(model[1].parameters()), "lr": 0.001}]
    optimizer = torch.optim.AdamW(groups if change == "reverse" else groups[1:], **({} if offload else HOST_KERNEL))
    handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True) if offload else None
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for step in range(steps):
        if step == 1 and change == "reverse":
            optimizer.param_groups.reverse()  # the same groups, the other order
        elif step == 1:  # assigned behind the optimizer's back, as BaseFinetuning's restore does
            optimizer.param_groups.append({**optimizer.defaults, **groups[0]})
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if handle is not None:
        handle.close()
    return model.state_dict(), optimizer.state_dict()["state"]


@pytest.mark.parametrize("change", ["reverse", "append"])
def test_with_the_overlap_groups_reordered_or_assigned_step_with_their_own_settings(change):
    # The overlapped step reads each parameter's group by index: taken from the groups as they are
    # at each backward's first gradient; an appended group is offloaded then, its kernel chosen
    # before the step's settings are taken (no "changed" error).
    assert_same(_two_group_run(False, change), _two_group_run(True, change), "training state")


def test_backbone_finetuning_compares_device_parameters_only(lightning_package, monkeypatch):
    # BaseFinetuning.filter_on_optimizer compares the parameters to add with those in the groups
    # (torch.equal): a host copy there would meet a CUDA parameter, which torch refuses. Here a
    # comparison with anything but the module's own parameters fails as it would on CUDA.
    module_params: set[int] = set()
    equal = torch.equal

    def equal_on_one_device(a, b):
        if not (id(a) in module_params and id(b) in module_params):
            raise RuntimeError("Cannot compare two tensors on different devices")
        return equal(a, b)

    class Recording(LightMem):
        def on_fit_start(self, trainer, pl_module):
            module_params.update(map(id, pl_module.parameters()))
            super().on_fit_start(trainer, pl_module)

    monkeypatch.setattr(torch, "equal", equal_on_one_device)
    callback = Recording(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])
    module, trainer, _ = _fit(lightning_package, [callback], None)
    assert len(trainer.optimizers[0].param_groups) == 2


def test_groups_reordered_while_offloaded_keep_their_own_kernel_flags():
    # lightmem sets fused=True only where the user left it unset, and gives back None there, by
    # group, wherever the group has moved.
    model = _net()
    optimizer = torch.optim.AdamW(
        [{"params": list(model[0].parameters()), "fused": False}, {"params": list(model[3].parameters())}], lr=0.01
    )
    handle = offload_optimizer(model, optimizer, devices=("cpu",))
    optimizer.param_groups.reverse()
    assert [group["fused"] for group in optimizer.state_dict()["param_groups"]] == [None, False]
    handle.close()
    assert [group["fused"] for group in optimizer.param_groups] == [None, False]


def test_under_ddp_with_no_sync_added_groups_unfrozen_parameters_and_zero_grad_match_ddp(tmp_path):
    # One launch of tests/optimizer_ddp_groups_script.py (2 CPU processes, gloo).
    report = run_two_process_script("optimizer_ddp_groups_script.py", tmp_path)
    each = {"equal_per_rank": [True, True], "ranks_agree": True}
    assert report == {variant: each for variant in ("plain", "add_mid", "unfreeze", "zero_mid")}


def test_zero_grad_clears_a_gradient_left_on_the_device_by_an_unfrozen_parameter():
    # A backward that reaches only a parameter unfrozen since the start (no hook yet, so no landing
    # at its end), then zero_grad: without lightmem that gradient is gone too.
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        model[1].bias.requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **({} if offload else HOST_KERNEL))
        handle = offload_optimizer(model, optimizer, devices=("cpu",)) if offload else None
        model[1].bias.requires_grad_(True)
        (model[1].bias * 5).sum().backward()
        optimizer.zero_grad()
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(1))).sum().backward()
        optimizer.step()
        if handle is not None:
            handle.close()
        runs.append(model.state_dict())
    assert_same(*runs, "state_dict")


def test_with_bf16_device_parameters_an_unfrozen_parameter_lands_as_a_hooked_one():
    # Its first gradient lands from the device (bf16 widened into the fp32 master's gradient):
    # bitwise what the gradient hook does for a parameter unfrozen from the start.
    runs = []
    for frozen_at_start in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 1))
        model[0].weight.requires_grad_(not frozen_at_start)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        handle = offload_optimizer(model, optimizer, devices=("cpu",), device_dtype=torch.bfloat16)
        model[0].weight.requires_grad_(True)
        for inputs, targets in regression_batches(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(inputs).float(), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        handle.close()
        runs.append((model.state_dict(), optimizer.state_dict()["state"]))
    assert_same(*runs, "training state")


def test_a_gradient_set_by_hand_on_a_device_parameter_is_refused_at_the_step():
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    handle = offload_optimizer(model, optimizer, devices=("cpu",))
    inputs, targets = regression_batches(1)[0]
    nn.functional.mse_loss(model(inputs), targets).backward()
    model[3].weight.grad = torch.ones_like(model[3].weight)
    with pytest.raises(ValueError) as error:
        optimizer.step()
    assert str(error.value) == (
        "offload_optimizer: 1 parameter(s) of shape [1, 16] have a gradient on the device that lightmem did "
        "not put there (set by hand after backward?); while offloaded the step reads the gradient of each "
        "parameter's host copy: set `.grad` of the tensors in optimizer.param_groups instead"
    )
    handle.close()


def test_with_the_overlap_a_group_added_or_a_weight_written_between_backward_and_step_is_raised():
    for change, message in (
        (
            lambda model, optimizer: optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}),
            r"optimizer.add_param_group\(\) came after a backward whose gradients were being stepped",
        ),
        (
            lambda model, optimizer: torch.nn.init.zeros_(model[3].weight),
            r"since then the device values of 1 parameters \(written after backward\) changed",
        ),
    ):
        model = _net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        handle = offload_optimizer(model, optimizer, devices=("cpu",), overlap_step=True)
        inputs, targets = regression_batches(1)[0]
        nn.functional.mse_loss(model(inputs), targets).backward()
        with pytest.raises(RuntimeError, match=message):
            change(model, optimizer)
            optimizer.step()
        handle.close()


@pytest.mark.parametrize("flags", [{}, {"overlap_step": True}], ids=["after-backward", "overlap"])
def test_gradients_there_before_offload_and_model_zero_grad_are_as_without_it(flags):
    # A backward before offload starts (a sanity pass) leaves gradients the first step takes; the
    # loop then clears with model.zero_grad(), which must clear the host gradients too.
    runs = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **({} if offload else HOST_KERNEL))
        generator = torch.Generator().manual_seed(1)
        model(torch.randn(2, 4, generator=generator)).sum().backward()
        handle = offload_optimizer(model, optimizer, devices=("cpu",), **flags) if offload else None
        optimizer.step()
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(2, 4, generator=generator)).sum().backward()
            optimizer.step()
        if handle is not None:
            handle.close()
        runs.append(model.state_dict())
    assert_same(*runs, "state_dict")


def _lit_gan_class(package):
    class LitGAN(package.LightningModule):
        """Manual optimization with two optimizers and toggle_optimizer, Lightning's GAN pattern."""

        def __init__(self, kernel=None):
            super().__init__()
            self.generator, self.discriminator = nn.Linear(8, 8), nn.Linear(8, 1)
            self.kernel = kernel or {}
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            real = batch[0]
            for optimizer, loss_of in zip(
                self.optimizers(),
                (
                    lambda: -self.discriminator(self.generator(real)).mean(),
                    lambda: self.discriminator(self.generator(real).detach()).mean() - self.discriminator(real).mean(),
                ),
            ):
                self.toggle_optimizer(optimizer)
                self.manual_backward(loss_of())
                optimizer.step()
                optimizer.zero_grad()
                self.untoggle_optimizer(optimizer)

        def configure_optimizers(self):
            return (
                torch.optim.Adam(self.generator.parameters(), lr=0.1, **self.kernel),
                torch.optim.Adam(self.discriminator.parameters(), lr=0.1, **self.kernel),
            )

    return LitGAN


def test_toggle_optimizer_freezes_the_device_parameters_of_the_other_optimizer(lightning_package):
    # Without the toggle acting on the device parameters the discriminator would collect
    # gradients in the generator's backward and add them in its own step.
    runs = []
    for callbacks in ([], [LightMem(offload=False, offload_optimizer=True, offload_devices=["cpu"], metrics=[])]):
        lightning_package.seed_everything(0, verbose=False)
        module = _lit_gan_class(lightning_package)(None if callbacks else HOST_KERNEL)
        cpu_trainer(callbacks, lightning_package, max_steps=6).fit(module, regression_loader(batches=3))
        runs.append(module.state_dict())
    assert_same(*runs, "state_dict")
