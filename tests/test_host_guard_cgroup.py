"""For real: a fit whose host memory grows runs in a fresh memory cgroup with a limit.

Without LightMem the kernel's OOM killer ends it; with ``LightMem()`` at its default flags the fit
returns, the checkpoint exists, and a new fit resumes from it. Each case runs
``tests/host_guard_script.py`` in a child process; the four children run side by side.
Needs root and a writable cgroup v1 memory hierarchy; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lightmem.host_guard import own_cgroups

SCRIPT = Path(__file__).with_name("host_guard_script.py")
ROOT = Path(__file__).resolve().parent.parent
HEADROOM_MIB = 500
CASES = {  # name: (mode, DataLoader workers, MiB kept per step or per loaded item)
    "plain": ("plain", 0, 40),
    "lightmem": ("lightmem", 0, 40),
    "plain_workers": ("plain", 2, 16),
    "lightmem_workers": ("lightmem", 2, 16),
}


def _parent_cgroup() -> str:
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    for version, (directory, *_) in own_cgroups():
        if version == 1:
            if os.access(directory, os.W_OK) and os.path.exists(os.path.join(directory, "memory.limit_in_bytes")):
                return directory
    pytest.skip("no writable cgroup v1 memory hierarchy (a cgroup v2 child needs a delegated subtree)")


def _oom_kills(cgroup: str) -> int:
    """Processes the kernel's OOM killer ended in this cgroup (``oom_kill`` of memory.oom_control)."""
    fields = dict(line.split() for line in Path(cgroup, "memory.oom_control").read_text().splitlines())
    return int(fields["oom_kill"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    parent = _parent_cgroup()
    cgroups, children = [], {}
    try:
        for name, (mode, workers, grow_mib) in CASES.items():
            cgroup = os.path.join(parent, f"lightmem-test-{name}-{uuid.uuid4().hex[:8]}")
            try:
                os.mkdir(cgroup)
            except OSError as error:
                pytest.skip(f"cannot create a memory cgroup under {parent}: {error}")
            cgroups.append(cgroup)
            root_dir = tmp_path_factory.mktemp(name)
            children[name] = (
                root_dir,
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), cgroup, mode, str(workers), str(root_dir), str(HEADROOM_MIB), str(grow_mib)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                ),
            )  # fmt: skip
        results = {}
        for (name, (root_dir, child)), cgroup in zip(children.items(), cgroups):
            out, _ = child.communicate(timeout=240)
            lines = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
            results[name] = (child.returncode, out, lines, root_dir, _oom_kills(cgroup))
        return results
    finally:
        for _, child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        for cgroup in cgroups:
            os.rmdir(cgroup)


def test_without_lightmem_the_oom_killer_ends_the_fit_without_a_trace(runs):
    returncode, out, lines, _, oom_kills = runs["plain"]
    assert (returncode, oom_kills, lines) == (-9, 1, []), out[-3000:]


def test_with_lightmem_the_fit_stops_with_a_checkpoint_and_resumes(runs):
    returncode, out, lines, root_dir, oom_kills = runs["lightmem"]
    assert (returncode, oom_kills) == (0, 0), out[-3000:]
    stopped, resumed = lines
    assert stopped["fit"] == "stopped" and stopped["ckpt_exists"] and stopped["global_step"] > 5
    assert resumed == {
        "fit": "resumed", "first_step": stopped["global_step"], "global_step": stopped["global_step"] + 3,
        "weights_from_checkpoint": True,
    }  # fmt: skip
    assert "lightmem: host memory passed host_warn_at (85% of its limit)" in out
    assert "lightmem: training stopped cleanly" in out
    assert f"trainer.fit(model, ckpt_path={str(root_dir / 'lightmem-host-stop.ckpt')!r})" in out


def test_without_lightmem_growing_dataloader_workers_are_killed(runs):
    # The OOM killer picks a worker or the main process; either way the fit dies (how it reports
    # a dead worker depends on what the worker was doing) and no result line is printed.
    returncode, out, lines, _, oom_kills = runs["plain_workers"]
    assert returncode != 0 and oom_kills >= 1 and lines == [], out[-3000:]


def test_with_lightmem_growing_dataloader_workers_stop_the_fit_cleanly(runs):
    returncode, out, lines, root_dir, oom_kills = runs["lightmem_workers"]
    assert (returncode, oom_kills) == (0, 0), out[-3000:]
    stopped, resumed = lines
    assert stopped["ckpt_exists"] and resumed["first_step"] == stopped["global_step"]
    assert resumed["global_step"] == stopped["global_step"] + 3 and resumed["weights_from_checkpoint"]
    stop_message = out[out.index("lightmem: training stopped cleanly") :]
    assert "DataLoader workers (RSS):" in stop_message and " in 2 processes" in stop_message
