"""The host memory guard: limit discovery and usage on fake cgroup files, the decision, the callback's flags."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from lit_models import LitGPT, token_loader

from lightmem import LightMem
from lightmem.host_guard import HostGuard, HostLimit, cgroup_usage_bytes, discover_limit
from lightmem.metrics.names import key

GiB = 1024**3
MiB = 1024**2
RAM = 64 * GiB
V1_NO_LIMIT = "9223372036854771712"


def _write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _fake_v1(tmp_path, limits: dict[str, str], inner: str = "/jobs/train", root: str = "/"):
    mount = tmp_path / "memory"
    for directory, limit in limits.items():
        _write(mount / directory / "memory.limit_in_bytes", limit + "\n")
    proc = _write(tmp_path / "cgroup", f"12:cpu,cpuacct:/\n4:memory:{inner}\n0::/\n")
    mountinfo = _write(
        tmp_path / "mountinfo",
        "23 1 0:21 / /proc rw - proc proc rw\n"
        f"35 31 0:32 {root} {mount} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n",
    )
    return proc, mountinfo, mount


def _fake_v2(tmp_path, limits: dict[str, str], inner: str = "/job.slice/train"):
    mount = tmp_path / "cgroup2"
    for directory, limit in limits.items():
        _write(mount / directory / "memory.max", limit + "\n")
    proc = _write(tmp_path / "cgroup", f"0::{inner}\n")
    mountinfo = _write(tmp_path / "mountinfo", f"31 23 0:27 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    return proc, mountinfo, mount


def test_v1_limit_of_the_process_cgroup_and_usage_less_inactive_file_cache(tmp_path):
    proc, mountinfo, mount = _fake_v1(tmp_path, {"": V1_NO_LIMIT, "jobs": V1_NO_LIMIT, "jobs/train": str(3 * GiB)})
    _write(mount / "jobs/train/memory.usage_in_bytes", f"{2 * GiB}\n")
    _write(mount / "jobs/train/memory.stat", f"cache 5\ninactive_file 7\ntotal_cache 9\ntotal_inactive_file {256 * MiB}\n")
    limit = discover_limit(proc, mountinfo, ram_bytes=RAM)
    train = mount / "jobs/train"
    assert limit == HostLimit(
        3 * GiB, f"cgroup v1 {train / 'memory.limit_in_bytes'}", str(train / "memory.usage_in_bytes"),
        str(train / "memory.stat"), "total_inactive_file",
    )  # fmt: skip
    assert cgroup_usage_bytes(limit) == 2 * GiB - 256 * MiB


def test_v1_limit_set_on_an_ancestor_applies_with_the_ancestor_usage(tmp_path):
    proc, mountinfo, mount = _fake_v1(tmp_path, {"": V1_NO_LIMIT, "jobs": str(GiB), "jobs/train": V1_NO_LIMIT})
    limit = discover_limit(proc, mountinfo, ram_bytes=RAM)
    assert (limit.limit_bytes, limit.usage_file) == (GiB, str(mount / "jobs" / "memory.usage_in_bytes"))


def test_v1_inside_a_container_whose_cgroup_is_the_mount_root(tmp_path):
    proc, mountinfo, mount = _fake_v1(tmp_path, {"": str(512 * MiB)}, inner="/docker/abc", root="/docker/abc")
    limit = discover_limit(proc, mountinfo, ram_bytes=RAM)
    assert (limit.limit_bytes, limit.usage_file) == (512 * MiB, str(mount / "memory.usage_in_bytes"))


def test_v2_tightest_of_the_cgroup_and_its_ancestors_and_max_means_none(tmp_path):
    proc, mountinfo, mount = _fake_v2(tmp_path, {"": "max", "job.slice": str(2 * GiB), "job.slice/train": "max"})
    _write(mount / "job.slice/memory.current", f"{GiB}\n")
    _write(mount / "job.slice/memory.stat", f"anon 4096\nfile {300 * MiB}\ninactive_file {100 * MiB}\nactive_file 2\n")
    limit = discover_limit(proc, mountinfo, ram_bytes=RAM)
    assert limit == HostLimit(
        2 * GiB, f"cgroup v2 {mount / 'job.slice' / 'memory.max'}", str(mount / "job.slice/memory.current"),
        str(mount / "job.slice/memory.stat"), "inactive_file",
    )  # fmt: skip
    assert cgroup_usage_bytes(limit) == GiB - 100 * MiB


def test_max_everywhere_means_total_ram(tmp_path):
    proc, mountinfo, _ = _fake_v2(tmp_path, {"": "max", "job.slice": "max", "job.slice/train": "max"})
    assert discover_limit(proc, mountinfo, ram_bytes=RAM) == HostLimit(RAM, "total RAM")


def test_no_cgroup_files_means_total_ram(tmp_path):
    missing = str(tmp_path / "absent")
    assert discover_limit(missing, missing, ram_bytes=RAM) == HostLimit(RAM, "total RAM")


def test_ram_wins_when_it_is_tighter_than_the_cgroup_limit(tmp_path):
    proc, mountinfo, _ = _fake_v1(tmp_path, {"": V1_NO_LIMIT, "jobs": V1_NO_LIMIT, "jobs/train": str(128 * GiB)})
    assert discover_limit(proc, mountinfo, ram_bytes=RAM) == HostLimit(RAM, "total RAM")


def _guard_on_fake_cgroup(tmp_path, warn_at=0.85, stop_at=0.95):
    proc, mountinfo, mount = _fake_v1(tmp_path, {"": V1_NO_LIMIT, "jobs": V1_NO_LIMIT, "jobs/train": str(1000 * MiB)})
    _write(mount / "jobs/train/memory.stat", "total_inactive_file 0\n")
    guard = HostGuard(discover_limit(proc, mountinfo, ram_bytes=RAM), warn_at, stop_at)

    def at(usage_mib: int) -> str:
        _write(mount / "jobs/train/memory.usage_in_bytes", str(usage_mib * MiB))
        return guard.check()

    return guard, at


def test_warns_once_at_warn_at_then_stops_one_batch_before_stop_at(tmp_path):
    guard, at = _guard_on_fake_cgroup(tmp_path)
    assert [at(mib) for mib in (800, 820, 840, 860, 880, 900)] == ["ok", "ok", "ok", "warn", "ok", "ok"]
    assert guard.growth_per_batch_bytes() == 20 * MiB
    assert guard.batches_left(0.95) == 2
    # 930 MiB + 20 MiB of growth reaches 950 MiB (95%): the next batch would cross, so stop now.
    assert at(930) == "stop"


def test_no_stop_at_only_warns(tmp_path):
    guard, at = _guard_on_fake_cgroup(tmp_path, stop_at=None)
    assert [at(mib) for mib in (900, 990, 999)] == ["warn", "ok", "ok"]


def test_messages_say_what_holds_memory_its_growth_and_how_to_resume(tmp_path):
    guard, at = _guard_on_fake_cgroup(tmp_path)
    for mib in (700, 750, 800, 850, 900):
        at(mib)
    warning = guard.warning_message().splitlines()
    assert warning[0] == (
        "lightmem: host memory passed host_warn_at (85% of its limit); LightMem stops training cleanly at 95% "
        "in about 1 batch at this rate."
    )
    assert warning[1] == (
        f"host memory in use: 900.00 MiB of 1000.00 MiB (90%; limit from cgroup v1 "
        f"{tmp_path / 'memory/jobs/train/memory.limit_in_bytes'})"
    )
    assert warning[2].startswith("  this process (RSS):")
    assert warning[3].startswith("  DataLoader workers (RSS):   0 B in 0 processes")
    assert warning[4] == "  lightmem host buffers:      0 B"
    assert warning[5] == "  growth per training batch:  50.00 MiB (mean of the last 4 batches)"
    stop = guard.stop_message("/runs/lightmem-host-stop.ckpt").splitlines()
    assert stop[0].startswith("lightmem: training stopped cleanly: host memory reached host_stop_at (95% of its limit)")
    assert stop[6] == (
        "A checkpoint was saved to /runs/lightmem-host-stop.ckpt. Resume with "
        "trainer.fit(model, ckpt_path='/runs/lightmem-host-stop.ckpt') once the memory growth is fixed or the limit raised."
    )


def test_without_a_cgroup_usage_is_this_process_and_its_children_rss():
    guard = HostGuard(64 * GiB, 0.85, 0.95)
    assert guard.limit == HostLimit(64 * GiB, "host_limit")
    page = os.sysconf("SC_PAGE_SIZE")
    worker = subprocess.Popen(["sleep", "30"])
    try:
        # Read the child's RSS once it sleeps: while it is still being exec'd, its RSS moves.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, "the child process never went to sleep"
            time.sleep(0.01)
        worker_rss = int(Path(f"/proc/{worker.pid}/statm").read_text().split()[1]) * page
        assert guard.workers_rss_bytes() == worker_rss  # exactly this child's: no other process counted
        usage = guard.usage_bytes()
        own = int(Path("/proc/self/statm").read_text().split()[1]) * page
        # This process's RSS moves between two reads (allocator trims, other threads): within 4 MiB.
        assert abs(usage - (own + worker_rss)) <= 4 * MiB
    finally:
        worker.kill()
        worker.wait()
    assert guard.workers_rss_bytes() == 0
    guard.close()


# -- the callback's flags ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"metrics": 5}, "LightMem(metrics=...): expected a list of probe groups from gpu, device, host, lightmem; got 5"),
        ({"host_limit": "lots"}, "LightMem(host_limit=...): expected 'auto' (cgroup limit or total RAM), a byte count (int), or a string such as"),
        ({"host_warn_at": 1.5}, "LightMem(host_warn_at=...): expected a fraction in (0, 1], e.g. 0.9; got 1.5"),
        ({"host_stop_at": "95%"}, "LightMem(host_stop_at=...): expected a fraction in (0, 1], e.g. 0.9, or None; got '95%'"),
        ({"host_stop_at": 0.5}, "LightMem(host_stop_at=...): must be >= host_warn_at (0.85); got 0.5"),
        ({"host_stop_checkpoint": 3}, "LightMem(host_stop_checkpoint=...): expected a file path or None; got 3"),
    ],
)
def test_bad_flags_fail_at_construction_naming_the_flag(flags, message):
    with pytest.raises(ValueError) as error:
        LightMem(**flags)
    assert str(error.value).startswith(message)


def test_host_limit_accepts_auto_a_size_or_a_fraction_of_ram():
    assert LightMem().settings.host_guard.limit_bytes is None
    assert LightMem(host_limit="2GiB").settings.host_guard.limit_bytes == 2 * GiB
    assert LightMem(host_limit=1.0).settings.host_guard.limit_bytes == discover_limit(ram_bytes=None, proc_cgroup="/absent").limit_bytes


def _fit(tmp_path, callback, max_steps=4):
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, callbacks=[callback], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(LitGPT(), token_loader())
    return trainer


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_over_the_limit_the_fit_saves_a_checkpoint_and_returns(tmp_path, capsys):
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, host_limit="1MiB")
    trainer = _fit(tmp_path, callback)
    assert trainer.global_step == 1 and trainer.should_stop
    ckpt = tmp_path / "lightmem-host-stop.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == 1
    assert f"Resume with trainer.fit(model, ckpt_path={str(ckpt)!r})" in capsys.readouterr().err


def test_with_host_stop_at_none_it_warns_once_and_trains_on(tmp_path):
    with pytest.warns(UserWarning, match=r"host memory passed host_warn_at \(85% of its limit\); the OOM killer") as record:
        trainer = _fit(tmp_path, LightMem(host_limit="1MiB", host_stop_at=None))
    assert trainer.global_step == 4
    assert sum("host_warn_at" in str(w.message) for w in record) == 1
    assert not (tmp_path / "lightmem-host-stop.ckpt").exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_host_limit_metrics_are_logged(tmp_path):
    callback = LightMem(host_limit="3GiB", metrics=["host"])
    _fit(tmp_path, callback, max_steps=1)
    metrics = callback.last_metrics
    assert metrics[key("host/limit_GiB")] == 3.0
    assert 0 < metrics[key("host/headroom_GiB")] < 3.0
    assert metrics[key("host/workers_rss_GiB")] == 0.0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_after_fit_the_callback_pickles_and_deep_copies(tmp_path):
    callback = LightMem(offload_devices=["cpu"], offload_min_bytes=0, checkpoint=["Block"])
    _fit(tmp_path, callback, max_steps=2)
    restored = pickle.loads(pickle.dumps(callback))
    copied = copy.deepcopy(callback)
    for other in (restored, copied):
        assert other.settings == callback.settings
        assert other.summary() == callback.summary()
        assert other.last_metrics == callback.last_metrics


def test_batches_loaded_ahead_by_dataloader_workers():
    from lightmem.host_guard import batches_loaded_ahead

    data = list(range(8))
    loader = torch.utils.data.DataLoader
    assert batches_loaded_ahead(loader(data)) == 0
    assert batches_loaded_ahead(loader(data, num_workers=2)) == 4
    assert batches_loaded_ahead({"a": loader(data, num_workers=3, prefetch_factor=3), "b": [loader(data, num_workers=1)]}) == 11


def test_the_stop_looks_ahead_over_the_batches_workers_load_in_advance(tmp_path):
    guard, at = _guard_on_fake_cgroup(tmp_path)
    guard.batches_ahead = 4
    assert [at(mib) for mib in (700, 720, 740, 760, 780, 800)] == ["ok", "ok", "ok", "ok", "ok", "ok"]
    # 820 MiB + (1 + 4) x 20 MiB reaches 920 MiB, under 950 MiB; 840 MiB + 100 MiB does not either;
    # 860 MiB + 100 MiB = 960 MiB passes it.
    assert [at(820), at(840), at(860)] == ["ok", "ok", "stop"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_callback_tells_the_guard_how_far_workers_load_ahead(tmp_path):
    seen = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(callback.fit_session.host_guard.batches_ahead)

    callback = LightMem(metrics=["host"])
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, callbacks=[callback, Probe()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    loader = token_loader()
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(loader.dataset, batch_size=4, num_workers=1, prefetch_factor=3))
    assert seen == [3]
