"""One flag, one meaning: each flag is parsed once (lightmem/config/) into the settings that the
callback, the functions, the estimator/planner and the CLI all use; empty lists that would switch
a feature off, and flags without the partner they need, are errors that name the flags."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from models import TinyGPT, gpt_loss

from lightmem import LightMem, apply_checkpointing, estimate_memory, offload_activations, plan
from lightmem.cli import main
from lightmem.config import LIGHTMEM, OFFLOAD_ACTIVATIONS, OffloadSettings, OptimizerOffloadSettings
from lightmem.config.estimator import parse_offload
from lightmem.estimate.pricing.costs import WINDOW_GRAIN_BYTES

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _tokens(batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 33), generator=torch.Generator().manual_seed(0))


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    return str(error.value)


# -- the estimator parses offload flags as the engine does -------------------------------------


def _engine_view(settings: OffloadSettings) -> OffloadSettings:
    """Everything but the host-side figures (the estimator's target host is not this one)."""
    return replace(settings, host_budget=None, host_budget_bytes=None, host_min_available_bytes=0, spelling=OFFLOAD_ACTIVATIONS)


def test_the_estimators_offload_defaults_are_the_engines():
    assert _engine_view(parse_offload(True, flag="estimate_memory(offload=...)")) == _engine_view(OffloadSettings.parse())


def test_the_estimator_parses_an_offload_dict_with_the_engines_parser():
    flags = {"min_bytes": "64KiB", "exclude": "lm_head", "prefetch": "1MiB", "max_inflight_bytes": 0}
    estimated = parse_offload(flags, flag="estimate_memory(offload=...)")
    assert _engine_view(estimated) == _engine_view(OffloadSettings.parse(**flags))
    assert (estimated.min_bytes, estimated.exclude, estimated.host_budget_bytes) == (64 * 1024, ("lm_head",), None)


def test_the_callback_and_offload_activations_parse_the_same_flags_into_the_same_settings():
    callback = LightMem(
        offload_min_bytes="2MiB", offload_devices=["cpu"], offload_exclude=["lm_head"], host_budget="1GiB",
        prefetch_bytes="8MiB", offload_max_inflight_bytes=0, host_min_available="1GiB",
    )  # fmt: skip
    function = offload_activations(
        TinyGPT(), min_bytes="2MiB", devices=["cpu"], exclude=["lm_head"], host_budget="1GiB", prefetch="8MiB",
        max_inflight_bytes=0, host_min_available="1GiB",
    )  # fmt: skip
    assert replace(callback.settings.offload, spelling=OFFLOAD_ACTIVATIONS) == function.settings
    assert callback.settings.offload.flag("exclude") == "LightMem(offload_exclude=...)"
    assert function.settings.flag("exclude") == "offload_activations(exclude=...)"


def test_settings_already_parsed_reach_the_estimator_unchanged():
    settings = LightMem(offload_min_bytes="2MiB", offload_devices=["cpu"]).settings.offload
    assert parse_offload(settings, flag="estimate_memory(offload=...)") is settings


# -- empty lists --------------------------------------------------------------------------------


def test_an_empty_offload_include_is_refused_by_every_entry_point():
    hint = "an empty list offloads nothing; leave it unset (None) to offload in every module, or name the modules to offload in"
    assert _error(LightMem, offload_include=[]) == f"LightMem(offload_include=...): {hint}"
    assert _error(offload_activations, TinyGPT(), include=[]) == f"offload_activations(include=...): {hint}"
    assert _error(estimate_memory, TinyGPT(), _tokens(), gpt_loss, device="cpu", offload={"include": []}) == (
        f"estimate_memory(offload=...)['include']: {hint}"
    )


def test_an_empty_checkpoint_list_is_refused_as_apply_checkpointing_refuses_it():
    rule = "expected at least one class name, class or module-name pattern; an empty list checkpoints nothing"
    assert _error(apply_checkpointing, TinyGPT(), []) == f"apply_checkpointing(targets=...): {rule}"
    assert _error(LightMem, checkpoint=[]) == f"LightMem(checkpoint=...): {rule}"
    assert _error(estimate_memory, TinyGPT(), _tokens(), gpt_loss, device="cpu", checkpoint=[]) == (
        f"estimate_memory(checkpoint=...): {rule}"
    )


def test_an_empty_offload_exclude_excludes_nothing():
    assert LightMem(offload_exclude=[]).settings.offload.exclude is None


# -- flags without their partner -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"device_budget": "8GiB"},
            "LightMem(device_budget=...): has no effect without LightMem(plan='auto'); set plan='auto' or leave "
            "device_budget unset",
        ),
        (
            {"checkpoint_policy": "save_matmuls"},
            "LightMem(checkpoint_policy=...): has no effect without LightMem(checkpoint=...) or LightMem(plan=...); "
            "name the blocks to checkpoint or leave checkpoint_policy unset",
        ),
        (
            {"checkpoint_every": 2},
            "LightMem(checkpoint_every=...): has no effect without LightMem(checkpoint=...); name the blocks to "
            "checkpoint or leave checkpoint_every unset",
        ),
        (
            {"plan": "auto", "device_budget": "8GiB", "checkpoint_every": 2},
            "LightMem(checkpoint_every=...): has no effect without LightMem(checkpoint=...); name the blocks to "
            "checkpoint or leave checkpoint_every unset",
        ),
        (
            {"host_stop_at": None, "host_stop_checkpoint": "stop.ckpt"},
            "LightMem(host_stop_checkpoint=...): has no effect while host_stop_at is None (the guard only warns, "
            "nothing is saved); set host_stop_at or leave host_stop_checkpoint unset",
        ),
    ],
    ids=["device_budget", "checkpoint_policy", "checkpoint_every", "checkpoint_every-with-plan", "host_stop_checkpoint"],
)
def test_a_flag_without_its_partner_is_an_error_naming_both(kwargs, message):
    assert _error(LightMem, **kwargs) == message


def test_a_checkpoint_policy_serves_a_plan_too():
    settings = LightMem(plan="auto", device_budget="8GiB", checkpoint_policy="save_matmuls").settings
    assert (settings.checkpoint.targets, settings.checkpoint.policy, settings.plan.device_budget_bytes) == (
        None, "save_matmuls", 8 * 2**30
    )  # fmt: skip


# -- the planner and the CLI honour the same flags -------------------------------------------------


def test_a_plan_offloads_under_the_given_threshold_and_exclusions():
    base = estimate_memory(TinyGPT(), _tokens(16), gpt_loss, device="cuda", overhead_bytes=0)
    budget = base.static_bytes + (base.reserved_bytes - base.static_bytes) * 7 // 10
    offload = {"min_bytes": "16KiB", "exclude": ["lm_head"]}
    result = plan(
        TinyGPT(), _tokens(16), budget, gpt_loss, device="cuda", overhead_bytes=0, offload=offload,
        link_bytes_per_s="1000TB",  # a link so fast that offload is free: the plan offloads
    )  # fmt: skip
    # The windows are sized to what the link moves while a block computes, at most what a block
    # sends: on so fast a link, a block's offloaded bytes (rounded up to 64 KiB).
    windows = {"prefetch": result.offload.prefetch_bytes, "max_inflight_bytes": result.offload.max_inflight_bytes}
    block_sent = 2_719_744  # each Block's saved tensors of at least 16 KiB
    assert windows["prefetch"] == windows["max_inflight_bytes"] == -(-block_sent // WINDOW_GRAIN_BYTES) * WINDOW_GRAIN_BYTES
    assert result.settings["offload"] == {
        "min_bytes": 16 * 1024, "include": None, "exclude": ["lm_head"], **windows, "host_budget": None
    }  # fmt: skip
    assert result.fits and result.checkpoint == []
    assert (result.offload.include, result.offload.min_bytes, result.offload.exclude) == (
        ("blocks.0", "blocks.1", "blocks.2"), 16 * 1024, ("lm_head",)
    )  # fmt: skip
    assert result.lightmem_kwargs() == {
        "offload": True, "offload_min_bytes": 16 * 1024, "offload_include": ["blocks.0", "blocks.1", "blocks.2"],
        "offload_exclude": ["lm_head"], "prefetch_bytes": windows["prefetch"], "offload_max_inflight_bytes": windows["prefetch"],
    }  # fmt: skip


def test_a_plan_refuses_an_include_it_would_override():
    message = _error(plan, TinyGPT(), _tokens(), "1GiB", gpt_loss, device="cpu", offload={"include": ["blocks.0"]})
    assert message == "plan(offload=...)['include']: the plan chooses the modules to offload itself; leave it unset"


def _estimate(capsys, *flags):
    argv = ["estimate", "examples.estimate_factories:tiny_gpt", "--batch-size", "2", *flags]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        status = main(argv)
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_plan_json_reports_the_settings_it_searched_under_equal_to_the_flags(capsys):
    status, out, _ = _estimate(
        capsys, "--device", "cuda", "--overhead", "0", "--budget", "1GiB", "--precision", "bf16-mixed",
        "--optimizer", "sgd", "--offload-min-bytes", "64KiB", "--offload-exclude", "lm_head", "blocks.3",
        "--checkpoint-policy", "save_matmuls", "--plan", "--json",
    )  # fmt: skip
    assert status == 0
    searched = json.loads(out)["plan"]["settings"]
    assert {name: searched[name] for name in ("device", "precision", "optimizer", "overhead_bytes", "budget_bytes")} == {
        "device": "cuda", "precision": "bf16-mixed", "optimizer": "sgd", "overhead_bytes": 0, "budget_bytes": 2**30,
    }  # fmt: skip
    assert searched["checkpoint_policy"] == "save_matmuls"
    windows = {name: searched["offload"].pop(name) for name in ("prefetch", "max_inflight_bytes")}
    assert searched["offload"] == {
        "min_bytes": 64 * 1024, "include": None, "exclude": ["lm_head", "blocks.3"], "host_budget": None,
    }  # fmt: skip
    # The windows are the plan's, sized to what the link moves while a block computes.
    assert all(size >= WINDOW_GRAIN_BYTES and size % WINDOW_GRAIN_BYTES == 0 for size in windows.values())
    assert searched["offload_considered"] is True
    assert searched["offload_optimizer"] is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--checkpoint-policy", "save_matmuls"],
            "lightmem estimate: error: --checkpoint-policy: has no effect without --checkpoint, --plan or --frontier; "
            "name the blocks to checkpoint or leave --checkpoint-policy unset\n",
        ),
        (
            ["--checkpoint", "blocks.*", "--checkpoint-policy", "matmuls"],
            "lightmem estimate: error: --checkpoint-policy: expected 'full' (recompute the whole block), "
            "'save_matmuls' (keep matmul, convolution and attention outputs, recompute the rest), or a callable "
            "(ctx, op, *args, **kwargs) -> CheckpointPolicy or bool; got 'matmuls'\n",
        ),
        (
            ["--budget", "1GiB", "--plan", "--offload-include", "blocks.0"],
            "lightmem estimate: error: --offload-include: the plan chooses the modules to offload itself; leave it unset\n",
        ),
        (
            ["--offload-exclude", "blokcs"],
            "lightmem estimate: error: --offload-exclude: 'blokcs' matches no module of the model; closest names: "
            "blocks, blocks.3, blocks.2, blocks.1, blocks.0\n",
        ),
    ],
    ids=["policy-without-checkpoint", "unknown-policy", "include-with-plan", "exclude-typo"],
)
def test_cli_flag_errors_name_the_flags_as_typed(capsys, flags, message):
    status, _, err = _estimate(capsys, "--device", "cpu", *flags)
    assert (status, err) == (2, message)


# -- optimizer offload: one settings object for the callback, the function and the estimator ----


def test_the_callback_parses_offload_optimizer_into_settings_that_name_its_flags():
    assert LightMem().settings.optimizer_offload is None
    settings = LightMem(offload_optimizer=True, offload_devices=["cpu"], offload_max_inflight_bytes="1MiB").settings
    assert settings.optimizer_offload == replace(
        OptimizerOffloadSettings.parse(devices=("cpu",), max_grad_inflight_bytes=2**20, spelling=LIGHTMEM),
        overlap_step="auto",  # the callback's default: decided per fit
    )
    fields = ("enabled", "devices", "max_grad_inflight_bytes", "overlap_step", "device_dtype")
    assert [settings.optimizer_offload.flag(field) for field in fields] == [
        "LightMem(offload_optimizer=...)", "LightMem(offload_devices=...)", "LightMem(offload_max_inflight_bytes=...)",
        "LightMem(offload_overlap_step=...)", "LightMem(offload_optimizer_device_dtype=...)",
    ]  # fmt: skip
    assert settings.optimizer_offload.device_dtype is None  # off unless asked for: not exact


def test_the_function_is_its_own_switch_in_messages():
    settings = OptimizerOffloadSettings.parse(devices="cpu")
    assert (settings.flag("enabled"), settings.flag("devices")) == ("offload_optimizer", "offload_optimizer(devices=...)")
    message = _error(OptimizerOffloadSettings.parse, max_grad_inflight_bytes="lots")
    assert message.startswith("offload_optimizer(max_grad_inflight_bytes=...): expected a byte count")


def test_the_estimator_waits_on_the_gradients_the_given_settings_allow():
    def gradients_on_device(offload_optimizer):
        estimate = estimate_memory(
            TinyGPT(), _tokens(), gpt_loss, device="cuda", overhead_bytes=0, offload_optimizer=offload_optimizer
        )
        return estimate.scenarios["offload_optimizer"].breakdown["gradients"]

    default = gradients_on_device(True)
    assert default == gradients_on_device(OptimizerOffloadSettings.parse())
    assert gradients_on_device(OptimizerOffloadSettings.parse(max_grad_inflight_bytes=0)) < default
