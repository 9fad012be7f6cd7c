"""Draw docs/layout.svg and docs/estimate_layout.svg: lightmem's packages and their imports, read
from the code.

    python docs/draw_layout.py

``layout.svg``: each box is a module of ``lightmem/offload``, ``lightmem/model_state`` or
``lightmem/transfer`` (with its line count), and the modules that use them above.
``estimate_layout.svg``: the estimator's layers, from its entry points down to the trace, each
module of ``lightmem/estimate`` a box. An arrow ``A -> B`` means A imports B (an arrow a longer way
already implies is left out). Within a package a module stands above what it imports, so data and
calls flow downward. Nothing is laid out by hand: run it again after a move and commit the
pictures it writes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightmem"
DOCS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Layout:
    """One picture. ``bands`` from top to bottom, each holding groups side by side: a group is a
    folder of lightmem/ whose modules are drawn one by one (no members), or a list of modules and
    folders drawn as one box each. ``frameless``: groups drawn without a frame (callers, what lies below)."""

    out: str
    title: str
    bands: list[list[tuple[str, list[str]]]]
    captions: dict[str, str]
    frameless: tuple[str, ...] = ()


OFFLOADS = Layout(
    "layout.svg",
    "lightmem: the two offloads over one copy layer",
    [
        [("uses them", ["callback.py", "fit_session.py", "estimate/", "metrics/"])],
        [("offload/", []), ("model_state/", [])],
        [("transfer/", [])],
        [("below", ["config/"])],
    ],
    {
        "uses them": "who drives them: the callback's fit session, the estimator, the metrics",
        "offload/": "activation offload: saved tensors out in forward, back in backward",
        "model_state/": "model-state offload: gradients, optimizer state and the step on the host",
        "transfer/": "what both offloads stand on: copies, page-locked host memory, in-flight bounds",
        "below": "",
    },
    frameless=("uses them", "below"),
)
_ESTIMATE_ENTRIES = ["estimator.py", "planner.py", "search.py", "frontier.py", "advice.py", "chunked_loss.py"]
ESTIMATOR = Layout(
    "estimate_layout.svg",
    "lightmem/estimate: a call walks down, from the entry points to the trace",
    [
        [("uses them", ["fit_session.py", "auto_plan.py", "cli.py"])],
        [("entry points", [f"estimate/{name}" for name in _ESTIMATE_ENTRIES])],
        [("estimate/planning/", [])],
        [("steps", ["estimate/assemble.py", "estimate/report.py", "estimate/steps.py"])],
        [("estimate/pricing/", []), ("estimate/device/", []), ("words", ["estimate/words.py"])],
        [("estimate/trace/", []), ("settings", ["estimate/settings.py"])],
        [("below", ["config/", "devices.py", "checkpoint.py", "offload/", "tiling/", "blocks.py"])],
    ],
    {
        "uses them": "",
        "entry points": "estimate_memory, plan, max_batch_size, frontier, the advice: each parses its arguments once",
        "estimate/planning/": "the space, its walks and what a plan returns",
        "steps": "a configuration's step, the one step memo, the report of an estimate",
        "estimate/pricing/": "one fold of per-block time, the timeline",
        "estimate/device/": "CUDA's rules, the allocator's replay, one step as the device runs it",
        "words": "messages, at the side",
        "estimate/trace/": "one dispatch mode: memory and priced ops; blocks; the user's code; optimizer state",
        "settings": "the one settings object",
        "below": "",
    },
    frameless=("uses them", "below"),
)

BOX_W, BOX_H, GAP_X, ROW_H, PAD, TITLE_H, CAPTION_H = 150, 34, 12, 58, 18, 70, 22


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _node_of(module: str, nodes: dict[str, str]) -> str | None:
    """The node (a module, or a folder drawn as one box) that ``module`` belongs to."""
    while module:
        if module in nodes:
            return nodes[module]
        module = module.rpartition(".")[0]
    return None


def _imports(path: Path) -> set[str]:
    """Every ``lightmem`` module ``path`` imports (``from a import b`` may name module ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("lightmem"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightmem"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _graph(layout: Layout) -> tuple[dict[str, str], dict[str, int], dict[str, set[str]]]:
    """Node -> group, node -> lines, node -> the nodes it imports (transitively reduced)."""
    group_of: dict[str, str] = {}
    owner: dict[str, str] = {}  # module name (or folder's package name) -> node
    for band in layout.bands:
        for group, members in band:
            if members:
                for member in members:
                    group_of[member] = group
                    owner[_module_of(PACKAGE / member.rstrip("/"))] = member
            else:
                for path in sorted((PACKAGE / group).glob("*.py")):
                    if path.name != "__init__.py":
                        member = f"{group}{path.name}"
                        group_of[member] = group
                        owner[_module_of(path)] = member
    lines = {node: 0 for node in group_of}
    edges: dict[str, set[str]] = {node: set() for node in group_of}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _node_of(_module_of(path), owner)
        if source is None or path.name == "__init__.py" and source.endswith(".py"):
            continue
        lines[source] += len(path.read_text().splitlines())
        for module in _imports(path):
            target = _node_of(module, owner)
            if target is not None and target != source:
                edges[source].add(target)

    def reaches(start: str, goal: str, skip: str) -> bool:
        stack, seen = [n for n in edges[start] if n != skip], set()
        while stack:
            node = stack.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(edges[node])
        return False

    reduced = {node: {t for t in targets if not reaches(node, t, skip=t)} for node, targets in edges.items()}
    return group_of, lines, reduced


def _floors(nodes: list[str], edges: dict[str, set[str]]) -> dict[str, int]:
    """Within one group: 0 for a module that imports none of the group, else one above the highest it imports."""
    floor: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in floor:
            below = [of(target) + 1 for target in edges[node] if target in nodes]
            floor[node] = max(below, default=0)
        return floor[node]

    for node in nodes:
        of(node)
    return floor


def draw(layout: Layout) -> str:
    group_of, lines, edges = _graph(layout)
    importers: dict[str, list[str]] = {node: [] for node in group_of}
    for source, targets in edges.items():
        for target in targets:
            importers[target].append(source)
    place: dict[str, tuple[float, float]] = {}  # node -> top-left corner
    frames: list[tuple[str, float, float, float, float]] = []
    bands = []  # per band: its groups as (group, width, height, rows from the top)
    for band in layout.bands:
        groups = []
        for group, _ in band:
            nodes = [node for node, owner in group_of.items() if owner == group]
            floor = _floors(nodes, edges)
            rows = [sorted(node for node in nodes if floor[node] == number) for number in sorted(set(floor.values()), reverse=True)]
            widest = max(len(row) for row in rows)
            caption_w = 7.2 * len(_caption(layout, group)) + 2 * PAD if layout.captions[group] else 0
            group_w = max(widest * (BOX_W + GAP_X) - GAP_X + 2 * PAD, caption_w)
            groups.append((group, group_w, CAPTION_H + len(rows) * ROW_H + PAD, rows))
        bands.append(groups)
    width = max(sum(group_w + PAD for _, group_w, _, _ in groups) + PAD for groups in bands)
    y = TITLE_H
    for groups in bands:
        x = (width - sum(group_w + PAD for _, group_w, _, _ in groups) + PAD) / 2
        for group, group_w, group_h, rows in groups:
            frames.append((group, x, y, group_w, group_h))
            for index, row in enumerate(rows):
                # Each module under the mean place of those that import it: fewer crossings.
                def under(node: str) -> float:
                    above = [place[n][0] for n in importers[node] if n in place]
                    return sum(above) / len(above) if above else x + group_w / 2

                row.sort(key=lambda node: (under(node), node))
                row_w = len(row) * (BOX_W + GAP_X) - GAP_X
                start = x + (group_w - row_w) / 2
                for position, node in enumerate(row):
                    place[node] = (start + position * (BOX_W + GAP_X), y + CAPTION_H + PAD / 2 + index * ROW_H)
            x += group_w + PAD
        y += max(group_h for _, _, group_h, _ in groups) + PAD
    height = y
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        '<defs><marker id="head" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#4a5568"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>',
        f'<text x="{PAD}" y="30" font-size="18" font-weight="bold">{escape(layout.title)}</text>',
        f'<text x="{PAD}" y="52" font-size="12" fill="#4a5568">A -&gt; B: A imports B (an arrow a longer way '
        "implies is left out); drawn from the code by docs/draw_layout.py</text>",
    ]
    for group, x, top, group_w, group_h in frames:
        if group in layout.frameless:
            continue
        out.append(
            f'<rect x="{x:.1f}" y="{top:.1f}" width="{group_w:.1f}" height="{group_h:.1f}" rx="8" '
            'fill="#f3f6fa" stroke="#8fa3bf"/>'
        )
        caption = _caption(layout, group)
        out.append(f'<text x="{x + 10:.1f}" y="{top + 16:.1f}" font-size="12" font-weight="bold">{escape(caption)}</text>')
    for source in sorted(edges):
        for target in sorted(edges[source]):
            (sx, sy), (tx, ty) = place[source], place[target]
            inside = group_of[source] == group_of[target]
            x1, y1, x2, y2 = sx + BOX_W / 2, sy + BOX_H, tx + BOX_W / 2, ty
            if ty <= sy:  # same row or above (does not happen with imports running one way): side to side
                x1, y1, x2, y2 = sx + (BOX_W if tx > sx else 0), sy + BOX_H / 2, tx + (0 if tx > sx else BOX_W), ty + BOX_H / 2
            bend = (y2 - y1) / 2
            colour, opacity = ("#2d3748", 0.9) if inside else ("#718096", 0.45)
            out.append(
                f'<path d="M {x1:.1f} {y1:.1f} C {x1:.1f} {y1 + bend:.1f} {x2:.1f} {y2 - bend:.1f} {x2:.1f} {y2:.1f}" '
                f'fill="none" stroke="{colour}" stroke-opacity="{opacity}" stroke-width="1.2" marker-end="url(#head)"/>'
            )
    for node, (x, top) in place.items():
        name = node.rpartition("/")[2] if node.count("/") and not node.endswith("/") else node.removeprefix("estimate/")
        out.append(
            f'<rect x="{x:.1f}" y="{top:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" fill="#dbe6f3" stroke="#4a6a94"/>'
        )
        out.append(f'<text x="{x + 8:.1f}" y="{top + 15:.1f}" font-size="12">{escape(name)}</text>')
        out.append(f'<text x="{x + 8:.1f}" y="{top + 28:.1f}" font-size="10" fill="#4a5568">{lines[node]} lines</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _caption(layout: Layout, group: str) -> str:
    """A group's caption: its folder (or name) and what it is."""
    where = f"lightmem/{group}" if group.endswith("/") else group
    return f"{where}  {layout.captions[group]}"


if __name__ == "__main__":
    for layout in (OFFLOADS, ESTIMATOR):
        (DOCS / layout.out).write_text(draw(layout))
        print(f"wrote docs/{layout.out}")
