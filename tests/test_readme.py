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
    assert commands[1].endswith("python -m pytest -q")


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
