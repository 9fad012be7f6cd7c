"""The CUDA probes and the max over ranks, on CPU: torch.cuda, NVML and torch.distributed faked."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightmem.metrics.recorder import max_over_ranks
from lightmem.metrics.names import GiB, key
from lightmem.metrics.probes import NvmlProbe, ProbeUnavailable, TorchAllocatorProbe
from lightmem.metrics.ranks import RankMax

GPU_A = "aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "bbbbbbbb-0000-0000-0000-000000000000"
MIG_B1 = "b1b1b1b1-0000-0000-0000-000000000000"


class FakeNvml(types.ModuleType):
    """pynvml over two GPUs; GPU B carries one MIG instance. Handles are names; memory is per name."""

    class NVMLError(Exception):
        pass

    def __init__(self, accept_mig_uuid: bool = True) -> None:
        super().__init__("pynvml")
        self.gpus = {f"GPU-{GPU_A}": [], f"GPU-{GPU_B}": [f"MIG-{MIG_B1}"]}
        self.accept_mig_uuid = accept_mig_uuid
        self.total = {f"GPU-{GPU_A}": 80 * GiB, f"GPU-{GPU_B}": 40 * GiB, f"MIG-{MIG_B1}": 10 * GiB}
        self.by_index_calls: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        known = set(self.gpus) | ({m for migs in self.gpus.values() for m in migs} if self.accept_mig_uuid else set())
        if uuid not in known:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.by_index_calls.append(index)
        return list(self.gpus)[index]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 2

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> str:
        migs = self.gpus[handle]
        if index >= len(migs):
            raise self.NVMLError("Not Found")
        return migs[index]

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return handle.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=GiB, total=self.total[handle])


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA that reports ``uuids[i]`` for visible device i, like torch does under CUDA_VISIBLE_DEVICES."""

    def install(uuids: list[str]):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid=uuids[index])
        )

    return install


def _nvml(monkeypatch, **kwargs) -> FakeNvml:
    nvml = FakeNvml(**kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def test_nvml_device_is_found_by_uuid_when_cuda_visible_devices_reorders_gpus(monkeypatch, fake_cuda):
    # CUDA_VISIBLE_DEVICES=GPU-B: CUDA's device 0 is NVML's device 1.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"GPU-{GPU_B}")
    fake_cuda([GPU_B])
    nvml = _nvml(monkeypatch)
    probe = NvmlProbe(torch.device("cuda", 0))
    assert probe.collect()[key("device/total_GiB")] == 40.0
    assert nvml.by_index_calls == []


def test_nvml_device_of_a_mig_instance_is_the_instance(monkeypatch, fake_cuda):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"MIG-{MIG_B1}")
    fake_cuda([MIG_B1])
    _nvml(monkeypatch)
    assert NvmlProbe(torch.device("cuda")).collect()[key("device/total_GiB")] == 10.0


def test_mig_instance_is_found_by_listing_when_nvml_rejects_its_uuid(monkeypatch, fake_cuda):
    fake_cuda([MIG_B1])
    _nvml(monkeypatch, accept_mig_uuid=False)
    assert NvmlProbe(torch.device("cuda", 0)).collect()[key("device/total_GiB")] == 10.0


def test_unknown_uuid_switches_the_group_off_instead_of_guessing_an_index(monkeypatch, fake_cuda):
    unknown = "cccccccc-0000-0000-0000-000000000000"
    fake_cuda([unknown])
    _nvml(monkeypatch)
    with pytest.raises(ProbeUnavailable) as error:
        NvmlProbe(torch.device("cuda", 0))
    assert str(error.value) == f"NVML lists no GPU or MIG instance with the UUID {unknown} that CUDA reports"


def _fake_allocator(monkeypatch) -> list[torch.device]:
    resets: list[torch.device] = []
    stats = {"allocated_bytes.all.current": GiB, "allocated_bytes.all.peak": 3 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    return resets


def test_allocator_probe_leaves_the_users_max_memory_allocated_alone(monkeypatch):
    resets = _fake_allocator(monkeypatch)
    probe = TorchAllocatorProbe(torch.device("cuda", 0))
    for _ in range(3):
        values = probe.collect()
        probe.end_step()
    assert resets == []
    assert values[key("gpu/step_peak_allocated_GiB")] == 3.0


def test_allocator_probe_resets_the_peak_each_step_only_when_asked(monkeypatch):
    resets = _fake_allocator(monkeypatch)
    probe = TorchAllocatorProbe(torch.device("cuda", 0), reset_peak=True)
    probe.collect()
    probe.end_step()
    assert resets == [torch.device("cuda", 0)]


@pytest.fixture
def fake_nccl_job(monkeypatch):
    """A two-rank job whose default group is NCCL; the other rank reports 5.0 for every figure."""
    calls = SimpleNamespace(new_group=[], all_reduce=[])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")

    def new_group(backend=None):
        calls.new_group.append(backend)
        return f"gloo-group-{len(calls.new_group)}"

    def all_reduce(tensor, op=None, group=None):
        calls.all_reduce.append((tensor.device.type, tensor.dtype, op, group))
        tensor.clamp_(min=5.0)

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_max_over_ranks_reduces_cpu_tensors_over_one_gloo_group(fake_nccl_job):
    rank_max = RankMax()
    assert rank_max([1.0, 7.0]) == [5.0, 7.0]
    assert rank_max([2.0, 3.0]) == [5.0, 5.0]
    assert fake_nccl_job.new_group == ["gloo"]
    assert fake_nccl_job.all_reduce == [("cpu", torch.float64, dist.ReduceOp.MAX, "gloo-group-1")] * 2


def test_max_over_ranks_never_builds_a_device_tensor(fake_nccl_job, monkeypatch):
    built_on: list[str] = []
    original = torch.tensor

    def spy(*args, **kwargs):
        tensor = original(*args, **kwargs)
        built_on.append(tensor.device.type)
        return tensor

    monkeypatch.setattr(torch, "tensor", spy)
    rss, pinned = key("host/rss_GiB"), key("host/pinned_GiB")
    reduced = max_over_ranks({rss: 1.0, pinned: 9.0}, RankMax())
    assert reduced == {rss: 5.0, pinned: 9.0}
    assert built_on == ["cpu"]
