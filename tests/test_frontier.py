"""``lightmem.frontier`` and ``lightmem estimate --frontier``: the rows the code defines (the
reference batch, its multiples as rounded, the largest batch any plan fits), each row's plan and
floor, the table and the JSON, and bad arguments.

One small model of repeated MLP blocks (few ops: each fake-tensor step is cheap) priced on an H100's
table speeds, on a budget sized from its own estimates so that the reference batch is small.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightmem import estimate_memory, frontier, max_batch_size
from lightmem import cli
from lightmem.cli import main
from lightmem.config import format_bytes
from lightmem.estimate.frontier import (
    DEFAULT_MULTIPLES,
    PLAN_WIDTH,
    Frontier,
    FrontierRow,
    floor_seconds,
    labelled_batches,
)
from lightmem.estimate.planning.space import allocated_need
from lightmem.estimate.words import format_seconds
from lightmem.estimate.pricing.costs import CHECKPOINT, saves_bytes

FACTORY_MODULE = "lightmem_frontier_test_factory"


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MLPStack(nn.Module):
    """Two repeated blocks (what the planner checkpoints) and a head."""

    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _batch(size: int) -> torch.Tensor:
    return torch.zeros(size, 16384, 64)


def stack_factory(batch_size: int):
    return MLPStack(), _batch(batch_size), stack_loss


# What every call here shares (the CLI's flags below say the same): H100 prices, no overhead allowance.
COMMON = {"gpu": "h100", "overhead_bytes": 0}


@pytest.fixture(scope="module")
def totals() -> tuple[int, int, int]:
    """Static bytes and total bytes at batch 1 and 2, without lightmem."""
    one = estimate_memory(MLPStack(), _batch(1), stack_loss, **COMMON)
    two = estimate_memory(MLPStack(), _batch(2), stack_loss, **COMMON)
    return one.static_bytes, one.total_bytes, two.total_bytes


@pytest.fixture(scope="module")
def budget(totals) -> int:
    """Room for about four more samples than one: a reference batch of a few."""
    _, one, two = totals
    return one + (two - one) * 4


@pytest.fixture(scope="module")
def found(budget) -> Frontier:
    result = frontier(MLPStack(), _batch(2), budget, stack_loss, **COMMON)
    # The case these tests are about: a reference of a few samples, a largest batch between two
    # multiples (a row of its own), and multiples beyond it that no plan fits.
    assert 2 <= result.reference_batch < result.largest_batch
    assert result.largest_batch not in labelled_batches(result.reference_batch, DEFAULT_MULTIPLES)
    assert any(not row.fits for row in result.rows)
    return result


def test_rows_are_the_rounded_multiples_of_the_reference_and_the_largest_batch(found):
    expected = labelled_batches(found.reference_batch, DEFAULT_MULTIPLES)
    expected[found.largest_batch] = "largest"
    assert [(row.batch_size, row.label) for row in found.rows] == sorted(expected.items())
    assert [row.batch_size for row in found.rows] == sorted({row.batch_size for row in found.rows})
    first = found.rows[0]
    assert (first.batch_size, first.label, first.fits) == (found.reference_batch, "1x", True)
    assert first.plan == "nothing"
    assert all(row.reference_per_sample_s == first.step_s / found.reference_batch for row in found.rows)


@pytest.mark.parametrize(
    ("reference", "multiples", "expected"),
    [
        (10, DEFAULT_MULTIPLES, {10: "1x", 15: "1.5x", 20: "2x", 30: "3x", 50: "5x", 80: "8x"}),
        # 4.5 rounds half up to 5 (round() would give the even 4).
        (3, DEFAULT_MULTIPLES, {3: "1x", 5: "1.5x", 6: "2x", 9: "3x", 15: "5x", 24: "8x"}),
        (2, (1.25,), {3: "1.25x"}),
        # 1.5 and 2 both give batch 2: it is 2x the reference, and is labelled so.
        (1, DEFAULT_MULTIPLES, {1: "1x", 2: "2x", 3: "3x", 5: "5x", 8: "8x"}),
        (1, (2, 1.5, 1), {1: "1x", 2: "2x"}),
        # 1.75 and 2.25 are as far from batch 2's ratio (2): the smaller one labels it.
        (1, (2.25, 1.75), {2: "1.75x"}),
        # A batch is at least 1: 0.2x of 1 is batch 1, which 1x labels when it is asked for.
        (1, (0.2,), {1: "0.2x"}),
        (1, (0.2, 1), {1: "1x"}),
    ],
)
def test_a_batch_is_its_multiple_rounded_half_up_and_labelled_by_the_multiple_nearest_its_ratio(
    reference, multiples, expected
):
    assert labelled_batches(reference, multiples) == expected
    assert list(labelled_batches(reference, multiples)) == sorted(expected)


def test_the_reference_and_the_largest_batch_are_max_batch_sizes_answers(found, budget):
    # frontier() searches with max_batch_size(plan=True) under checkpoint_policy "full" when it
    # plans under "auto": the same search, the same answers.
    search = max_batch_size(
        MLPStack(), _batch(2), budget, stack_loss, plan=True, checkpoint_policy="full", **COMMON
    )
    assert found.reference_batch == search.baseline
    assert found.largest_batch == search.planned
    assert found.budget_bytes == budget
    assert found.largest_batch >= found.reference_batch


def test_a_row_fits_exactly_up_to_the_largest_batch_and_its_bytes_say_so(found):
    for row in found.rows:
        assert row.fits == (row.batch_size <= found.largest_batch), row
        if row.fits:
            assert row.predicted_total_bytes <= found.budget_bytes, row
        else:
            assert row.predicted_total_bytes > found.budget_bytes, row
        # Beyond the reference the step does not fit without lightmem: a plan does something.
        if row.batch_size > found.reference_batch:
            assert row.plan != "nothing", row


def test_each_row_is_its_plan(found):
    assert sorted(found.plans) == [row.batch_size for row in found.rows]
    for row in found.rows:
        chosen = found.plans[row.batch_size]
        assert chosen.fits == row.fits
        assert row.floor_s == floor_seconds(chosen)
        if row.fits:
            assert row.step_s == chosen.step_seconds
            assert row.predicted_total_bytes == chosen.predicted_total_bytes
            assert row.plan == ("; ".join(chosen.parts()) or "nothing")
        else:
            # Not fitting: the step without lightmem, and the configuration that came closest.
            assert row.step_s == chosen.baseline_step_seconds
            closest = min(chosen.alternatives, key=lambda option: option.predicted_total_bytes)
            assert row.plan == closest.description
            assert row.predicted_total_bytes == closest.predicted_total_bytes
    assert found.speeds is not None and found.speeds.name == found.plans[found.reference_batch].speeds.name


def test_the_floor_is_between_the_steps_compute_and_the_plans_step(found):
    for row in found.rows:
        chosen = found.plans[row.batch_size]
        assert row.floor_s >= chosen.baseline_step_seconds - 1e-15, row
        if row.fits:
            assert row.floor_s <= row.step_s + 1e-15, row
            assert row.floor_vs_reference <= row.vs_reference + 1e-12, row
            assert row.vs_reference == pytest.approx(row.per_sample_s / found.rows[0].per_sample_s, rel=1e-12)
    reference = found.rows[0]
    # Without lightmem nothing leaves the device: the floor is the step itself.
    assert reference.floor_s == reference.step_s
    assert reference.vs_reference == 1.0 and reference.floor_vs_reference == 1.0


def test_to_dict_carries_every_row_and_survives_json(found):
    data = found.to_dict()
    assert set(data) == {
        "budget_bytes", "reference_batch", "largest_batch", "speeds", "rows", "reason", "seconds", "chunked_loss",
        "limit", "axis", "limited_by",
    }  # fmt: skip
    assert (data["axis"], data["limited_by"]) == ("batch", found.limited_by)
    assert data["limit"] == 1 << 16  # frontier's default: the largest batch searched
    assert data["reason"] == ""  # rows: some batch fits
    assert data["chunked_loss"] is None  # no logits here: nothing to chunk
    assert (data["budget_bytes"], data["reference_batch"], data["largest_batch"]) == (
        found.budget_bytes, found.reference_batch, found.largest_batch,
    )  # fmt: skip
    assert data["speeds"] == found.speeds.to_dict() and data["seconds"] == round(found.seconds, 3) > 0
    assert len(data["rows"]) == len(found.rows)
    for item, row in zip(data["rows"], found.rows):
        timed = {
            "step_seconds": row.step_s, "per_sample_seconds": row.step_s / row.batch_size,
            "vs_reference": row.vs_reference, "floor_seconds": row.floor_s,
            "floor_per_sample_seconds": row.floor_s / row.batch_size, "floor_vs_reference": row.floor_vs_reference,
        }  # fmt: skip
        if not row.fits:  # no step runs at this batch: no time, as the table's "-"
            timed = dict.fromkeys(timed)
        assert item == {
            "batch_size": row.batch_size, "label": row.label, "fits": row.fits, "plan": row.plan,
            "predicted_total_bytes": row.predicted_total_bytes, "host_bytes": row.host_bytes,
            "limited_by": row.limited_by, **timed,
        }  # fmt: skip
    assert data["rows"][0]["vs_reference"] == 1.0
    assert json.loads(json.dumps(data)) == data


def _cells(row: FrontierRow) -> list[list[str]]:
    """The table's lines of one row, as the module says a row reads: the plan in words wrapped at
    ``PLAN_WIDTH``, each further line of it a line of its own."""
    first, *rest = textwrap.wrap(row.plan if row.fits else f"does not fit; closest: {row.plan}", PLAN_WIDTH)
    host = format_bytes(row.host_bytes) if row.host_bytes else "-"
    if not row.fits:
        cells = [str(row.batch_size), row.label, first, format_bytes(row.predicted_total_bytes), host, "-", "-", "-", "-", "-"]
    else:
        cells = [
            str(row.batch_size), row.label, first, format_bytes(row.predicted_total_bytes), host,
            format_seconds(row.step_s), format_seconds(row.step_s / row.batch_size), f"{row.vs_reference:.2f}x",
            format_seconds(row.floor_s / row.batch_size), f"{row.floor_vs_reference:.2f}x",
        ]  # fmt: skip
    return [cells, *([line] for line in rest)]


def test_to_text_has_the_title_a_line_per_row_and_the_prices(found):
    text = found.to_text()
    lines = text.splitlines()
    assert lines[0] == (
        f"Frontier on {format_bytes(found.budget_bytes)}: reference batch {found.reference_batch} "
        f"(the largest without lightmem), largest with a plan {found.largest_batch}"
    )
    assert re.split(r"\s{2,}", lines[1].strip()) == [
        "batch", "plan", "total", "host", "step", "per sample", "vs reference", "floor / sample", "floor vs ref",
    ]  # fmt: skip
    assert set(lines[2]) <= {"-", " "}
    body = lines[3:-1]
    assert [re.split(r"\s{2,}", line.strip()) for line in body] == [cells for row in found.rows for cells in _cells(row)]
    assert lines[-1] == f"Priced at {found.speeds.describe()}."
    assert text.endswith(".\n")
    refused = sum("does not fit; closest: " in line for line in body)
    assert refused == sum(not row.fits for row in found.rows) > 0


def test_a_budget_that_no_batch_fits_without_lightmem_takes_a_batch_of_one_with_its_plan(totals):
    static, one, _ = totals
    budget = static + (one - static) * 4 // 5  # batch 1 fits only with a plan
    result = frontier(MLPStack(), _batch(2), budget, stack_loss, multiples=(2, 1.5, 1), **COMMON)
    assert result.reference_batch == 0 and result.largest_batch >= 1
    first = result.rows[0]
    assert (first.batch_size, first.label, first.fits) == (1, "1x", True)
    assert first.plan != "nothing" and first.plan == "; ".join(result.plans[1].parts())
    assert first.reference_per_sample_s == first.step_s and first.vs_reference == 1.0
    assert first.floor_s <= first.step_s
    # 1.5 x 1 rounds to 2, which is 2x the reference: batch 2 is "2x".
    expected = {1: "1x", 2: "2x"} | ({} if result.largest_batch <= 2 else {result.largest_batch: "largest"})
    assert [(row.batch_size, row.label) for row in result.rows] == sorted(expected.items())
    assert result.to_text().startswith(
        f"Frontier on {format_bytes(budget)}: nothing fits without lightmem (the reference is a batch of 1 with its "
        f"plan), largest with a plan {result.largest_batch}\n"
    )


@pytest.fixture
def no_search(monkeypatch):
    """A bad argument is refused before the frontier searches or plans anything."""

    def searched(*args, **kwargs):
        raise AssertionError("searched before the arguments were checked")

    module = sys.modules["lightmem.estimate.frontier"]  # lightmem.estimate.frontier is also the function
    monkeypatch.setattr(module, "largest_batches", searched)
    monkeypatch.setattr(module, "plan_for", searched)


@pytest.mark.parametrize(
    "multiples",
    [(), [1.0, 0], (1, -2.0), ("2",), (1, None), (1, float("nan")), (1, float("inf")), (True,), (1, False)],
)
def test_multiples_that_are_not_positive_numbers_are_refused_before_any_search(no_search, multiples):
    with pytest.raises(ValueError) as error:
        frontier(MLPStack(), _batch(2), "1GiB", stack_loss, multiples=multiples, **COMMON)
    assert str(error.value) == f"frontier(multiples=...): expected positive numbers; got {multiples!r}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"budget": "lots"},
            "frontier(budget=...): expected a byte count (int), or a string such as '512KiB', '64MiB', '2GB', "
            "'1.5GiB'; got 'lots'",
        ),
        ({"budget": -5}, "frontier(budget=...): a size cannot be negative; got -5"),
        ({"limit": 0}, "frontier(limit=...): expected an integer >= 1; got 0"),
        ({"limit": True}, "frontier(limit=...): expected an integer >= 1; got True"),
        ({"batch": {"x": 3}}, "frontier(batch=...): the batch holds no tensor with a batch dimension to scale"),
        (
            {"offload": {"include": ["blocks.0"]}},
            "frontier(offload=...)['include']: the plan chooses the modules to offload itself; leave it unset",
        ),
        ({"link_bytes_per_s": 0}, "frontier(link_bytes_per_s=...): must be positive; got 0"),
        ({"overhead_bytes": "a lot"}, "frontier(overhead_bytes=...): expected a byte count (int), or a string such "
         "as '512KiB', '64MiB', '2GB', '1.5GiB'; got 'a lot'"),
    ],
    ids=["budget-text", "budget-negative", "limit-zero", "limit-bool", "batch", "offload-include", "link", "overhead"],
)
def test_bad_arguments_are_refused_before_any_search_with_the_argument_named(no_search, kwargs, message):
    arguments = {"batch": _batch(2), "budget": "1GiB"} | kwargs
    batch, budget = arguments.pop("batch"), arguments.pop("budget")
    with pytest.raises(ValueError) as error:
        frontier(MLPStack(), batch, budget, stack_loss, **(COMMON | arguments))
    assert str(error.value) == message


def test_given_prices_price_every_row_and_its_floor(totals):
    static, one, _ = totals
    budget = static + (one - static) * 4 // 5  # batch 1 fits only with a plan: a floor with bytes to move
    result = frontier(
        MLPStack(), _batch(2), budget, stack_loss, multiples=(1,), flops_per_s=1e12, link_bytes_per_s="12GB",
        **COMMON,
    )  # fmt: skip
    assert result.speeds.link_bytes_per_s == 12e9
    assert set(result.speeds.matmul_flops_per_s.values()) == {1e12}
    assert result.to_dict()["speeds"]["to_host_bytes_per_s"] == 12e9
    for row in result.rows:
        chosen = result.plans[row.batch_size]
        assert chosen.speeds == result.speeds and chosen.settings["link_bytes_per_s"] == 12e9
        assert row.floor_s == floor_seconds(chosen)


def test_the_floor_prices_a_re_run_as_the_plan_does_launches_included_where_the_step_waits_on_the_host(totals):
    # The stack on an H100 waits on the host (42 ops at 50 us, 2.1 ms, over 126 us of device work):
    # re-running a block costs the host its launches and checkpointing's bookkeeping, 310 us, where
    # its device seconds are 12 us. Batch 1 needs half a block's bytes re-computed: its floor is the
    # step plus half the plan's own price of that block (priced at the device seconds, it was the
    # step plus 6 us: a floor far under what re-computation can cost on this device).
    static, one, _ = totals
    budget = static + (one - static) * 4 // 5
    result = frontier(MLPStack(), _batch(2), budget, stack_loss, multiples=(1,), offload=False, **COMMON)
    row, chosen = result.rows[0], result.plans[1]
    assert (row.batch_size, row.plan) == (1, "checkpoint blocks.0 (MLPBlock)")
    base, block = chosen.baseline_step_seconds, chosen.estimate.blocks["blocks.0"]
    assert chosen.step_seconds - base == pytest.approx(310e-6, rel=1e-9)
    baseline = chosen.estimate.scenarios["baseline"]
    need = allocated_need(baseline.peak_bytes, baseline.reserved, budget - chosen.overhead_bytes)
    share = need / saves_bytes(block, CHECKPOINT, chosen.costs)
    assert 0 < share < 1
    assert row.floor_s == pytest.approx(base + share * (chosen.step_seconds - base), rel=1e-9)


@pytest.fixture
def factory_spec(monkeypatch) -> str:
    module = types.ModuleType(FACTORY_MODULE)
    module.make = stack_factory
    monkeypatch.setitem(sys.modules, FACTORY_MODULE, module)
    return f"{FACTORY_MODULE}:make"


def _cli(factory_spec: str, budget: int, *flags: str) -> int:
    return main([
        "estimate", factory_spec, "--batch-size", "2", "--budget", str(budget), "--gpu", "h100",
        "--overhead", "0", "--frontier", *flags,
    ])  # fmt: skip


def test_cli_frontier_prints_the_frontiers_table_after_the_estimate(
    capsys, monkeypatch, factory_spec, budget, found
):
    # The frontier the command computes is the API's (the JSON test below runs it for real); here
    # it is handed the one computed already, and what the command asked for is checked.
    calls = []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs))
        return found

    monkeypatch.setattr(cli, "frontier", recorded)
    assert _cli(factory_spec, budget) == 0
    out = capsys.readouterr().out
    [(args, kwargs)] = calls
    assert isinstance(args[0], MLPStack) and tuple(args[1].shape) == (2, 16384, 64)
    assert args[2] == str(budget) and args[3] is stack_loss
    asked = (kwargs["gpu"], kwargs["overhead_bytes"], kwargs["device"], kwargs["offload"])
    assert asked == ("h100", "0", "cuda", None)
    assert "checkpoint_policy" not in kwargs  # not given: the frontier's own default ("auto")
    table = found.to_text()
    assert out.endswith(table) and out.count("Frontier on ") == 1
    assert "does not fit; closest: " in table
    assert out[: -len(table)].strip()  # the estimate's own report comes first


def test_cli_frontier_json_is_the_frontiers_dict(capsys, factory_spec, budget, found):
    assert _cli(factory_spec, budget, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"estimate", "frontier"}
    assert data["estimate"]["batch_size"] == 2 and data["estimate"]["budget_bytes"] == budget
    got, expected = data["frontier"], found.to_dict()
    assert got.pop("seconds") > 0
    expected.pop("seconds")
    assert got == expected


@pytest.fixture
def asked(monkeypatch, found) -> list[dict]:
    """What the command asks frontier() for (the frontier computed already is its answer)."""
    calls = []

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return found

    monkeypatch.setattr(cli, "frontier", recorded)
    return calls


def test_cli_frontier_takes_the_checkpoint_policy(capsys, factory_spec, budget, asked):
    assert _cli(factory_spec, budget, "--checkpoint-policy", "save_matmuls") == 0
    assert capsys.readouterr().err == ""
    [kwargs] = asked
    assert kwargs["checkpoint_policy"] == "save_matmuls"


def test_cli_frontier_prices_at_the_link_speed_given(capsys, factory_spec, budget, asked):
    assert _cli(factory_spec, budget, "--link-bytes-per-s", "12GB") == 0
    assert capsys.readouterr().err == ""
    [kwargs] = asked
    assert kwargs["link_bytes_per_s"] == "12GB"


def test_cli_frontier_refuses_offload_include_as_typed(capsys, factory_spec, budget):
    assert _cli(factory_spec, budget, "--offload-include", "blocks.0") == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: --offload-include: the plan chooses the modules to offload itself; leave it unset\n"
    )


def test_cli_frontier_without_a_budget_on_the_cpu_is_an_error_that_names_frontier(capsys, monkeypatch, factory_spec):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = main(["estimate", factory_spec, "--batch-size", "2", "--device", "cpu", "--frontier"])
    assert status == 2
    assert capsys.readouterr().err == (
        "lightmem estimate: error: --frontier: without --budget, it plans for the memory the CUDA device can give "
        "this process, and --device is 'cpu' (no CUDA device here); pass the budget to plan for, e.g. --budget 24GiB\n"
    )
