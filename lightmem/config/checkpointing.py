"""The checkpoint flags: which blocks (class names, classes, globs, every n-th) and what they keep
(the policy), parsed once into ``CheckpointSettings``; module targets as every flag that names
modules takes them (``checkpoint=``, ``tile=``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch.nn import Module

from lightmem.config.spelling import APPLY_CHECKPOINTING, Spelling, reject_without_partner
from lightmem.config.values import parse_count

CHECKPOINT_POLICIES = ("full", "save_matmuls")


POLICY_HELP = (
    "'full' (recompute the whole block), 'save_matmuls' (keep matmul, convolution and attention "
    "outputs, recompute the rest), or a callable (ctx, op, *args, **kwargs) -> CheckpointPolicy or bool"
)


def parse_checkpoint_policy(policy: Any, *, flag: str) -> Any:
    """Validate a checkpoint policy; returns it unchanged ("full", "save_matmuls" or the callable).

    Raises:
        ValueError: naming ``flag`` and the accepted values, for any other string or object, or a
            callable that cannot take ``(ctx, op, *args, **kwargs)``.
    """
    if isinstance(policy, str):
        if policy in CHECKPOINT_POLICIES:
            return policy
        raise ValueError(f"{flag}: expected {POLICY_HELP}; got {policy!r}")
    if not callable(policy) or isinstance(policy, type):
        raise ValueError(f"{flag}: expected {POLICY_HELP}; got {policy!r}")
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # some builtins have none: accepted, checked when called
        return policy
    try:
        signature.bind(None, None)
    except TypeError:
        raise ValueError(
            f"{flag}: a callable policy is called as policy(ctx, op, *args, **kwargs); "
            f"{getattr(policy, '__name__', policy)!r} has the signature {signature}"
        ) from None
    return policy


def parse_checkpoint_targets(targets: Any, *, flag: str) -> tuple[Any, ...]:
    """Blocks to checkpoint: class names, ``nn.Module`` classes or module-name globs; a bare name or
    class is one target. An empty list is an error: it would checkpoint nothing."""
    return parse_module_targets(targets, flag=flag, empty="checkpoints nothing")


def parse_module_targets(targets: Any, *, flag: str, empty: str) -> tuple[Any, ...]:
    """Modules an action applies to (``checkpoint=``, ``tile=``): class names, ``nn.Module`` classes
    or module-name globs; a bare name or class is one target. An empty list is an error that says
    what it would do (``empty``: "checkpoints nothing")."""
    if isinstance(targets, (str, type)):
        targets = [targets]
    try:
        result = tuple(targets)
    except TypeError:
        raise ValueError(f"{flag}: expected a list of module names, classes or glob patterns; got {targets!r}") from None
    if not result:
        raise ValueError(
            f"{flag}: expected at least one class name, class or module-name pattern; an empty list {empty}"
        )
    for target in result:
        if target == "":
            raise ValueError(f"{flag}: every pattern must be a non-empty string; got ''")
        if not isinstance(target, str) and not (isinstance(target, type) and issubclass(target, Module)):
            raise ValueError(f"{flag}: expected module names, nn.Module classes or glob patterns; got {target!r}")
    return result


@dataclass(frozen=True)
class CheckpointSettings:
    """Which blocks to checkpoint and what they keep, parsed once (``LightMem``, the estimator, the CLI)."""

    targets: tuple[Any, ...] | None
    """None: checkpoint nothing (``plan="auto"`` may still choose blocks, with ``policy``)."""
    every_n: int = 1
    policy: Any = "full"
    spelling: Spelling = APPLY_CHECKPOINTING
    policy_given: bool = False
    """The user named the policy (else ``plan="auto"`` chooses between "full" and "save_matmuls")."""

    @classmethod
    def parse(
        cls, targets: Any = None, every_n: int | None = None, policy: Any = None, *,
        spelling: Spelling = APPLY_CHECKPOINTING, planned: bool = False, planners: tuple[str, ...] = ("plan",),
    ) -> CheckpointSettings:  # fmt: skip
        """``every_n`` and ``policy`` need ``targets`` (``policy`` also serves a plan: ``planned``;
        ``planners`` names the fields that plan, for the error without any of them)."""
        flag = spelling.flag
        settings = cls(
            targets=None if targets is None else parse_checkpoint_targets(targets, flag=flag("targets")),
            every_n=1 if every_n is None else parse_count(every_n, flag=flag("every_n")),  # type: ignore[arg-type]
            policy="full" if policy is None else parse_checkpoint_policy(policy, flag=flag("policy")),
            spelling=spelling,
            policy_given=policy is not None,
        )
        if targets is None:
            if every_n is not None:
                reject_without_partner(spelling, "every_n", flag("targets"), "name the blocks to checkpoint")
            if policy is not None and not planned:
                *first, last = [flag(name) for name in ("targets", *planners)]
                partner = f"{', '.join(first)} or {last}"
                reject_without_partner(spelling, "policy", partner, "name the blocks to checkpoint")
        return settings

    def flag(self, field: str) -> str:
        return self.spelling.flag(field)
