"""Ops whose fake kernel is stricter than the real one: mixture-of-experts models can be estimated.

torch 2.13's fake ``aten._grouped_mm`` (what Hugging Face's experts run by default) takes only
bfloat16, while the real CPU kernel takes float32 too. The estimate computes that op's output
itself, runs any other refusing op for real on small zero tensors, and claims that a real step
fails only after a real kernel refused. The Mixtral figures are checked against a real CPU step
measured by torch's MemTracker in a child process (this file run as a script), as in
test_estimate_accuracy.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_defaults import default_model  # noqa: E402

from lightmem import estimate_memory  # noqa: E402
from lightmem.estimate import EstimateError  # noqa: E402
from lightmem.estimate.device.kernels import REAL_RUN_LIMIT_BYTES  # noqa: E402

MIXTRAL_RUNS = ("plain", "full", "save_matmuls")


def mixtral_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


@pytest.fixture(scope="module")
def mixtral_steps() -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, __file__, "--measure"], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["run"]: item for item in json.loads(done.stdout.strip().splitlines()[-1])}


def test_mixtral_runs_grouped_mm_experts_by_default():
    assert default_model("mixtral").config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("run", MIXTRAL_RUNS)
def test_mixtral_from_its_default_config_is_estimated_within_two_percent(mixtral_steps, run):
    result = mixtral_steps[run]
    assert abs(result["predicted_peak"] - result["measured_peak"]) <= 0.02 * result["measured_peak"], result


def test_mixtral_without_checkpointing_is_estimated_to_the_byte(mixtral_steps):
    result = mixtral_steps["plain"]
    assert result["predicted_peak"] == result["measured_peak"]
    assert result["predicted"] == result["measured"]


# -- an op whose fake kernel refuses what its real kernel takes -------------------------------------


@torch.library.custom_op("lightmem_tests::strict_double", mutates_args=())
def strict_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@strict_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the fake kernel takes bfloat16 only")


class Doubles(nn.Module):
    """Doubles its input with ``double`` (a real op, or the strict one), then a linear layer."""

    def __init__(self, double, rows: int | None = None) -> None:
        super().__init__()
        self.double = double
        self.rows = rows
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if self.rows is not None:  # a large tensor made in forward: it exists only on fake tensors
            x = x.new_ones(self.rows, 8)
        return self.linear(self.double(x))


def _sum_loss(model, x):
    return model(x).sum()


def test_a_small_op_the_fake_kernel_refuses_runs_for_real_and_is_counted_as_its_real_twin():
    x = torch.randn(16, 8)
    expected = estimate_memory(Doubles(lambda t: t * 2), x, _sum_loss, device="cpu")
    actual = estimate_memory(Doubles(strict_double), x, _sum_loss, device="cpu")
    assert actual.peak_bytes == expected.peak_bytes
    assert actual.breakdown == expected.breakdown


def test_a_large_op_the_fake_kernel_refuses_is_reported_without_claiming_a_real_step_fails():
    rows = REAL_RUN_LIMIT_BYTES // 16  # 8 float32 columns: twice the limit, on fake tensors only
    with pytest.raises(EstimateError) as caught:
        estimate_memory(Doubles(strict_double, rows), torch.randn(2, 8), _sum_loss, device="cpu")
    assert str(caught.value) == (
        "the training step fails on fake tensors in the model (Doubles) at lightmem_tests.strict_double with "
        f"inputs of shape [{rows}, 8]: the fake kernel takes bfloat16 only. lightmem did not run the real kernel "
        "(its inputs take 128.00 MiB, more than the 64.00 MiB lightmem runs an op on for real), so it cannot tell "
        "whether a real step fails: a fake kernel can be stricter than the real one. If a real step runs, measure "
        "it (lightmem.testing.measure.measure_cpu_step) and please report the op."
    )
    assert "A real step fails" not in str(caught.value)


def test_an_op_the_real_kernel_refuses_too_says_a_real_step_fails_there_too():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(10, 3)))
    with pytest.raises(EstimateError) as caught:
        estimate_memory(model, torch.randn(4, 8), _sum_loss, device="cpu")
    assert str(caught.value).endswith(
        "A real step fails there too: check the batch's shapes and dtypes against the model."
    )


def _measure_child() -> None:
    from lightmem import apply_checkpointing
    from lightmem.testing.measure import measure_cpu_step

    torch.set_num_threads(1)
    results = []
    for run in MIXTRAL_RUNS:
        options = {} if run == "plain" else {"checkpoint": ["MixtralDecoderLayer"], "checkpoint_policy": run}
        estimate = estimate_memory(default_model("mixtral"), mixtral_batch(), hf_loss, device="cpu", **options)
        model = default_model("mixtral")
        if options:
            apply_checkpointing(model, ["MixtralDecoderLayer"], policy=run)
        measured = measure_cpu_step(model, mixtral_batch(), hf_loss)
        results.append({
            "run": run, "predicted_peak": estimate.peak_bytes, "measured_peak": measured.peak_bytes,
            "predicted": estimate.breakdown, "measured": measured.breakdown,
        })  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:
    import warnings

    warnings.simplefilter("ignore")
    _measure_child()
