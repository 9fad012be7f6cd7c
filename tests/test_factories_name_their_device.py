"""Every tensor lightmem makes names its device (issue 49, item 3; DESIGN's invariants).

A factory without ``device=`` makes a CPU tensor; where it meets a CUDA batch, parameter or
buffer, CUDA raises (the H200 found ``_sparse_input``'s counters that way). So each call of a
factory in ``lightmem/`` says where its tensor goes: the device of what it meets
(``device=values.device``), the dry run's (``DRY_RUN_DEVICE``), or the host (``device="cpu"``:
host buffers, CPU probes, values for gloo), spelled out.

Not checked, since they take the device of a tensor they are given: ``torch.*_like(tensor)`` and
``tensor.new_*(...)``; one meant for another device says ``device=`` all the same. Nor
``torch.from_numpy`` and ``torch.frombuffer``, which only make host tensors.
"""

from __future__ import annotations

import ast
from pathlib import Path

FACTORIES = frozenset(
    {
        "zeros", "ones", "empty", "empty_strided", "full", "arange", "range", "linspace", "logspace",
        "tensor", "as_tensor", "scalar_tensor", "eye", "rand", "randn", "randint", "randperm",
        "normal", "tril_indices", "triu_indices",
    }
)  # fmt: skip
PACKAGE = Path(__file__).resolve().parent.parent / "lightmem"


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each ``torch.<factory>(...)`` call in ``source`` with no ``device=``
    keyword (a ``**options`` spread counts as naming it)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if node.func.attr in FACTORIES and not any(k.arg in ("device", None) for k in node.keywords):
            found.append((node.lineno, node.func.attr))
    return found


def test_the_check_finds_a_factory_without_a_device_and_passes_one_that_names_it():
    source = (
        "import torch\n"
        "a = torch.zeros(3, dtype=torch.int64)\n"
        "b = torch.zeros(3, device=x.device)\n"
        "c = torch.tensor([1.0], device='cpu')\n"
        "d = torch.zeros_like(x)\n"
        "e = torch.arange(4)\n"
    )
    assert factory_calls_without_device(source) == [(2, "zeros"), (6, "arange")]


def test_no_factory_in_lightmem_imports_one_by_name():
    # from torch import zeros would hide a factory from the check above
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torch":
                names = {alias.name for alias in node.names}
                assert not names & FACTORIES, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_every_tensor_factory_in_lightmem_names_its_device():
    missing = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: torch.{name}(...) names no device"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, name in factory_calls_without_device(path.read_text())
    ]
    assert missing == []
