"""Plain-text tables: what lightmem prints (fit summary, OOM report, estimates) without ``rich``."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(
    rows: Sequence[Sequence[str]],
    headers: Sequence[str] | None = None,
    *,
    title: str | None = None,
    align: str = "",
) -> str:
    """Columns padded to their widest cell, a rule under the headers.

    ``align`` has one letter per column, ``"l"`` (default) or ``"r"``: ``align="lr"`` puts numbers
    in the second column flush right.
    """
    table = [list(headers)] if headers else []
    table += [list(row) for row in rows]
    if not table:
        return title or ""
    columns = max(len(row) for row in table)
    for row in table:
        row += [""] * (columns - len(row))
    widths = [max(len(row[i]) for row in table) for i in range(columns)]

    def line(row: list[str]) -> str:
        cells = [
            cell.rjust(width) if align[i : i + 1] == "r" else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    out = [title] if title else []
    if headers:
        out += [line(table[0]), "  ".join("-" * width for width in widths)]
        table = table[1:]
    out += [line(row) for row in table]
    return "\n".join(out)


def markdown_table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """The same rows as a Markdown table (TensorBoard's Text tab renders it)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)
