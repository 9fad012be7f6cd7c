"""LightMem in a real Trainer on CPU: exact weights, hook discipline, lifecycle, errors."""

from __future__ import annotations

import re

import warnings

import pytest
import pytorch_lightning as pl
import torch
from bn_models import LitResNet, image_loader
from exact import assert_state_equal
from lit_models import LitGPT, cpu_trainer, lit_gpt_class, token_loader

from lightmem import LightMem
from lightmem.checkpoint import is_checkpointed
from lightmem.estimate.words import format_seconds
from lightmem.metrics.recorder import SUMMARY_TITLE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")


def _fit(callback=None, module_kwargs=None, module_class=LitGPT, loader=token_loader, package=pl, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    module = module_class(**(module_kwargs or {}))
    trainer = cpu_trainer([callback] if callback else [], package, **trainer_kwargs)
    trainer.fit(module, loader())
    return module, trainer


@pytest.fixture(scope="module")
def reference():
    """``_fit(None, ...)``, each distinct run trained once per module; tests only read the result."""
    runs = {}

    def get(module_kwargs=None, module_class=LitGPT, loader=token_loader, package=pl, **trainer_kwargs):
        options = (tuple(sorted((module_kwargs or {}).items())), tuple(sorted(trainer_kwargs.items())))
        key = (module_class, loader, package, options)
        if key not in runs:
            runs[key] = _fit(None, module_kwargs, module_class, loader, package, **trainer_kwargs)
        return runs[key]

    return get


def _cpu_lightmem(**kwargs):
    kwargs.setdefault("offload_devices", ["cpu"])
    kwargs.setdefault("offload_min_bytes", 0)
    kwargs.setdefault("checkpoint", ["Block"])
    return LightMem(**kwargs)


def _assert_same_state(expected, actual):
    """(module, trainer) pairs: the whole state_dict and the optimizer state are bitwise equal."""
    (module_a, trainer_a), (module_b, trainer_b) = expected, actual
    assert len(trainer_a.optimizers) == len(trainer_b.optimizers) == 1
    assert_state_equal(module_a, module_b, trainer_a.optimizers[0], trainer_b.optimizers[0])


@pytest.mark.parametrize(
    ("module_kwargs", "trainer_kwargs"),
    [
        ({}, {}),
        ({}, {"accumulate_grad_batches": 2}),
        ({}, {"precision": "bf16-mixed"}),
        ({"manual": True}, {}),
        ({"skip_every": 2}, {}),
        ({"build_in_configure_model": True}, {}),
    ],
    ids=["automatic", "accumulation", "bf16-mixed", "manual", "step-returns-none", "configure-model"],
)
def test_trained_weights_are_bitwise_equal_to_a_run_without_the_callback(reference, module_kwargs, trainer_kwargs):
    expected = reference(module_kwargs, **trainer_kwargs)
    callback = _cpu_lightmem()
    actual = _fit(callback, module_kwargs, **trainer_kwargs)
    _assert_same_state(expected, actual)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_either_lightning_package_trains_bitwise_equal_with_offload_and_checkpoint(reference, lightning_package):
    module_class = lit_gpt_class(lightning_package)
    expected = reference(module_class=module_class, package=lightning_package)
    callback = _cpu_lightmem()
    actual = _fit(callback, module_class=module_class, package=lightning_package)
    _assert_same_state(expected, actual)
    assert callback.summary()["blocks checkpointed"] == "3"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("min_bytes", [0, "1MiB"], ids=["offload-min-0", "offload-default"])
@pytest.mark.parametrize("every", [1, 2])
def test_batchnorm_statistics_and_step_counters_are_exact_under_checkpoint_and_offload(reference, every, min_bytes):
    expected = reference(module_class=LitResNet, loader=image_loader)
    callback = _cpu_lightmem(checkpoint=["ResBlock", "Head"], checkpoint_every=every, offload_min_bytes=min_bytes)
    actual = _fit(callback, module_class=LitResNet, loader=image_loader)
    _assert_same_state(expected, actual)
    assert int(actual[0].model.blocks[2].bn1.num_batches_tracked) == 4


def test_offload_and_checkpointing_really_ran():
    callback = _cpu_lightmem(log_every_n_steps=1)
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["checkpointed"] = [is_checkpointed(b) for b in pl_module.model.blocks]

    module = LitGPT()
    trainer = cpu_trainer([callback, Spy()])
    trainer.fit(module, token_loader())
    assert seen["checkpointed"] == [True, True, True]
    assert callback.last_metrics["lightmem/memory/offload/offloaded_GiB"] > 0
    assert callback.last_metrics["lightmem/memory/checkpoint/blocks"] == 3
    assert not any(is_checkpointed(b) for b in module.model.blocks)  # undone at teardown


def test_hooks_are_active_in_training_forward_only():
    module = LitGPT(manual=True)
    trainer = cpu_trainer([_cpu_lightmem()], limit_val_batches=2, val_check_interval=2)
    trainer.fit(module, token_loader(), token_loader(batches=2))
    trainer.predict(module, token_loader(batches=2))
    train = module.hooks_seen["train"]
    assert train[0::2] == [True] * (len(train) // 2)  # inside training_step, before backward
    assert train[1::2] == [False] * (len(train) // 2)  # after manual_backward
    assert module.hooks_seen["validation"] and not any(module.hooks_seen["validation"])
    assert module.hooks_seen["predict"] and not any(module.hooks_seen["predict"])


def test_fit_twice_validate_predict_and_checkpoint_round_trip(tmp_path):
    callback = _cpu_lightmem()
    module = LitGPT()
    trainer = cpu_trainer([callback], default_root_dir=tmp_path, enable_checkpointing=True, max_steps=2)
    trainer.fit(module, token_loader())
    trainer2 = cpu_trainer([callback], max_steps=2)
    trainer2.fit(module, token_loader())
    assert not any(is_checkpointed(b) for b in module.model.blocks)
    trainer2.validate(module, token_loader(batches=1), verbose=False)
    predictions = trainer2.predict(module, token_loader(batches=1))
    assert predictions[0].shape == (4, 32)
    path = tmp_path / "model.ckpt"
    trainer2.save_checkpoint(path)
    restored = LitGPT.load_from_checkpoint(path)
    assert_state_equal(module, restored)
    assert "configure_model" not in module.__dict__


def test_a_fit_session_lives_from_setup_to_teardown():
    callback = _cpu_lightmem()
    sessions = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sessions.append(callback.fit_session)

    assert callback.fit_session is None
    pl.seed_everything(0, verbose=False)
    trainer = cpu_trainer([callback, Spy()], max_steps=2)
    trainer.fit(LitGPT(), token_loader())
    first = sessions[0]
    assert sessions == [first, first] and first is not None and callback.fit_session is None
    trainer = cpu_trainer([callback, Spy()], max_steps=1)
    trainer.fit(LitGPT(), token_loader())
    assert sessions[2] is not first and callback.fit_session is None
    assert callback.summary()["blocks checkpointed"] == "3"


def test_exception_in_training_step_leaves_no_hooks_behind():
    class Fails(LitGPT):
        def training_step(self, batch, batch_idx):
            self.model(batch[0][:, :-1])  # a forward with saved tensors, then the failure
            raise RuntimeError("boom")

    module = Fails()
    callback = _cpu_lightmem()
    with pytest.raises(RuntimeError, match="boom"):
        cpu_trainer([callback]).fit(module, token_loader())
    assert callback.fit_session is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not any(is_checkpointed(b) for b in module.model.blocks)
    assert "configure_model" not in module.__dict__


def test_batch_skipped_by_on_train_batch_start_does_not_leave_hooks_active():
    seen = []

    class Skips(LitGPT):
        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == 1 else None  # Lightning ends the epoch here

        def on_train_epoch_end(self):
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)

    cpu_trainer([_cpu_lightmem()], max_epochs=1).fit(Skips(), token_loader())
    assert seen == [False]


def test_out_of_memory_prints_a_report_and_re_raises(capsys):
    class OutOfMemory(LitGPT):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().training_step(batch, batch_idx)

    with pytest.raises(torch.cuda.OutOfMemoryError):
        cpu_trainer([_cpu_lightmem(checkpoint=None, log_every_n_steps=1)]).fit(OutOfMemory(), token_loader())
    report = capsys.readouterr().out
    assert "lightmem: out of memory during training. What was on the device:" in report
    assert "  parameters " in report and "  optimizer_state " in report
    assert "Checkpoint the repeated blocks: LightMem(checkpoint=['Block'])." in report
    assert "lightmem/memory/host/rss_GiB" in report


def test_cpu_only_default_turns_offload_off_and_says_so(caplog):
    callback = LightMem(checkpoint=["Block"])
    with caplog.at_level("INFO"):
        _fit(callback)
    assert _fit_start_lines(caplog) == [
        "lightmem: on: checkpointing 3 blocks (model.blocks.0, model.blocks.1, model.blocks.2); host, lightmem "
        "metrics. Off: activation offload (no CUDA device: moving CPU tensors to host memory gains nothing); "
        "gpu and device metrics (the training device is not a CUDA device). On this CPU, "
        "LightMem(offload_devices=['cpu']) runs activation offload anyway, with host-to-host copies that save no "
        "memory: to see it work."
    ]
    assert "offloaded per step" not in callback.summary()


def _fit_start_lines(caplog):
    """lightmem's lines but the end-of-fit summary."""
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lightmem:")]
    return [message for message in messages if not message.startswith(SUMMARY_TITLE)]


def test_cpu_only_defaults_say_exactly_what_is_on_in_one_line(caplog):
    with caplog.at_level("INFO"):
        _fit(LightMem())
    assert _fit_start_lines(caplog) == [
        "lightmem: on: host metrics. Off: activation offload (no CUDA device: moving CPU tensors to host memory "
        "gains nothing); gpu and device metrics (the training device is not a CUDA device). On this CPU, "
        "LightMem(offload_devices=['cpu']) runs activation offload anyway, with host-to-host copies that save no "
        "memory: to see it work."
    ]


def test_cpu_only_offload_devices_cpu_runs_activation_offload_and_the_line_says_it_is_on(caplog):
    with caplog.at_level("INFO"):
        _fit(LightMem(offload_devices=["cpu"]))
    assert _fit_start_lines(caplog) == [
        "lightmem: on: activation offload (tensors from 1.00 MiB); host, lightmem metrics. Off: gpu and device "
        "metrics (the training device is not a CUDA device)."
    ]


def test_cpu_only_optimizer_offload_is_off_and_the_line_says_how_to_run_both_offloads_on_the_cpu(caplog):
    with caplog.at_level("INFO"):
        _fit(LightMem(offload_optimizer=True))
    assert _fit_start_lines(caplog) == [
        "lightmem: on: host metrics. Off: activation offload (no CUDA device: moving CPU tensors to host memory "
        "gains nothing); optimizer offload (the model is on cpu, not a device type in "
        "LightMem(offload_devices=...)); gpu and device metrics (the training device is not a CUDA device). On "
        "this CPU, LightMem(offload_devices=['cpu']) runs activation offload and optimizer offload anyway, with "
        "host-to-host copies that save no memory: to see them work."
    ]


def test_a_host_budget_in_decimal_units_is_read_back_at_fit_start_and_a_binary_one_is_not(caplog):
    with caplog.at_level("INFO"):
        _fit(LightMem(host_budget="64 GB"))
    assert _fit_start_lines(caplog)[1:] == [
        "lightmem: LightMem(host_budget=...): 64 GB = 64,000,000,000 bytes (59.60 GiB), in decimal units (kB, MB, "
        "GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"
    ]
    caplog.clear()
    with caplog.at_level("INFO"):
        _fit(LightMem(host_budget="64GiB"))
    assert len(_fit_start_lines(caplog)) == 1  # what is on and off, nothing to read back


def test_plan_auto_on_a_cpu_says_what_is_on_at_fit_start_then_plans_at_the_first_batch_at_cpu_prices(caplog):
    callback = LightMem(plan="auto", device_budget="4.5 MB")
    with caplog.at_level("INFO"):
        _fit(callback)
    on, budget, planning, planned, chosen = _fit_start_lines(caplog)
    assert on == (
        "lightmem: on: plan='auto' (at the first training batch it chooses what to checkpoint; on a CPU it never "
        "offloads); host metrics. Off: activation offload (no CUDA device: moving CPU tensors to host memory gains "
        "nothing); gpu and device metrics (the training device is not a CUDA device)."
    )
    assert budget == (
        "lightmem: plan='auto' device budget: 4.5 MB = 4,500,000 bytes (4.29 MiB), in decimal units (kB, MB, GB, "
        "TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"
    )
    assert planning == (
        "lightmem: plan='auto' is planning for batches of [4, 33] within a 4.29 MiB device budget (each "
        "configuration's step traced on fake tensors)"
    )
    assert re.fullmatch(
        r"lightmem: planned batches of \[4, 33\] in \d+\.\d s \(\d+ configuration\(s\) traced on fake tensors\)", planned
    )
    plan = callback.chosen_plan
    assert plan.budget_bytes == 4_500_000 and plan.checkpoint == ["model.blocks.0"]
    assert chosen == (
        f"lightmem: plan for a 4.29 MiB device budget: checkpoint ['model.blocks.0'], offload nothing; predicted "
        f"peak {plan.predicted_total_bytes / 2**20:.2f} MiB (reserved, overhead allowance included), step "
        f"{format_seconds(plan.step_seconds)} (priced at CPU figures: a generic server CPU; not measured on this "
        f"machine): {plan.slowdown:.2f}x the step without lightmem"
    )


def test_existing_checkpoint_wrapper_is_not_checkpointed_twice():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Wrapped(LitGPT):
        def __init__(self):
            super().__init__()
            self.model.blocks[0] = checkpoint_wrapper(self.model.blocks[0])

    with pytest.warns(UserWarning, match="is already a checkpoint wrapper; checkpointing twice would recompute twice"):
        cpu_trainer([_cpu_lightmem(checkpoint=["Block"])], max_steps=1).fit(Wrapped(), token_loader())


def test_host_floor_pauses_offload_with_one_warning():
    callback = _cpu_lightmem(host_min_available=1.0, checkpoint=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(callback)
    messages = [str(w.message) for w in caught if "offload is paused" in str(w.message)]
    assert len(messages) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": "yes"}, "LightMem(offload=...): expected True or False; got 'yes'"),
        ({"offload_min_bytes": "big"}, "LightMem(offload_min_bytes=...): expected a byte count (int), or a string"),
        ({"host_budget": "lots"}, "LightMem(host_budget=...): expected a byte count (int), or a string"),
        ({"offload_devices": ["tpu"]}, "LightMem(offload_devices=...): unknown device type 'tpu'"),
        ({"checkpoint_every": 0}, "LightMem(checkpoint_every=...): expected an integer >= 1; got 0"),
        ({"log_every_n_steps": 0}, "LightMem(log_every_n_steps=...): expected an integer >= 1 or None; got 0"),
        ({"metrics": ["gpu", "disk"]}, "LightMem(metrics=...): unknown probe group 'disk'; accepted: gpu, device, host, lightmem"),
        ({"checkpoint": [""]}, "LightMem(checkpoint=...): every pattern must be a non-empty string"),
        ({"prefetch_bytes": -5}, "LightMem(prefetch_bytes=...): a size cannot be negative; got -5"),
    ],
)
def test_bad_flags_fail_at_construction_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        LightMem(**kwargs)
    assert str(error.value).startswith(message)


def test_checkpoint_target_matching_nothing_fails_when_fit_starts():
    with pytest.raises(ValueError, match=r"LightMem\(checkpoint=...\): 'Blok' matches no module of the model; closest names: Block"):
        _fit(_cpu_lightmem(checkpoint=["Blok"]))


def test_plan_auto_checkpoints_what_the_budget_needs_and_keeps_weights_exact(reference, lightning_package):
    module_class = lit_gpt_class(lightning_package)
    from lightmem import estimate_memory

    module = module_class()
    (tokens,) = next(iter(token_loader()))
    baseline = estimate_memory(module, (tokens,), device="cpu")
    budget = baseline.static_bytes + (baseline.peak_bytes - baseline.static_bytes) * 6 // 10
    expected = reference(module_class=module_class, package=lightning_package)
    callback = LightMem(plan="auto", device_budget=budget, offload_devices=["cpu"])
    seen = {}

    class Spy(lightning_package.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["checkpointed"] = [name for name, m in pl_module.named_modules() if is_checkpointed(m)]

    pl.seed_everything(0, verbose=False)
    actual = module_class()
    trainer = cpu_trainer([callback, Spy()], lightning_package)
    trainer.fit(actual, token_loader())
    chosen = callback.chosen_plan
    assert chosen.fits and chosen.predicted_total_bytes <= budget
    assert chosen.checkpoint and set(seen["checkpointed"]) == set(chosen.checkpoint)
    _assert_same_state(expected, (actual, trainer))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plan": "manual"}, "LightMem(plan=...): expected None or 'auto'; got 'manual'"),
        ({"plan": "auto", "device_budget": "8GiB", "checkpoint": ["Block"]}, "LightMem(plan=...): 'auto' chooses checkpoint"),
        ({"device_budget": "lots"}, "LightMem(device_budget=...): expected a byte count"),
    ],
)
def test_bad_plan_flags(kwargs, message):
    with pytest.raises(ValueError) as error:
        LightMem(**kwargs)
    assert str(error.value).startswith(message)


def test_plan_auto_that_checkpoints_batchnorm_blocks_keeps_the_whole_state_exact(reference):
    # Block 2 uses BatchNorm(momentum=None), which reads its step count as a Python number: the
    # estimator's dry run reads the real buffer value, and the recompute must not count twice.
    from lightmem import estimate_memory

    (batch,) = [next(iter(image_loader()))]
    baseline = estimate_memory(LitResNet(), batch, device="cpu")
    budget = baseline.static_bytes + (baseline.peak_bytes - baseline.static_bytes) * 6 // 10
    expected = reference(module_class=LitResNet, loader=image_loader)
    callback = LightMem(plan="auto", device_budget=budget, offload_devices=["cpu"])
    actual = _fit(callback, {}, LitResNet, image_loader)
    # The planner acts on the repeated layers (the residual blocks), not on the head.
    # Block 2 (momentum=None) is among the checkpointed ones.
    assert callback.chosen_plan.checkpoint == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    _assert_same_state(expected, actual)


def test_plan_auto_applies_a_plan_that_offloads_everywhere(monkeypatch, caplog):
    # On a CPU device the planner never offloads; a plan as it comes from a GPU (offload without
    # include: every saved tensor, in any module) must reach the offloader as such.
    import logging

    from lightmem import fit_session
    from lightmem.estimate.planning.result import Plan

    def everywhere(model, batch, budget, **kwargs):
        offload = kwargs["offload"].with_choice(min_bytes=0, include=None)
        return Plan([], offload, 1, 0, budget, True, "as a GPU's plan would", offload_everywhere=True)

    monkeypatch.setattr(fit_session, "plan", everywhere)
    callback = LightMem(plan="auto", device_budget="1GiB", offload_devices=["cpu"], offload_min_bytes=0)
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            offloader = callback.fit_session.offloader
            seen.setdefault("include", offloader.settings.include)
            seen.setdefault("offloaded", offloader.stats.offloaded_bytes)

    expected = _fit(None, max_steps=2)
    pl.seed_everything(0, verbose=False)
    module = LitGPT()
    trainer = cpu_trainer([callback, Spy()], max_steps=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, token_loader())
    assert seen["include"] is None and seen["offloaded"] > 0
    assert "checkpoint nothing, offload everywhere; predicted peak" in caplog.text
    _assert_same_state(expected, (module, trainer))


def test_plan_auto_with_offload_off_plans_without_offload(monkeypatch):
    from lightmem import fit_session
    from lightmem.estimate.planning.result import Plan

    asked = {}

    def record(model, batch, budget, **kwargs):
        asked["offload"] = kwargs["offload"]
        return Plan(["model.blocks.0"], None, 1, 0, budget, True, "checkpointing only")

    monkeypatch.setattr(fit_session, "plan", record)
    callback = LightMem(plan="auto", device_budget="1GiB", offload=False, offload_devices=["cpu"])
    seen = {}

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["offloader"] = callback.fit_session.offloader

    cpu_trainer([callback, Spy()], max_steps=1).fit(LitGPT(), token_loader())
    assert asked["offload"] is False
    assert seen == {"offloader": None}


def test_plan_auto_with_offload_off_runs_the_planner_itself():
    # The test above stubs the planner; this one runs it (offload=False once raised FrozenInstanceError).
    from lightmem import estimate_memory

    (tokens,) = next(iter(token_loader()))
    baseline = estimate_memory(LitGPT(), (tokens,), device="cpu")
    budget = baseline.static_bytes + (baseline.peak_bytes - baseline.static_bytes) * 6 // 10
    callback = LightMem(plan="auto", device_budget=budget, offload=False, offload_devices=["cpu"])
    cpu_trainer([callback], max_steps=1).fit(LitGPT(), token_loader())
    chosen = callback.chosen_plan
    assert chosen.fits and chosen.checkpoint and chosen.offload is None
    assert chosen.predicted_total_bytes <= budget


def test_plan_auto_stops_before_the_forward_when_its_plan_needs_offload_optimizer_that_is_off(monkeypatch):
    # The plan fits only with model state on the host; this fit keeps it on the device, so the
    # plan's peak is not what it would reach: no silent no-fit (issue 37).
    from lightmem import PlanDoesNotFit, fit_session
    from lightmem.estimate.planning.result import Plan

    def needs_model_state_offload(model, batch, budget, **kwargs):
        return Plan([], None, 1, 0, budget, True, "with offload_optimizer", offload_optimizer=True)

    monkeypatch.setattr(fit_session, "plan", needs_model_state_offload)
    callback = LightMem(plan="auto", device_budget="1GiB", offload_devices=["cpu"])
    with pytest.raises(PlanDoesNotFit) as error:
        cpu_trainer([callback], max_steps=1).fit(LitGPT(), token_loader())
    assert str(error.value) == (
        "lightmem: plan='auto' fits the 1.00 GiB device budget for batches of [4, 33] only with gradients and "
        "optimizer state on the host, which this fit keeps on the device: set LightMem(offload_optimizer=True). "
        "Training stopped before this batch's forward."
    )


def test_offload_scope_in_the_plan_log_line():
    from lightmem.config import OffloadSettings
    from lightmem.fit_lines import offload_scope

    settings = OffloadSettings.parse()
    assert offload_scope(None) == "nothing"
    assert offload_scope(settings) == "everywhere"
    assert offload_scope(settings.with_choice(min_bytes=0, include=("blocks.0",))) == "['blocks.0']"
