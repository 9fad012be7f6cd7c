"""torchtune's ``OffloadActivations`` on CPU tensors, as a yardstick for lightmem's per-tensor cost.

torchtune is optional and never a dependency of lightmem (``pip install --no-deps torchtune``).
Its module ``torchtune/training/_activation_offloading.py`` is loaded from its file, without
importing the ``torchtune`` package (which pulls torchao and the model zoo), with four changes made
to its text before it runs, each checked to match as often as expected so a torchtune release that moves
them fails loudly instead of timing something else:

- its imports of ``torchao`` (the NF4 check) and of ``torchtune.modules`` / ``torchtune.utils`` (the
  output-head helper and a logger) are replaced by stand-ins: the hooks never reach them here;
- ``torch.cuda.default_stream()`` (which raises on a CPU-only torch) is ``None``: with
  ``use_streams=False``, ``torch.cuda.stream(None)`` is a no-op, as the default stream is on a GPU;
- the reload ``.to("cuda", non_blocking=True)`` becomes ``.to("cpu", copy=True)``: a fresh CPU
  tensor, as lightmem's CPU path reloads into (``.to("cpu")`` of a CPU tensor would copy nothing).

Pack is unchanged: ``torch.empty_like(..., device="cpu")`` and ``copy_`` into it, a fresh tensor.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import types
from typing import Any

_STAND_INS = """\
class _NoNF4: pass
torchao = types.SimpleNamespace(__version__="0")
NF4Tensor = _NoNF4
TiedLinear = _NoNF4
get_logger = lambda level: logging.getLogger("torchtune")
"""

_EDITS = (  # (text, replacement, times found)
    ("import torchao\n", "", 1),
    ("from torchao.dtypes.nf4tensor import NF4Tensor\n", "", 1),
    ("from torchtune.modules import TiedLinear\n", "", 1),
    ("from torchtune.utils import get_logger\n", _STAND_INS, 1),
    ("torch.cuda.default_stream()", "None", 1),
    ('.to("cuda", non_blocking=True)', '.to("cpu", copy=True)', 2),  # the single-stream and the streams reload
)


_IMPORT_EDITS = _EDITS[:4]
"""The edits that replace torchtune's imports of torchao and its own package: all a GPU run needs."""


def _load(edits: tuple[tuple[str, str, int], ...], name: str) -> type | None:
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "training", "_activation_offloading.py")
    with open(path) as file:
        text = file.read()
    for old, new, expected in edits:
        count = text.count(old)
        if count != expected:
            raise RuntimeError(f"torchtune's {path} changed: {old!r} found {count} times, expected {expected}")
        text = text.replace(old, new)
    module = types.ModuleType(name)
    module.__dict__.update(types=types, logging=logging)
    exec(compile(text, path, "exec"), module.__dict__)
    return module.OffloadActivations


@functools.cache
def torchtune_offload_activations() -> type | None:
    """torchtune's ``OffloadActivations`` class runnable on CPU tensors, or ``None`` when torchtune
    is not installed."""
    return _load(_EDITS, "torchtune_activation_offloading_cpu")


@functools.cache
def torchtune_cuda_offload_activations() -> type | None:
    """torchtune's ``OffloadActivations`` as it runs on a GPU (only its imports stood in for), or
    ``None`` when torchtune is not installed."""
    return _load(_IMPORT_EDITS, "torchtune_activation_offloading")


def torchtune_hooks(min_offload_size: int) -> Any:
    """A torchtune context for CPU tensors (no pinned memory, no side stream); reusable across
    steps, as in a training loop. Needs torchtune installed."""
    cls = torchtune_offload_activations()
    if cls is None:
        raise RuntimeError("torchtune is not installed: pip install --no-deps torchtune")
    return cls(use_pin_memory=False, use_streams=False, min_offload_size=min_offload_size)
