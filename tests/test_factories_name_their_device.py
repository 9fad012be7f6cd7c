"""Every tensor lightmem makes names its device (issue 49, item 3; DESIGN's invariants).

A factory without ``device=`` makes a CPU tensor; where it meets a CUDA batch, parameter or
buffer, CUDA raises (the H200 found ``_sparse_input``'s counters that way). So each call of a
factory in ``lightmem/`` says where its tensor goes: the device of what it meets
(``device=values.device``), the dry run's (``DRY_RUN_DEVICE``), or the host (``device="cpu"``:
host buffers, CPU probes, values for gloo), spelled out.

A ``**options`` spread names the device only where the dict visibly holds it: a literal with a
``"device"`` key, ``dict(device=...)``, or a name every binding of which in the enclosing function
is one of those. A spread of a parameter (``def make(**options)``) may hold anything, so it does not.

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
    keyword and no ``**`` spread that visibly holds one (the module docstring)."""
    found = []

    def visit(scope: ast.AST, bindings: dict[str, list[ast.expr | None]]) -> None:
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(node, bindings | _bindings(node))  # its own names, then those it closes over
                continue
            if isinstance(node, ast.Call) and _is_factory(node):
                spreads = [k.value for k in node.keywords if k.arg is None]
                named = any(k.arg == "device" for k in node.keywords)
                if not (named or any(_holds_device(spread, bindings) for spread in spreads)):
                    found.append((node.lineno, node.func.attr))
            visit(node, bindings)

    tree = ast.parse(source)
    visit(tree, _bindings(tree))
    return sorted(found)


def _is_factory(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"
        and func.attr in FACTORIES
    )  # fmt: skip


def _bindings(scope: ast.AST) -> dict[str, list[ast.expr | None]]:
    """What each name of ``scope`` (a module or a function, nested functions left out) is bound
    to: the value assigned, or None where it cannot be read here (a parameter, a loop target)."""
    bound: dict[str, list[ast.expr | None]] = {}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = scope.args
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        for argument in [*every, arguments.vararg, arguments.kwarg]:
            if argument is not None:
                bound.setdefault(argument.arg, []).append(None)
        body = scope.body if isinstance(scope.body, list) else [scope.body]
    else:
        body = scope.body  # type: ignore[attr-defined]
    pending = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound.setdefault(node.targets[0].id, []).append(node.value)
            pending.append(node.value)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.setdefault(node.id, []).append(None)  # any other binding: unknown
        pending.extend(ast.iter_child_nodes(node))
    return bound


def _holds_device(spread: ast.expr, bindings: dict[str, list[ast.expr | None]]) -> bool:
    """Whether ``**spread`` visibly passes ``device``."""
    if isinstance(spread, ast.Dict):
        return any(
            (isinstance(key, ast.Constant) and key.value == "device")
            or (key is None and _holds_device(value, bindings))
            for key, value in zip(spread.keys, spread.values)
        )  # fmt: skip
    if isinstance(spread, ast.Call) and isinstance(spread.func, ast.Name) and spread.func.id == "dict":
        return any(keyword.arg == "device" for keyword in spread.keywords)
    if isinstance(spread, ast.Name):
        values = bindings.get(spread.id, [])
        return bool(values) and all(value is not None and _holds_device(value, {}) for value in values)
    return False


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


def test_the_check_passes_a_spread_only_where_the_dict_visibly_holds_the_device():
    source = (
        "import torch\n"
        "def make(shape, **options):\n"
        "    return torch.zeros(shape, **options)\n"  # 3: a parameter may hold anything
        "def named(x):\n"
        "    options = dict(dtype=x.dtype, device=x.device)\n"
        "    a = torch.zeros(3, **options)\n"
        "    b = torch.ones(3, **{'device': x.device})\n"
        "    c = torch.empty(3, **{**options, 'dtype': torch.int64})\n"
        "    kept = {'dtype': torch.int64}\n"
        "    return torch.full((3,), 1, **kept)\n"  # 10: no device in the dict
        "def rebound(x, flag):\n"
        "    options = {'device': x.device}\n"
        "    if flag:\n"
        "        options = {'dtype': torch.int64}\n"
        "    return torch.arange(3, **options)\n"  # 15: one binding has no device
        "def elsewhere(options, x):\n"
        "    inner = lambda: torch.tensor([1.0], **options)\n"  # 17: the parameter, in a closure
        "    options_here = {'device': x.device}\n"
        "    return inner, lambda: torch.zeros(1, **options_here)\n"
    )
    flagged = factory_calls_without_device(source)
    assert flagged == [(3, "zeros"), (10, "full"), (15, "arange"), (17, "tensor")]


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
