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
