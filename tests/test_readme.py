"""The README's set-up commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first_block, "README must open with a bash block of set-up commands"
    return [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_the_example_command_and_the_test_command():
    commands = _readme_commands()
    assert len(commands) == 2
    assert "python examples/" in commands[0]
    assert commands[1].endswith("python -m pytest -q -n 2 --dist loadfile")


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == _readme_commands()[1]


def test_readme_lists_every_metric_and_every_callback_flag():
    import inspect

    from lightmem import LightMem
    from lightmem.metrics.names import METRICS

    text = (ROOT / "README.md").read_text()
    for metric in METRICS:
        assert f"`{metric.key}`" in text, metric.key
    for flag in inspect.signature(LightMem).parameters:
        assert f"`{flag}`" in text, flag


def _outside_code(text: str) -> str:
    """The text with fenced code blocks and inline code removed: links and headings there are not real."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (a repeated heading gets -1, -2, ...)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def _guide_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_in_the_guide_and_docs_reaches_a_file_and_heading():
    broken = []
    for page in _guide_pages():
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _outside_code(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            file = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and anchor not in _anchors(file):
                broken.append(f"{where} (no such heading)")
    assert broken == []


def test_the_guide_links_every_page_in_docs():
    guide = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in guide, page.name
