"""Where in the user's own code a traced op was called from: the file, the statement, and the
modules its local names hold, so that advice can name the line to change in the user's words.

The innermost frame outside the libraries (torch, lightmem, Lightning, Hugging Face, LitGPT, the
standard library) is the user's; when a Hugging Face frame lies between it and the op, the op ran inside
the model's own code (a causal LM's ``loss_function``).
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys
import sysconfig
from dataclasses import dataclass
from types import FrameType

import torch
from torch import nn

_HUGGING_FACE = "transformers"
_LIGHTMEM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class CallSite:
    """The user's statement that led to a traced op."""

    filename: str
    line: int
    statement: str
    """The statement's source, its lines joined (``return F.cross_entropy(logits..., targets...)``)."""
    modules: tuple[tuple[str, int], ...]
    """(name, id) of each local name of the frame bound to an ``nn.Module`` (``self``, ``model``)."""
    library: str | None
    """``"transformers"`` when the op ran inside Hugging Face code this statement called."""
    call: ast.Call | None = None
    """The statement's call of a cross-entropy (``F.cross_entropy(...)``), if it has one."""

    @property
    def where(self) -> str:
        """``gpt_model.py:52``: the file's name and the statement's first line."""
        return f"{os.path.basename(self.filename)}:{self.line}"

    def source(self, node: ast.AST) -> str:
        return ast.unparse(node)


def _library_roots() -> tuple[str, ...]:
    roots = [os.path.dirname(torch.__file__), _LIGHTMEM, sysconfig.get_paths()["stdlib"]]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", _HUGGING_FACE, "litgpt"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.append(os.path.dirname(module.__file__))
    return tuple(os.path.join(root, "") for root in roots)


def call_site(frame: FrameType | None = None) -> CallSite | None:
    """The innermost user frame above ``frame`` (default: the caller's), or None when every
    frame is a library's."""
    frame = frame or sys._getframe(1)
    roots = _library_roots()
    hugging_face = sys.modules.get(_HUGGING_FACE)
    hf_root = os.path.join(os.path.dirname(hugging_face.__file__), "") if hugging_face is not None else None
    library = None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(roots) and not path.startswith("<"):
            break
        if hf_root is not None and path.startswith(hf_root):
            library = _HUGGING_FACE
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename
    line = frame.f_lineno
    statement = _statement(path, line)
    modules = tuple((name, id(value)) for name, value in frame.f_locals.items() if isinstance(value, nn.Module))
    if statement is None:
        text = linecache.getline(path, line).strip()
        return CallSite(path, line, text, modules, library)
    node, first = statement
    return CallSite(path, first, " ".join(ast.unparse(node).split()), modules, library, _cross_entropy_call(node))


def _statement(path: str, line: int) -> tuple[ast.stmt, int] | None:
    """The innermost statement of ``path`` that spans ``line``, and its first line."""
    source = "".join(linecache.getlines(path))
    return _statement_of(source, line) if source else None


@functools.lru_cache(maxsize=64)
def _statement_of(source: str, line: int) -> tuple[ast.stmt, int] | None:
    """``_statement`` of a file's text (every fake step of a plan asks again: parsed once)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (found is None or end - node.lineno <= found[1] - found[0]):
                found = (node.lineno, end, node)
    return None if found is None else (found[2], found[0])


def _cross_entropy_call(statement: ast.stmt) -> ast.Call | None:
    """The statement's call of a cross-entropy (``F.cross_entropy``, ``torch.nn.functional.cross_entropy``,
    LitGPT's ``chunked_cross_entropy``): logits and targets its first two arguments."""
    for node in ast.walk(statement):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in ("cross_entropy", "chunked_cross_entropy") and len(node.args) >= 2:
                return node
    return None
