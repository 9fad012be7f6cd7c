"""A steady workload is steady (issue 49): once the first steps have sized the host pool, a step of
the same shapes registers nothing, unregisters nothing, copies nothing to pageable memory, and the
pool's page-locked bytes stay constant, within ``HEADROOM`` x the step's peak plus one largest block.

On an H200 a 16-block GPT whose last saved tensor (the fp32 ``log_softmax``, 25% of the step's
offloaded peak) did not fit the chunks the boundary queued alternated a 1.6 GB registration at one
step boundary and its release at the next, every other step 5x slower. These tests run the same
shape of workload on the simulated GPU (``page_locking=True``: a copy into pageable memory blocks
the host and is counted) with the chunk sizes scaled down from 256 MiB / 2 GiB to 4 / 32 KiB, so a
step of about 100 KiB spans the same number of chunks as the GPU's 6.5 GB did.
"""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
from conftest import assert_bitwise_equal, run_grads
from fake_cudart import use_simulated_runtime

from lightmem import offload_activations
from lightmem.testing.simulated import SimulatedAsyncTransport
from lightmem.transfer import page_lock, pool
from tests.models import TinyGPT, gpt_loss

KiB = 1024
STEPS = 10
WARM_UP_STEPS = 2
SMALL_SAVES = [4608] * 16  # bytes of the 16 saves before the last, large one


@pytest.fixture(params=[0.0], ids=["prompt"])
def gpu(request, monkeypatch):
    """The simulated GPU; ``request.param`` is its streams' largest random delay (s)."""
    monkeypatch.setattr(pool, "CHUNK_FIRST_BYTES", 4 * KiB)
    monkeypatch.setattr(pool, "CHUNK_MAX_BYTES", 32 * KiB)
    transport = SimulatedAsyncTransport(seed=0, max_delay_s=request.param, page_locking=True)
    use_simulated_runtime(monkeypatch, transport)
    yield transport
    gc.collect()  # pools the test dropped unregister in this runtime, not in torch's CPU-only one
    transport.runtime.release_registrations()
    for thread in threading.enumerate():
        if thread.name.startswith(page_lock.THREAD_NAME):
            thread.join()
    transport.close()


class _Saves(torch.nn.Module):
    """Saves one tensor of each of ``sizes`` bytes (float32), in order; nothing else keeps them."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = [nbytes // 4 for nbytes in sizes]
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, max(self.sizes)))

    def forward(self) -> torch.Tensor:
        loss = self.weight[:1].sum() * 0
        for numel in self.sizes:
            loss = loss + (self.weight[:numel] * 2.0).sin().sum()  # sin saves its input
        return loss


def _with_last_share(share: float) -> list[int]:
    """The small saves, then one whose bytes are ``share`` of the step's."""
    small = sum(SMALL_SAVES)
    return [*SMALL_SAVES, int(share * small / (1 - share)) // 4 * 4]


def _train(gpu, model, off, steps: int) -> tuple[list[tuple[int, int, int, int]], dict]:
    """Per step: (registrations, unregistrations, pageable copies, page-locked bytes after it)."""
    rows = []
    grads = {}
    for _ in range(steps):
        before = page_lock.registration_stats()
        copies = gpu.pageable_copies
        model.zero_grad(set_to_none=True)
        with off:
            loss = model()
        gpu.synchronize()
        loss.backward()
        gpu.synchronize()
        after = page_lock.registration_stats()
        rows.append((
            after.registrations - before.registrations,
            after.unregistrations - before.unregistrations,
            gpu.pageable_copies - copies,
            gpu.runtime.page_locked_bytes,
        ))  # fmt: skip
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return rows, grads


def _assert_steady(rows, off, sizes) -> None:
    settled = rows[WARM_UP_STEPS:]
    assert settled == [(0, 0, 0, settled[0][3])] * len(settled), rows
    peak = sum(pool.size_class(nbytes) for nbytes in sizes)
    bound = int(sum(sizes) * pool.HEADROOM) + pool.size_class(max(sizes))
    assert peak <= off.host_bytes_held <= bound, (off.host_bytes_held, peak, bound)


def _assert_phase_rows(rows, grew: bool, held_before: int) -> None:
    """Every row of a phase of fixed shapes, its first boundary and the boundary where the phase
    before leaves the window included. A phase that grew (more bytes or a larger block than the
    window held) may register during its first ``WARM_UP_STEPS`` steps and is steady after them.
    One that shrank needs no warm-up: it registers nothing and copies nothing to pageable memory at
    any step, and gives back only at the boundary where the larger steps leave the window
    (``TRIM_WINDOW_STEPS`` boundaries in), once."""
    if grew:
        settled = rows[WARM_UP_STEPS:]
        assert settled == [(0, 0, 0, settled[0][3])] * len(settled), rows
        return
    trim = pool.TRIM_WINDOW_STEPS
    given_back, held_after = rows[trim][1], rows[-1][3]
    expected = [(0, 0, 0, held_before)] * trim + [(0, given_back, 0, held_after)]
    assert rows == expected + [(0, 0, 0, held_after)] * (len(rows) - trim - 1), rows


@pytest.mark.parametrize(
    ("share", "gpu"), [(0.23, 0.0), (0.26, 0.0), (0.38, 0.0), (0.26, 0.001)], indirect=["gpu"],
    ids=["23%", "26%", "38%", "26%-lagging-gpu"],
)  # fmt: skip
def test_a_step_of_fixed_shapes_registers_and_releases_nothing_after_warm_up(gpu, share):
    sizes = _with_last_share(share)
    model = _Saves(sizes)
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    rows, grads = _train(gpu, model, off, STEPS)
    _assert_steady(rows, off, sizes)
    expected, _ = run_grads(_Saves(sizes), lambda m: m())
    assert_bitwise_equal(expected, grads)
    off.release_host_memory()
    assert gpu.runtime.page_locked_bytes == 0


@pytest.mark.parametrize("share", [0.23, 0.26, 0.38])
def test_a_prepared_pool_stays_steady_past_the_window_of_its_preparation(gpu, share):
    # LightMem page-locks the plan's bytes before step 0; the steps after that window
    # (TRIM_WINDOW_STEPS boundaries) keep what they use.
    sizes = _with_last_share(share)
    model = _Saves(sizes)
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    off.prepare_host(sum(sizes), wait=True)
    rows, _ = _train(gpu, model, off, pool.TRIM_WINDOW_STEPS + 4)
    _assert_steady(rows, off, sizes)
    off.release_host_memory()


def test_a_gpt_whose_fp32_log_softmax_is_a_quarter_of_the_step_stays_steady(gpu, monkeypatch):
    # The H200's case at a small scale: a GPT whose loss saves its fp32 log_softmax last, 25% of
    # the step's offloaded bytes (2.6 MB here), chunks scaled by the same ratio as 6.5 GB to 2 GiB.
    monkeypatch.setattr(pool, "CHUNK_FIRST_BYTES", 100 * KiB)
    monkeypatch.setattr(pool, "CHUNK_MAX_BYTES", 800 * KiB)
    torch.manual_seed(0)
    model = TinyGPT(vocab=1280, dim=32, depth=4, heads=4, seq=32)
    tokens = torch.randint(0, 1280, (4, 33))
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    rows = []
    for step in range(STEPS):
        before = page_lock.registration_stats()
        copies = gpu.pageable_copies
        model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with off:
            loss = gpt_loss(model, tokens)
        gpu.synchronize()
        loss.backward()
        gpu.synchronize()
        after = page_lock.registration_stats()
        rows.append((
            after.registrations - before.registrations, after.unregistrations - before.unregistrations,
            gpu.pageable_copies - copies, gpu.runtime.page_locked_bytes,
        ))  # fmt: skip
    settled = rows[WARM_UP_STEPS:]
    assert settled == [(0, 0, 0, settled[0][3])] * len(settled), rows
    log_softmax_bytes = 4 * 32 * 1280 * 4
    peak = off.host_bytes_peak_in_use
    assert 0.24 < log_softmax_bytes / peak < 0.26
    assert off.host_bytes_held <= int(off.stats.offloaded_bytes * pool.HEADROOM) + log_softmax_bytes
    reference = TinyGPT(vocab=1280, dim=32, depth=4, heads=4, seq=32)
    reference.load_state_dict(model.state_dict())
    torch.manual_seed(STEPS - 1)
    gpt_loss(reference, tokens).backward()
    assert_bitwise_equal(
        {name: p.grad for name, p in reference.named_parameters()},
        {name: p.grad for name, p in model.named_parameters()},
    )
    off.release_host_memory()


def test_shapes_that_change_between_phases_settle_in_each_and_stay_within_the_bound(gpu):
    # Phases of fixed shapes, larger and smaller in turn: a phase that grows settles after its
    # first steps; one that shrinks gives memory back once the larger steps leave the window
    # (TRIM_WINDOW_STEPS boundaries) and is steady before and after that. Every row after
    # warm-up is checked, the boundaries where a phase changes included. At every step the pool
    # holds at most HEADROOM x the peak of the window and the step, plus their largest block.
    rng = random.Random(0)
    model = _Saves([64 * KiB])
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    window: list[tuple[int, int]] = []  # (step's bytes, its largest block)
    held = 0
    for phase in range(5):
        model.sizes = [rng.randrange(1, 8) * 1024 for _ in range(rng.randrange(8, 24))]
        model.sizes.append(rng.randrange(2, 16) * 1024)  # the last one large, as a loss's often is
        sizes = [numel * 4 for numel in model.sizes]
        step = (sum(sizes), pool.size_class(max(sizes)))
        # Grew: more bytes, or a larger block, than any step in the window (the first phase grows).
        grew = step[0] > max((nbytes for nbytes, _ in window), default=0) or step[1] > max(
            (largest for _, largest in window), default=0
        )
        rows = []
        for _ in range(pool.TRIM_WINDOW_STEPS + 4):
            step_rows, _ = _train(gpu, model, off, 1)
            rows += step_rows
            # The window of the boundary before this step, and this step (counted live).
            window = [*window, step][-pool.TRIM_WINDOW_STEPS - 1 :]
            bound = int(max(nbytes for nbytes, _ in window) * pool.HEADROOM)
            assert off.host_bytes_held <= bound + max(largest for _, largest in window), phase
        _assert_phase_rows(rows, grew, held)
        held = rows[-1][3]
    off.release_host_memory()


def test_a_phase_of_smaller_steps_registers_nothing_and_gives_back_once_when_the_larger_leave_the_window(gpu):
    # 80 saves of 4 KiB, then 60. The first phase settles on chunks of 4, 8, 16, 11 x 32 and
    # 20 KiB: 400 KiB, HEADROOM x its 320 KiB. The second fits them from its first step; when the
    # last step of 80 leaves the window, the cap falls to 1.25 x 240 + 4 = 304 KiB and the newest
    # chunks go back until under it (20 + 3 x 32 KiB), and nothing is queued in their place.
    model = _Saves([4 * KiB] * 80)
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    larger, _ = _train(gpu, model, off, pool.TRIM_WINDOW_STEPS + 4)
    assert larger[WARM_UP_STEPS:] == [(0, 0, 0, 400 * KiB)] * (pool.TRIM_WINDOW_STEPS + 4 - WARM_UP_STEPS)
    model.sizes = model.sizes[:60]
    smaller, _ = _train(gpu, model, off, pool.TRIM_WINDOW_STEPS + 4)
    trim = pool.TRIM_WINDOW_STEPS
    assert smaller == [(0, 0, 0, 400 * KiB)] * trim + [(0, 4, 0, 284 * KiB)] + [(0, 0, 0, 284 * KiB)] * 3
    off.release_host_memory()


def test_a_prepared_pool_whose_first_step_spills_gives_no_chunk_back_during_that_step(gpu):
    # Chunks for 1.15 x the step's bytes (prepare_host queues HEADROOM x what it is told): room at
    # chunk ends is lost, so the step's last, large save does not fit and goes to pageable memory.
    # A request that finds no room takes a pageable slab and gives no empty chunk back (only a
    # step boundary does): the prepared bytes stay, and the next boundary adds one chunk of
    # exactly that save's size, after which every step fits.
    sizes = _with_last_share(0.23)
    model = _Saves(sizes)
    off = offload_activations(model, min_bytes=0, devices=("cpu",), transport=gpu)
    prepared = off.prepare_host(int(1.15 * sum(sizes) / pool.HEADROOM), wait=True)
    align = pool.ALIGN_BYTES
    assert gpu.runtime.page_locked_bytes == prepared == int(1.15 * sum(sizes)) // align * align
    rows, _ = _train(gpu, model, off, pool.TRIM_WINDOW_STEPS + 4)
    grown = prepared + pool.size_class(sizes[-1])
    assert rows == [(0, 0, 2, prepared), (1, 0, 0, grown)] + [(0, 0, 0, grown)] * (pool.TRIM_WINDOW_STEPS + 2)
    off.release_host_memory()


def test_chunks_keep_their_promise_none_under_at_least_and_their_sum_exact(monkeypatch):
    monkeypatch.setattr(pool, "CHUNK_FIRST_BYTES", 4 * KiB)
    monkeypatch.setattr(pool, "CHUNK_MAX_BYTES", 32 * KiB)
    # 100 KiB, each at least 30 KiB: 30, 30, then a rest of 10 KiB would be under 30: it joins.
    assert pool.chunk_sizes(100 * KiB, at_least=30 * KiB) == [30 * KiB, 30 * KiB, 40 * KiB]
    assert pool.chunk_sizes(120 * KiB, at_least=30 * KiB) == [30 * KiB] * 4
    assert pool.chunk_sizes(20 * KiB, at_least=30 * KiB) == []  # no chunk could hold such a block
    assert pool.chunk_sizes(30 * KiB, at_least=30 * KiB) == [30 * KiB]
