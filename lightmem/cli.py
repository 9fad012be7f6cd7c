"""The ``lightmem`` command: ``lightmem estimate package.module:factory --batch-size 32 --budget 24GiB``.

The factory is ``factory(batch_size: int) -> (model, batch)`` or ``(model, batch, loss_fn)``, named
as ``package.module:function`` (importable from the current directory) or ``path/to/file.py:function``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightmem.checkpoint import select_blocks
from lightmem.config import (
    CLI,
    CheckpointSettings,
    OffloadSettings,
    OptimizerOffloadSettings,
    PlanPrices,
    format_bytes,
    parse_size,
    reject_without_partner,
)
from lightmem.device_memory import (
    FRAGMENTATION_MARGIN,
    DeviceBudget,
    measure_device_budget,
    memory_to_measure,
    overhead_for_measured_budget,
)
from lightmem.devices import parse_gpu
from lightmem.estimate import estimate_memory, frontier, max_batch_size, plan
from lightmem.config.estimator import parse_device, parse_optimizer, parse_overhead, parse_precision


def load_factory(spec: str) -> Callable[[int], Any]:
    """Import ``module:function`` or ``file.py:function``, as Python would run them: a file with its
    own folder first on ``sys.path`` (``python file.py``), so that it imports the modules beside it;
    a module from the current directory (``python -m``).

    Raises:
        ValueError: the spec has no ':', the file or function cannot be found, or importing the
            module fails (the message names the ``factory`` argument and the error; the error is the
            cause).
    """
    if ":" not in spec:
        raise ValueError(f"factory: expected 'package.module:function' or 'file.py:function'; got {spec!r}")
    module_name, _, attribute = spec.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.exists(path):
            raise ValueError(f"factory: no such file {module_name!r}")
        folder = os.path.dirname(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        name = os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            del sys.modules[name]
            raise ValueError(f"factory: cannot import {module_name!r}: {_import_failure(error)}") from error
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: modules of the current project
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise ValueError(f"factory: cannot import {module_name!r}: {_import_failure(error)}") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"factory: {module_name!r} has no function {attribute!r}")
    return factory


def _import_failure(error: BaseException) -> str:
    """What went wrong importing the factory's module, and where: ``ModuleNotFoundError: No module
    named 'helpers' (my_file.py, line 1)``."""
    frames = [
        frame for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename != __file__ and not frame.filename.startswith("<") and "importlib" not in frame.filename
    ]  # fmt: skip
    where = f" ({os.path.basename(frames[-1].filename)}, line {frames[-1].lineno})" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def _call_factory(factory: Callable[[int], Any], batch_size: int) -> tuple[Any, Any, Any]:
    made = factory(batch_size)
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(
            f"factory: must return (model, batch) or (model, batch, loss_fn); got {type(made).__name__}"
        )
    model, batch = made[0], made[1]
    loss_fn = made[2] if len(made) == 3 else None
    return model, batch, loss_fn


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightmem", description="lightmem: memory tools for PyTorch Lightning"
    )
    parser.add_argument("--version", action="version", version=f"lightmem {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    estimate = commands.add_parser(
        "estimate",
        help="predict the memory of one training step (fake tensors: no GPU, no real allocation)",
        description="Predict the peak memory of one steady-state training step and where it goes.",
    )
    estimate.add_argument(
        "factory",
        help="package.module:function or file.py:function; function(batch_size) -> (model, batch[, loss_fn])",
    )
    estimate.add_argument("--batch-size", type=int, required=True, help="batch size passed to the factory")
    estimate.add_argument(
        "--budget",
        help="device memory to fit, e.g. 24GiB (--plan, --max-batch-size and --frontier without it, with a "
        f"CUDA --device: what that GPU can give this process now, less {FRAGMENTATION_MARGIN:.0%}% "  # %%: argparse
        "for fragmentation)",
    )
    estimate.add_argument(
        "--optimizer",
        default=None,
        help="torch.optim name (default: adamw, or configure_optimizers of a LightningModule)",
    )
    estimate.add_argument(
        "--precision",
        default="32-true",
        help="Lightning precision: 32-true, 16-mixed, bf16-mixed, bf16-true, ...",
    )
    estimate.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    estimate.add_argument(
        "--gpu", default="auto",
        help="the GPU to estimate and price for: h100, h200, a100, l4, ... (its speeds and cuBLAS workspaces); "
        "auto (default): this machine's GPU, or a generic A100-class one without CUDA",
    )  # fmt: skip
    estimate.add_argument(
        "--overhead",
        default=None,
        help="allowance for what is not modelled (default 1GiB on cuda, 0 on cpu; 0 for a budget measured "
        "without --budget, which the CUDA context is already out of)",
    )
    estimate.add_argument(
        "--zero-grad",
        default="after_forward",
        choices=["after_forward", "before_forward"],
        help="when gradients are set to None: after_forward (Lightning, default) or before_forward "
        "(a plain PyTorch loop: zero_grad, forward, backward, step)",
    )
    estimate.add_argument(
        "--checkpoint",
        nargs="+",
        default=None,
        metavar="TARGET",
        help="checkpoint these blocks (names, class names, globs)",
    )
    estimate.add_argument(
        "--checkpoint-policy",
        default=None,
        metavar="POLICY",
        help="what checkpointed blocks keep: full (their inputs, default) or save_matmuls (also matmul, "
        "convolution and attention outputs); needs --checkpoint, --plan or --frontier",
    )
    estimate.add_argument("--offload", action="store_true", help="simulate lightmem's activation offload")
    estimate.add_argument("--offload-min-bytes", default=None, help="offload threshold (default 1MiB)")
    estimate.add_argument(
        "--offload-include", nargs="+", default=None, metavar="PATTERN", help="offload only in these modules"
    )
    estimate.add_argument(
        "--offload-exclude", nargs="+", default=None, metavar="PATTERN", help="never offload in these modules"
    )
    estimate.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="simulate model-state offload: gradients, optimizer state and step on the host",
    )
    estimate.add_argument(
        "--offload-optimizer-device-dtype", default=None, metavar="DTYPE",
        help="with --offload-optimizer: the parameters' dtype on the device, bf16 (fp32 masters on the "
        "host; half the device weights and link bytes); needs --precision bf16-mixed",
    )  # fmt: skip
    estimate.add_argument(
        "--plan",
        action="store_true",
        help="also plan the cheapest configuration that fits --budget, under the --offload-* and "
        "--checkpoint-policy flags (the plan chooses the modules itself)",
    )
    estimate.add_argument(
        "--max-batch-size", action="store_true",
        help="also search the largest batch that fits --budget (with --plan: also with the best plan)",
    )  # fmt: skip
    estimate.add_argument(
        "--link-bytes-per-s", default=None, metavar="SIZE",
        help="host link speed per second, each way, that --plan and --frontier price transfers at (default: the "
        "--gpu's own)",
    )  # fmt: skip
    estimate.add_argument(
        "--frontier", action="store_true",
        help="the frontier: for 1x, 1.5x, 2x, 3x, 5x and 8x the largest batch without lightmem, and the largest "
        "any plan fits, the best plan's predicted time per sample against that batch and the device's floor",
    )  # fmt: skip
    estimate.add_argument("--json", action="store_true", help="print JSON instead of the table")
    estimate.add_argument(
        "--verbose", action="store_true", help="list everything the estimate does not model"
    )
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightmem")
    except PackageNotFoundError:  # run from a source tree that was not installed
        import lightmem

        return lightmem.__version__


@dataclass(frozen=True)
class _Flags:
    """The estimate command's lightmem flags, parsed once under the names the user typed."""

    offload: OffloadSettings | None
    checkpoint: CheckpointSettings
    optimizer_offload: OptimizerOffloadSettings | None
    """None: no ``--offload-optimizer``."""


def _check_flags(args: argparse.Namespace) -> _Flags:
    """Validate the values with the API's own parsers, under the names the user typed (``--budget``)."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected a positive integer; got {args.batch_size}")
    device = parse_device(args.device, flag="--device")
    precision = parse_precision(args.precision, flag="--precision")
    parse_optimizer(args.optimizer, flag="--optimizer")
    parse_overhead(args.overhead, device, flag="--overhead")
    parse_gpu(args.gpu, flag="--gpu")
    if args.budget is not None:
        parse_size(args.budget, flag="--budget")
    offload = None
    if args.offload or args.offload_min_bytes or args.offload_include or args.offload_exclude:
        offload_flags = {"min_bytes": args.offload_min_bytes, "include": args.offload_include, "exclude": args.offload_exclude}
        given = {name: value for name, value in offload_flags.items() if value is not None}
        offload = OffloadSettings.for_estimate(spelling=CLI, **given)
    planned = args.plan or args.frontier  # these plan: --checkpoint-policy and --link-bytes-per-s serve them
    checkpoint = CheckpointSettings.parse(
        args.checkpoint, None, args.checkpoint_policy, spelling=CLI, planned=planned, planners=("plan", "frontier")
    )
    optimizer_offload = None
    device_dtype = args.offload_optimizer_device_dtype
    if args.offload_optimizer:
        optimizer_offload = OptimizerOffloadSettings.parse(spelling=CLI, device_dtype=device_dtype)
        optimizer_offload.refuse_precision(precision.name)
    elif device_dtype is not None:
        reject_without_partner(CLI, "device_dtype", "--offload-optimizer", "add --offload-optimizer")
    if args.link_bytes_per_s is not None:  # validated here under its own name; plan() takes the text
        if not planned:
            reject_without_partner(CLI, "link_bytes_per_s", "--plan or --frontier", "add one of them")
        PlanPrices.parse(flops_per_s=None, link_bytes_per_s=args.link_bytes_per_s, spelling=CLI)
    return _Flags(offload, checkpoint, optimizer_offload)


def _measured_budget(args: argparse.Namespace) -> DeviceBudget | None:
    """Without ``--budget``, ``--plan``, ``--max-batch-size`` and ``--frontier`` plan for what this
    machine's device can give (the rule of ``LightMem(plan="auto")``); None when a budget was given or
    not needed.

    Raises:
        ValueError: no ``--budget`` and ``--device`` is not a CUDA device here to measure.
    """
    needing = [flag for flag, given in (("--plan", args.plan), ("--max-batch-size", args.max_batch_size),
               ("--frontier", args.frontier)) if given]  # fmt: skip
    if args.budget is not None or not needing:
        return None
    memory = memory_to_measure(
        torch.device(args.device), flag=needing[0], budget_flag="--budget",
        subject="it", device_named="--device", example="--budget 24GiB",
    )  # fmt: skip
    return measure_device_budget(memory)


def run_estimate(args: argparse.Namespace) -> int:
    flags = _check_flags(args)
    measured = _measured_budget(args)
    budget = args.budget if measured is None else measured.budget_bytes
    factory = load_factory(args.factory)
    model, batch, loss_fn = _call_factory(factory, args.batch_size)
    targets = flags.checkpoint.targets
    if targets is not None:  # a typo fails under the flag's own name, before any tracing
        select_blocks(model, targets, targets_flag=flags.checkpoint.flag("targets"))
    overhead = args.overhead
    if measured is not None and overhead is None:
        # A measured budget is what is left after the CUDA context: the default allowance would
        # count the context again.
        overhead = overhead_for_measured_budget(world_size=1)
    common = {
        "optimizer": args.optimizer,
        "precision": args.precision,
        "device": args.device,
        "overhead_bytes": overhead,
        "zero_grad": args.zero_grad,
        "offload_optimizer": flags.optimizer_offload or False,
        "gpu": args.gpu,
    }
    policy = flags.checkpoint.policy
    result = estimate_memory(
        model, batch, loss_fn, offload=flags.offload, checkpoint=targets, checkpoint_policy=policy,
        budget=budget, **common,
    )  # fmt: skip
    output: dict[str, Any] = {"estimate": result.to_dict()}
    if measured is not None:
        output["measured_budget"] = {"budget_bytes": measured.budget_bytes, "how": measured.describe()}
    found_plan = search = None
    link = {} if args.link_bytes_per_s is None else {"link_bytes_per_s": args.link_bytes_per_s}
    if args.plan:
        found_plan = plan(
            model, batch, budget, loss_fn, offload=flags.offload, checkpoint_policy=policy, **common, **link
        )
        output["plan"] = found_plan.to_dict()
    if args.max_batch_size:
        search = max_batch_size(
            model, batch, budget, loss_fn, offload=flags.offload, checkpoint=targets, checkpoint_policy=policy,
            plan=args.plan, **common, **link,
        )  # fmt: skip
        output["max_batch_size"] = search.to_dict()
    found_frontier = None
    if args.frontier:
        found_frontier = frontier(
            model, batch, budget, loss_fn, offload=flags.offload, **({"checkpoint_policy": policy}
            if flags.checkpoint.policy_given else {}), **common, **link,
        )  # fmt: skip
        output["frontier"] = found_frontier.to_dict()
    if args.json:
        print(json.dumps(output, indent=2))
        return 0
    if measured is not None:
        print(f"Budget (no --budget given: what this device can give this process): {measured.describe()}")
    result.print(verbose=args.verbose)
    if found_plan is not None:
        print(f"Plan: {found_plan.describe()}")
        if found_plan.fits and (found_plan.checkpoint or found_plan.offload or found_plan.offload_optimizer):
            print(f"LightMem(**{found_plan.lightmem_kwargs()})")
    if search is not None:
        fits = args.budget if measured is None else format_bytes(measured.budget_bytes)
        line = f"Largest batch that fits {fits}: {search.baseline} without lightmem"
        if search.configured is not None:
            line += f", {search.configured} with the given offload/checkpoint/offload-optimizer flags"
        if search.planned is not None:
            line += f", {search.planned} with the best plan"
        print(line)
        if search.plan is not None and search.plan.fits:
            print(f"Plan at batch {search.planned}: {search.plan.describe()}")
    if found_frontier is not None:
        found_frontier.print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lightmem`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "estimate":
            return run_estimate(args)
    except ValueError as error:
        print(f"lightmem {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # EstimateError and failures of the user's model on fake tensors
        print(f"lightmem {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
