"""LightMem's distributed rules that need no second process: host shares per node, one OOM snapshot
per rank, and what it does under FSDPStrategy (FSDP1) and DeepSpeed (fakes of the strategy objects)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lit_models import LitGPT
from models import Block
from pytorch_lightning.strategies import FSDPStrategy

import lightmem.config.units
from lightmem import LightMem, oom, offload_activations
from lightmem.checkpoint import existing_checkpointing, is_checkpointed
from lightmem.fit_session import FitSession
from lightmem.offload.context import ActivationOffloader

GiB = 1024**3


@pytest.fixture
def eight_gib_available(monkeypatch):
    monkeypatch.setattr(lightmem.config.units, "available_ram_bytes", lambda: 8 * GiB)


@pytest.mark.parametrize(("ranks", "expected"), [(None, 4 * GiB), ("1", 4 * GiB), ("4", GiB), ("8", GiB // 2)])
def test_fractional_host_budget_is_shared_by_the_ranks_of_a_node(monkeypatch, eight_gib_available, ranks, expected):
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert offload_activations(host_budget=0.5, devices=("cpu",)).host_budget_bytes == expected
    assert offload_activations(host_budget="50%", devices=("cpu",)).host_budget_bytes == expected
    assert LightMem(host_budget=0.5).host_budget_bytes == expected


def test_absolute_host_budget_is_per_process(monkeypatch, eight_gib_available):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert offload_activations(host_budget="2GiB", devices=("cpu",)).host_budget_bytes == 2 * GiB
    assert LightMem(host_budget="2GiB").host_budget_bytes == 2 * GiB


def test_lightning_callback_shares_host_budget_by_the_trainers_devices_per_node(monkeypatch, eight_gib_available):
    # Lightning's launcher sets no LOCAL_WORLD_SIZE: the Trainer's devices per node decide.
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    callback = LightMem(host_budget=0.5)
    assert callback.host_budget_bytes == 4 * GiB
    callback.setup(SimpleNamespace(num_devices=4), LitGPT(), "fit")
    assert callback.host_budget_bytes == GiB


def test_host_min_available_is_a_node_wide_floor_not_divided(monkeypatch):
    # Every rank compares the node's available RAM with it, so it is already shared.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(lightmem.config.units, "total_ram_bytes", lambda: 10 * GiB)
    assert offload_activations(host_min_available=0.1, devices=("cpu",)).host_min_available_bytes == GiB


# -- oom_snapshot ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "world", "expected"),
    [(0, 1, "runs/oom.pickle"), (0, 2, "runs/oom.rank0.pickle"), (3, 8, "runs/oom.rank3.pickle")],
)
def test_snapshot_file_names_the_rank_when_several_processes_train(rank, world, expected):
    assert oom.snapshot_path("runs/oom.pickle", rank, world) == expected


def test_memory_history_records_python_stacks_and_each_rank_dumps_its_own_file(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    assert oom.record_memory_history() is True
    assert oom.dump_snapshot("oom.pickle", 1, 2) == "oom.rank1.pickle"
    oom.stop_memory_history()
    assert calls == [
        ("record", {"max_entries": oom.HISTORY_ENTRIES, "stacks": "python"}),
        ("dump", "oom.rank1.pickle"),
        ("record", {"enabled": None}),
    ]


def test_without_cuda_no_history_is_recorded_and_no_snapshot_written(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert oom.record_memory_history() is False
    assert oom.dump_snapshot("oom.pickle", 0, 2) is None


# -- FSDPStrategy (FSDP1) and DeepSpeed -------------------------------------------------------------


class DeepSpeedStrategy:
    """The attributes LightMem reads from Lightning's DeepSpeedStrategy (DeepSpeed is not installed)."""

    def __init__(self, activation_checkpointing: dict | None = None) -> None:
        self.config = {"zero_optimization": {"stage": 3}}
        if activation_checkpointing is not None:
            self.config["activation_checkpointing"] = activation_checkpointing


@pytest.mark.parametrize(
    ("strategy", "reason"),
    [
        (FSDPStrategy(activation_checkpointing_policy={Block}), "the FSDPStrategy already checkpoints (activation_checkpointing_policy)"),
        (DeepSpeedStrategy({"partition_activations": True}), "DeepSpeed activation checkpointing is configured"),
        (DeepSpeedStrategy({"cpu_checkpointing": True}), "DeepSpeed activation checkpointing is configured"),
    ],
    ids=["fsdp1-policy", "deepspeed-partition", "deepspeed-cpu"],
)
def test_strategies_that_checkpoint_themselves_are_detected(strategy, reason):
    assert existing_checkpointing(strategy, LitGPT()) == reason


@pytest.mark.parametrize(
    "strategy",
    [FSDPStrategy(), DeepSpeedStrategy(), DeepSpeedStrategy({"partition_activations": False})],
    ids=["fsdp1-plain", "deepspeed-plain", "deepspeed-off"],
)
def test_strategies_without_their_own_checkpointing_leave_it_to_lightmem(strategy):
    assert existing_checkpointing(strategy, LitGPT()) is None


@pytest.mark.parametrize(
    "strategy", [FSDPStrategy(activation_checkpointing_policy={Block}), DeepSpeedStrategy({"partition_activations": True})]
)
def test_lightmem_skips_its_checkpointing_with_one_warning_and_keeps_offload_on(strategy):
    settings = LightMem(checkpoint=["Block"], offload_devices=["cpu"], offload_min_bytes=0).settings
    session = FitSession(settings, SimpleNamespace(num_devices=1))
    module = LitGPT()
    with pytest.warns(UserWarning) as caught:
        session.apply_checkpointing(SimpleNamespace(strategy=strategy), module, ("Block",), 1)
    assert [str(w.message) for w in caught] == [
        f"lightmem: not applying LightMem(checkpoint=['Block']) because {existing_checkpointing(strategy, module)}; "
        "checkpointing twice would recompute twice."
    ]
    assert not any(is_checkpointed(m) for m in module.modules())
    assert isinstance(session.build_offloader(module, session.offload_settings), ActivationOffloader)


def _as_if_sharded(module: torch.nn.Module) -> None:
    """What FSDP2's ``fully_shard`` does to a module's class (an ``FSDP<Name>`` subclass of
    ``FSDPModule``), without its hooks or state: the module trains (and moves) as before."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_apply": cls._apply})


SHARDED_REASON = (
    "the model is sharded by FSDP2 (fully_shard on {names}), and the estimator traces one process's unsharded step: "
    "what a rank holds (its shards, the blocks all-gathered around their forward and backward, the gradients "
    "reduce-scattered) is not modelled yet"
)


def test_the_estimator_refuses_a_model_sharded_by_fsdp2_saying_what_it_does_not_model():
    from lightmem import estimate_memory, max_batch_size, plan
    from models import TinyGPT, gpt_loss

    model, batch, loss = TinyGPT(depth=4), (torch.randint(0, 128, (4, 33)),), lambda m, b: gpt_loss(m, b[0])
    assert estimate_memory(model, batch, loss, device="cpu").peak_bytes > 0  # not sharded: estimated
    for block in model.blocks:
        _as_if_sharded(block)
    _as_if_sharded(model)
    reason = SHARDED_REASON.format(names="the model, blocks.0, blocks.1 and 2 more")
    advice = ". Estimate the model before fully_shard to see one process's unsharded step."
    for call, name in ((lambda: estimate_memory(model, batch, loss, device="cpu"), "estimate_memory"),
                       (lambda: plan(model, batch, "1GiB", loss, device="cpu"), "plan"),
                       (lambda: max_batch_size(model, batch, "1GiB", loss, device="cpu"), "max_batch_size")):  # fmt: skip
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == f"{name}(model=...): {reason}{advice}"


def test_plan_auto_trains_a_model_sharded_by_fsdp2_as_written_without_a_dry_run(lightning_package, monkeypatch, recwarn):
    from exact import assert_same
    from lit_models import cpu_trainer, lit_gpt_class, token_loader

    from lightmem.estimate import steps

    traced = []
    run_step = steps.run_step
    monkeypatch.setattr(steps, "run_step", lambda *args: traced.append(args) or run_step(*args))

    def fit(callbacks):
        torch.manual_seed(0)
        module = lit_gpt_class(lightning_package)()
        for block in module.model.blocks:
            _as_if_sharded(block)
        cpu_trainer(callbacks, lightning_package, max_steps=3).fit(module, token_loader())
        return module

    plain = fit([])
    callback = LightMem(plan="auto", device_budget="4MiB")
    planned = fit([callback])
    assert traced == [] and callback.chosen_plan is None
    assert_same(plain.state_dict(), planned.state_dict(), "state_dict")
    said = [str(w.message) for w in recwarn if str(w.message).startswith("lightmem: plan='auto' does not plan")]
    assert said == [
        "lightmem: plan='auto' does not plan this batch: "
        + SHARDED_REASON.format(names="model.blocks.0, model.blocks.1, model.blocks.2")
        + ". It trains with nothing changed (as written)."
    ]
