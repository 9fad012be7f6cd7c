"""`lightmem estimate`: table, JSON for programs, and errors with a non-zero status."""

from __future__ import annotations

import json
import os

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
        (["examples.estimate_factories:tiny_gpt", "--batch-size", "2", "--plan"], "need --budget"),
    ],
)
def test_errors_exit_with_status_2_and_a_message(capsys, argv, message):
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err
