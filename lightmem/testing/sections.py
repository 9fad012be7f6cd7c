"""The self-check's report: sections run one after another, each within its time limit (a section
stuck in a CUDA call is left on its daemon thread), written to one markdown file as each finishes,
with one verdict line per section printed as it ends (``python -m lightmem.selfcheck``)."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch


HEADER_LIMIT_S = 30
"""The report's header (versions, the page-locked copy bandwidth) takes a second or two; its limit."""


def run_with_time_limit(section: Callable[[], str], limit_s: float) -> tuple[str, bool]:
    """``section()``'s markdown, or a line saying it failed or did not finish within ``limit_s``.

    Returns (markdown, finished). A section that hangs keeps running on its daemon thread (a
    stuck CUDA call cannot be interrupted); the caller writes what it has and goes on.
    """
    result: list[str] = []

    def run() -> None:
        try:
            result.append(section())
        except Exception as error:  # one failing benchmark must not hide the others' figures
            result.append(f"## {section.__name__}\n\nFailed: `{type(error).__name__}: {error}`\n")

    worker = threading.Thread(target=run, name=f"selfcheck-{section.__name__}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        return f"## {section.__name__}\n\nDid not finish within {limit_s:.0f} s (time limit); skipped.\n", False
    return result[0], True


@dataclass(frozen=True)
class Section:
    """One part of the report: ``run(limit_s)`` returns its markdown, within ``limit_s`` seconds.

    Its markdown starts with a ``## `` title; a line ``**Verdict:** ...`` in it is also printed as
    the section's verdict when it finishes (otherwise "done").
    """

    name: str
    limit_s: float
    run: Callable[[float], str]
    what: str


VERDICT = "**Verdict:** "


def verdict_of(markdown: str, finished: bool) -> str:
    """The line printed when a section ends: its ``**Verdict:**`` line, "done", or why it did not finish."""
    if not finished:
        return "did not finish within its time limit"
    for line in markdown.splitlines():
        if line.startswith(VERDICT):
            return line[len(VERDICT) :]
        if line.startswith("Failed: "):
            return line
    return "done"


def run_report(
    sections: Sequence[Section], output: Path, header: Callable[[], str], out: TextIO | None = None
) -> bool:
    """Write ``header()`` then each section's markdown to ``output`` as each finishes, each under its
    time limit; print one verdict line per section to ``out`` (stdout). Returns whether a section
    was left running (a thread stuck in CUDA: the caller should ``os._exit``)."""
    out = out if out is not None else sys.stdout
    head, _ = run_with_time_limit(_named(header, "header"), HEADER_LIMIT_S)
    output.write_text(head)  # written as it goes: a hang still leaves a report
    hung = False
    for section in sections:
        started = time.perf_counter()
        run = _named(lambda section=section: section.run(section.limit_s), section.name)
        text, finished = run_with_time_limit(run, section.limit_s)
        hung = hung or not finished
        with output.open("a") as report:
            report.write("\n" + text)
        took = time.perf_counter() - started
        verdict = f"{verdict_of(text, finished)} ({took:.0f} s of {section.limit_s:.0f} s)"
        print(f"lightmem selfcheck: {section.name}: {verdict}", file=out, flush=True)
        if finished and torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
    print(f"lightmem selfcheck: report written to {output.resolve()}", file=out, flush=True)
    return hung


def _named(function: Callable[[], str], name: str) -> Callable[[], str]:
    def named() -> str:
        return function()

    named.__name__ = name
    return named
