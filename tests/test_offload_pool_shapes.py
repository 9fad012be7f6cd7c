"""Host pool under changing shapes: bounded by the largest step, memory given back after a shrink.

Each test trains through ``offload_activations`` and checks, step by step, the pool's peak of held
bytes (``stats.peak_host_bytes``, sampled on every allocation) against ``HEADROOM`` times the
largest step's offloaded bytes seen so far.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lightmem.transfer.pool import HEADROOM, TRIM_WINDOW_STEPS
from tests.models import ConvNet

transformers = pytest.importorskip("transformers")


def _gpt2(n_embd: int = 64, n_positions: int = 128) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=n_positions, n_embd=n_embd, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(autouse=True)
def _one_thread():
    # Hundreds of tiny steps: one intra-op thread is faster on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(model, off, batches) -> list[tuple[int, int, int]]:
    """(offloaded bytes, peak held bytes, held bytes after backward) for each step."""
    steps = []
    for make_loss in batches:
        with off:
            loss = make_loss(model)
        loss.backward()
        model.zero_grad(set_to_none=True)
        stats = off.stats
        steps.append((stats.offloaded_bytes, stats.peak_host_bytes, off.host_bytes_held))
    assert off.host_bytes_in_use == 0
    return steps


def _assert_bounded(steps: list[tuple[int, int, int]]) -> None:
    largest = 0
    for index, (offloaded, peak_held, held) in enumerate(steps):
        largest = max(largest, offloaded)
        assert peak_held <= HEADROOM * largest, (index, peak_held / largest)
        assert held <= peak_held


def _lm_batch(batch: int, seq: int, generator: torch.Generator):
    tokens = torch.randint(0, 256, (batch, seq), generator=generator)
    return lambda model: model(input_ids=tokens, labels=tokens).loss


def test_fixed_shapes_allocate_once_and_stay_within_the_bound(cpu_offload):
    model = _gpt2()
    off = cpu_offload(model)
    generator = torch.Generator().manual_seed(0)
    steps = _train(model, off, [_lm_batch(4, 128, generator) for _ in range(3)])
    allocations = off._pool.allocations
    steps += _train(model, off, [_lm_batch(4, 128, generator) for _ in range(5)])
    _assert_bounded(steps)
    assert off._pool.allocations == allocations  # steady state: every block is reused
    assert len({offloaded for offloaded, _, _ in steps}) == 1


def test_sequence_length_drawn_every_step_keeps_the_pool_within_the_bound(cpu_offload):
    """The run of issue 16 (4-layer GPT-2, batch 4, length 16-128, 200 steps) held 14.4x before."""
    model = _gpt2()
    off = cpu_offload(model)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    steps = _train(model, off, [_lm_batch(4, rng.randint(16, 128), generator) for _ in range(200)])
    _assert_bounded(steps)
    largest = max(offloaded for offloaded, _, _ in steps)
    assert steps[-1][2] <= HEADROOM * largest


def test_sequence_length_drawn_every_step_at_the_default_min_bytes():
    from lightmem import offload_activations

    model = _gpt2(n_embd=128, n_positions=256)
    off = offload_activations(model, devices=("cpu",))  # min_bytes="1MiB"
    rng = random.Random(1)
    generator = torch.Generator().manual_seed(1)
    steps = _train(model, off, [_lm_batch(4, rng.randint(128, 256), generator) for _ in range(16)])
    assert all(offloaded > 0 for offloaded, _, _ in steps)
    assert off.stats.kept_bytes > 0  # small saved tensors stayed: the default threshold applies
    _assert_bounded(steps)


def test_smaller_last_batch_of_each_epoch_keeps_the_pool_within_the_bound(cpu_offload):
    model = _gpt2()
    off = cpu_offload(model)
    generator = torch.Generator().manual_seed(2)
    epoch = [4] * 7 + [1]  # 29 samples in batches of 4
    steps = _train(model, off, [_lm_batch(batch, 64, generator) for _ in range(6) for batch in epoch])
    _assert_bounded(steps)


def test_images_of_several_sizes_keep_the_pool_within_the_bound(cpu_offload):
    torch.manual_seed(0)
    model = ConvNet()
    off = cpu_offload(model)
    rng = random.Random(3)
    generator = torch.Generator().manual_seed(3)

    def image_batch(side: int):
        images = torch.randn(8, 3, side, side, generator=generator)
        labels = torch.randint(0, 10, (8,), generator=generator)
        return lambda m: F.cross_entropy(m(images), labels)

    steps = _train(model, off, [image_batch(rng.choice([16, 24, 32, 40])) for _ in range(60)])
    _assert_bounded(steps)


def test_pool_gives_memory_back_exactly_trim_window_steps_after_shapes_shrink(cpu_offload):
    model = _gpt2()
    off = cpu_offload(model)
    generator = torch.Generator().manual_seed(4)
    grown = _train(model, off, [_lm_batch(4, 128, generator) for _ in range(4)])
    shrunk = _train(model, off, [_lm_batch(4, 16, generator) for _ in range(TRIM_WINDOW_STEPS + 2)])
    small = shrunk[0][0]
    assert all(offloaded == small for offloaded, _, _ in shrunk) and small * 4 < grown[0][0]
    bound = HEADROOM * small
    # The large steps are remembered for TRIM_WINDOW_STEPS forwards, so their blocks stay cached...
    for _, _, held in shrunk[:TRIM_WINDOW_STEPS]:
        assert held > grown[0][0]
    # ...and at the next step boundary the pool trims to the bound of the small steps.
    for _, peak_held, held in shrunk[TRIM_WINDOW_STEPS:]:
        assert peak_held <= bound and held <= bound


def test_peak_in_use_counts_the_aligned_bytes_of_the_step_and_held_the_cached_rest(cpu_offload):
    from lightmem.transfer.pool import size_class

    model = torch.nn.Sequential(torch.nn.Linear(100, 300), torch.nn.ReLU(), torch.nn.Linear(300, 100))
    off = cpu_offload(model)
    peaks = []
    for batch in (64, 16):
        with off:
            loss = model(torch.randn(batch, 100)).sum()
        loss.backward()
        peaks.append((off.host_bytes_peak_in_use, off.host_bytes_held, off.host_bytes_in_use))
    # Saved storages: the input (batch x 100 floats) and the ReLU output (batch x 300 floats).
    assert peaks[0][0] == size_class(64 * 400) + size_class(64 * 1200) == 102400
    assert peaks[1][0] == size_class(16 * 400) + size_class(16 * 1200) == 26112
    assert peaks[1][0] < peaks[1][1] <= HEADROOM * peaks[0][0]  # the gap: cached for the next step
    assert peaks[1][2] == 0
