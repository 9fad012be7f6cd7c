"""Shared helpers for the benchmark scripts: timing, a realistic transformer, table printing."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F
from torch import nn


CHECKOUT = Path(__file__).resolve().parent.parent


def run_script(script: str, args: list[str], timeout_s: float) -> tuple[str, str, int | None]:
    """``python script *args`` from the checkout, killed at ``timeout_s``: (stdout, stderr, return
    code), with what it printed before a kill kept, stderr "killed at the time limit" and no code."""
    command = [sys.executable, script, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(CHECKOUT)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=CHECKOUT)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return output, "killed at the time limit", None
    return done.stdout, done.stderr, done.returncode


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    line = f"{psutil.cpu_count(logical=True)} CPU threads ({cpu}), torch {torch.__version__}, {torch.get_num_threads()} intra-op threads"
    if torch.cuda.is_available():
        line += f", GPU {torch.cuda.get_device_name()}"
    return line


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside, the caller's thread count back after (tables time one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def interleaved_median_s(
    steps: dict[str, Callable[[], None]], rounds: int, warmup: int = 2, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median wall seconds per step of each variant, timed round-robin so drift hits all alike."""
    times = interleaved_times_s(steps, rounds, warmup=warmup, sync=sync, clock=time.perf_counter)
    return {name: statistics.median(values) for name, values in times.items()}


def interleaved_times_s(
    steps: dict[str, Callable[[], None]], rounds: int, repeats: int = 1, warmup: int = 1,
    sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.thread_time,
) -> dict[str, list[float]]:
    """Each variant's step time per round, as the best of ``repeats`` back-to-back steps; every
    round times each variant in turn, so drift hits all alike.

    The default clock is the calling thread's CPU time (``time.thread_time``): with one intra-op
    thread every op runs on that thread, and time spent waiting for a core that another process
    holds (a shared machine) is not counted. Pass ``time.perf_counter`` where work runs elsewhere
    (a GPU).
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            best = float("inf")
            for _ in range(repeats):
                start = clock()
                step()
                sync()
                best = min(best, clock() - start)
            times[name].append(best)
    return times


def median_time_s(step: Callable[[], None], steps: int, warmup: int = 2, sync: Callable[[], None] = lambda: None) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Block(nn.Module):
    """Pre-norm transformer block (attention via scaled_dot_product_attention, GELU MLP)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, seq, dim)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, dim: int = 512, depth: int = 6, heads: int = 8, seq: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.pos, std=1 / math.sqrt(dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))


class StoragePeak:
    """Peak bytes of live tensor storages during a block of code (a TorchDispatchMode tracker).

    Every storage an op reads or writes is counted from the moment it is first seen until it is
    freed (weakref callback on the storage). ``ignore(storage)`` excludes storages, e.g. lightmem's
    host pool, which on a GPU would not be device memory.
    """

    def __init__(self, ignore: Callable[[torch.UntypedStorage], bool] = lambda storage: False) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.ignore = ignore
        self.current = 0
        self.peak = 0
        self._live: dict[int, object] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for value in torch.utils._pytree.tree_leaves((args, kwargs, out)):
                    if isinstance(value, torch.Tensor):
                        tracker._see(value.untyped_storage())
                return out

        self._mode = _Mode()

    def _see(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._live or self.ignore(storage):
            return
        import weakref

        nbytes = storage.nbytes()
        self._live[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self.current -= nbytes

    def __enter__(self) -> StoragePeak:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
