"""The two Lightning packages: ``pytorch_lightning`` and ``lightning.pytorch`` (``import lightning as L``).

They ship separate copies of the same classes, so an ``isinstance`` against one package misses
the other's objects. Every check lightmem makes on a Lightning object goes through this module.
It never imports a package the user does not have: a class is looked up only in packages already
imported (an object of a package can only exist once that package is imported), and the callback's
bases are the ``Callback`` classes of the packages that are installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

PACKAGES = ("pytorch_lightning", "lightning.pytorch")
"""Import names of the Lightning packages, the dependency first."""


def imported_classes(module: str, name: str) -> tuple[type, ...]:
    """``name`` from ``<package>.<module>`` of each Lightning package already imported."""
    found = []
    for package in PACKAGES:
        loaded = sys.modules.get(f"{package}.{module}" if module else package)
        cls = getattr(loaded, name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_lightning_module(obj: Any) -> bool:
    """Whether ``obj`` is a ``LightningModule`` of either package."""
    return isinstance(obj, imported_classes("", "LightningModule"))


def is_strategy(strategy: Any, name: str) -> bool:
    """Whether ``strategy`` is the strategy class ``name`` of either package (``"DDPStrategy"``), or
    a subclass of it: a strategy is what it derives from, whatever its own class is called."""
    return isinstance(strategy, imported_classes("strategies", name))


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is what either package's Trainer holds when ``configure_optimizers``
    returned ``None`` (a fit without an optimizer): an optimizer over no parameters."""
    return isinstance(optimizer, imported_classes("core.optimizer", "_MockOptimizer"))


def is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` is the ``TensorBoardLogger`` of either package."""
    return isinstance(logger, imported_classes("loggers", "TensorBoardLogger"))


def callback_bases() -> tuple[type, ...]:
    """The ``Callback`` class of every installed Lightning package, ``pytorch_lightning``'s first.

    A Trainer of either package calls a callback's hooks by name, but ``LightningCLI`` accepts a
    ``class_path`` only when it subclasses its own package's ``Callback``: ``LightMem`` derives
    from both where both are installed (the two classes define the same methods).
    """
    bases = []
    for package in PACKAGES:
        try:
            bases.append(importlib.import_module(f"{package}.callbacks").Callback)
        except ImportError:  # lightning is optional; pytorch_lightning is a dependency
            continue
    return tuple(bases)


def logged_step(trainer: Any) -> int:
    """The step Lightning logs the current training batch's metrics at.

    Lightning's logger connector passes the fit loop's count of batches that stepped the optimizer
    before this one (``_batches_that_stepped``, raised after ``on_train_batch_end``): the k-th
    optimizer step is logged as ``step=k-1``, not as ``trainer.global_step`` (which counts every
    ``optimizer.step()`` and is already k there).
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def lightning_logs_this_step(trainer: Any) -> bool:
    """Whether Lightning logs the current training batch's metrics, by the parts of its rule that
    every rank shares: every ``log_every_n_steps`` optimizer steps (0: never), and every step under
    ``fast_dev_run``.

    Written out here, not asked of Lightning: its logger connector (``should_update_logs``, and
    ``fast_dev_run`` beside it in ``update_train_step_metrics``) also logs the step a Trainer stops
    at, and ``should_stop`` may be set on one rank alone (lightmem's host guard, a user's callback).
    A rank that logged then would wait in the all-reduce of the max over ranks for ranks that did
    not. That last step is therefore left to the next logged one, or to the summary.
    """
    if trainer.fast_dev_run:
        return True
    every = trainer.log_every_n_steps
    # `+ 1`: the count is raised after on_train_batch_end (see logged_step), as Lightning counts it.
    return every > 0 and (logged_step(trainer) + 1) % every == 0


def is_barebones(trainer: Any) -> bool:
    """``Trainer(barebones=True)``: Lightning switched off every feature that costs time (logging,
    progress bar, summaries); lightmem then logs, draws and prints nothing either."""
    return bool(getattr(trainer, "barebones", False))
