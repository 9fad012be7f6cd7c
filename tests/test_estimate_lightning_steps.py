"""The dry run runs a LightningModule's step as Lightning does (issue 56): the estimated peak of
each step contract equals a real CPU step measured by MemTracker while a Trainer runs it
(``lightmem.testing.measure.measure_lightning_step``), in a child process as in
test_estimate_accuracy.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IDIOMS = ("automatic", "manual_one", "manual_two", "reads_values")


def _measure() -> None:
    import warnings

    import pytorch_lightning as pl
    from idiom_models import idiom_class, loader

    from lightmem import estimate_memory
    from lightmem.testing.measure import measure_lightning_step

    warnings.simplefilter("ignore")
    results = []
    for idiom in IDIOMS:
        pl.seed_everything(0, verbose=False)
        # MemTracker cannot follow parameters whose requires_grad a step toggles: both without.
        untoggled = type(idiom, (idiom_class(idiom, pl),), {"toggles": False})
        measured = measure_lightning_step(untoggled(), loader(), pl)
        batch = next(iter(loader()))
        predicted = estimate_memory(untoggled(), batch, device="cpu").scenarios["baseline"]
        results.append({"idiom": idiom, "measured": measured.peak_bytes, "predicted": predicted.peak_bytes,
                        "measured_parts": measured.breakdown, "predicted_parts": predicted.breakdown})
    print(json.dumps(results))


@pytest.fixture(scope="module")
def steps() -> dict[str, dict]:
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["idiom"]: item for item in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("idiom", IDIOMS)
def test_the_estimated_peak_of_each_step_contract_is_the_measured_one_to_the_byte(steps, idiom):
    # The estimator's usual accuracy on the CPU is 1% of the peak; these steps trace exactly.
    result = steps[idiom]
    assert result["predicted"] == result["measured"], result


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    _measure()
