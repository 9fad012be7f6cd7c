"""`lightmem estimate`: table, JSON for programs, and errors with a non-zero status."""

from __future__ import annotations

import json
import os
import sys

import pytest

from lightmem.cli import main

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_json_output_parses_and_carries_the_estimate(capsys):
    status = main([
        "estimate", "examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--budget", "1GiB",
        "--device", "cpu", "--optimizer", "sgd", "--json",
    ])  # fmt: skip
    assert status == 0
    data = json.loads(capsys.readouterr().out)
    estimate = data["estimate"]
    assert estimate["batch_size"] == 2 and estimate["device"] == "cpu" and estimate["optimizer"] == "sgd"
    assert sum(estimate["breakdown"].values()) == estimate["peak_bytes"]
    assert estimate["fits"] is True and estimate["budget_bytes"] == 2**30
    assert [item["rule"] for item in estimate["advice"]] == ["quadratic-attention"]


def test_table_output_with_a_file_factory_and_plan(capsys):
    status = main([
        "estimate", "examples/estimate_factories.py:tiny_gpt", "--batch-size", "2", "--budget", "1GiB",
        "--device", "cpu", "--plan", "--checkpoint", "blocks.*",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert "baseline" in out and "checkpoint" in out and "peak" in out
    assert "Plan: Fits 1.00 GiB without lightmem" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["examples.estimate_factories:nope", "--batch-size", "2"], "has no function 'nope'"),
        (["no_such_module:f", "--batch-size", "2"], "cannot import 'no_such_module'"),
        (["examples.estimate_factories", "--batch-size", "2"], "expected 'package.module:function'"),
        (
            ["examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--precision", "fp8"],
            "unknown precision 'fp8'",
        ),
        (["examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--plan"], "--plan: without --budget, it plans"),
    ],
)
def test_errors_exit_with_status_2_and_a_message(capsys, argv, message):
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_file_factory_imports_the_modules_beside_it_as_python_would(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "issue52_layers.py").write_text(
        "import torch\n\ndef make(batch_size):\n"
        "    return torch.nn.Linear(8, 8), torch.randn(batch_size, 8), lambda model, batch: model(batch).sum()\n"
    )
    (tmp_path / "issue52_factory.py").write_text("from issue52_layers import make\n\ndef factory(n):\n    return make(n)\n")
    monkeypatch.chdir(tmp_path.parent)
    status = main(["estimate", f"{tmp_path.name}/issue52_factory.py:factory", "--batch-size", "2", "--device", "cpu", "--json"])
    assert status == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["parameter_count"] == 72


def test_a_factory_module_that_fails_to_import_exits_2_naming_the_argument_and_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "issue52_broken.py").write_text("import torch\nimport issue52_not_installed\n\ndef factory(n):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert main(["estimate", "issue52_broken.py:factory", "--batch-size", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: factory: cannot import 'issue52_broken.py': ModuleNotFoundError: No module named "
        "'issue52_not_installed' (issue52_broken.py, line 2)\n"
    )
    assert main(["estimate", "issue52_broken:factory", "--batch-size", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: factory: cannot import 'issue52_broken': ModuleNotFoundError: No module named "
        "'issue52_not_installed' (issue52_broken.py, line 2)\n"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget", "lots"], "lightmem estimate: error: --budget: expected a byte count (int), or a string"),
        (["--precision", "fp8"], "lightmem estimate: error: --precision: unknown precision 'fp8'"),
        (["--device", "tpu"], "lightmem estimate: error: --device: "),
        (["--overhead", "-"], "lightmem estimate: error: --overhead: expected a byte count"),
        (["--offload-min-bytes", "big"], "lightmem estimate: error: --offload-min-bytes: expected a byte count"),
        (["--offload-include", "nothing_here"], "lightmem estimate: error: --offload-include: 'nothing_here' matches no module"),
        (["--checkpoint", "Blok"], "lightmem estimate: error: --checkpoint: 'Blok' matches no module"),
    ],
)
def test_errors_name_the_command_line_flag_not_the_python_argument(capsys, flags, message):
    assert main(["estimate", "examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert "(budget=" not in err and "offload=...)" not in err and "checkpoint=...)" not in err


def test_link_speed_without_plan_or_frontier_names_both(capsys):
    argv = ["examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--budget", "64MiB", "--device", "cpu"]
    assert main(["estimate", *argv, "--max-batch-size", "--link-bytes-per-s", "12GB"]) == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: --link-bytes-per-s: has no effect without --plan or --frontier; add one of "
        "them or leave --link-bytes-per-s unset\n"
    )


def test_version_prints_the_package_version(capsys):
    import lightmem

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"lightmem {lightmem.__version__}\n"
