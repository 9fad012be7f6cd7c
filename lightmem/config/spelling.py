"""How each entry point spells its flags, so that an error raised deep inside names the flag the
user typed (``LightMem(offload_include=...)``, ``estimate_memory(offload=...)['include']``,
``--offload-include``) with no rewrite table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    """How one entry point spells its flags, so that an error raised deep inside (a pattern that
    matches no module, found at the first batch) names the flag the user typed, with no rewrite.

    Every settings object below carries one. ``names`` maps a settings field to the entry point's
    own name for it (absent: the field's name; ``""``: the entry point itself, a function whose
    call is the switch); ``style`` is how a flag is written:
    ``"call"``: ``LightMem(offload_min_bytes=...)``, ``"key"``: ``estimate_memory(offload=...)['min_bytes']``,
    ``"cli"``: ``--offload-min-bytes``.
    """

    entry: str
    names: tuple[tuple[str, str], ...] = ()
    style: str = "call"

    def name(self, field: str) -> str:
        """The bare name: ``checkpoint_policy``, ``--checkpoint-policy``."""
        name = dict(self.names).get(field, field)
        return f"--{name}" if self.style == "cli" else name

    def flag(self, field: str) -> str:
        name = dict(self.names).get(field, field)
        if name == "":  # the entry point is itself the switch: offload_optimizer(model, optimizer)
            return self.entry
        if self.style == "cli":
            return f"--{name}"
        if self.style == "key":
            return f"{self.entry}['{name}']"
        return f"{self.entry}({name}=...)"


LIGHTMEM = Spelling("LightMem", (
    ("min_bytes", "offload_min_bytes"), ("devices", "offload_devices"), ("include", "offload_include"),
    ("exclude", "offload_exclude"), ("prefetch", "prefetch_bytes"), ("max_inflight_bytes", "offload_max_inflight_bytes"),
    ("targets", "checkpoint"), ("every_n", "checkpoint_every"), ("policy", "checkpoint_policy"),
    ("groups", "metrics"), ("limit", "host_limit"), ("warn_at", "host_warn_at"), ("stop_at", "host_stop_at"),
    ("stop_checkpoint", "host_stop_checkpoint"), ("enabled", "offload_optimizer"),
    ("max_grad_inflight_bytes", "offload_max_inflight_bytes"), ("overlap_step", "offload_overlap_step"),
    ("device_dtype", "offload_optimizer_device_dtype"), ("modules", "tile"),
))  # fmt: skip
"""``LightMem``'s keyword arguments."""


OFFLOAD_ACTIVATIONS = Spelling("offload_activations")


APPLY_CHECKPOINTING = Spelling("apply_checkpointing")


APPLY_TILING = Spelling("apply_tiling", (("modules", "targets"),))


OFFLOAD_OPTIMIZER = Spelling("offload_optimizer", (("enabled", ""),))
"""``offload_optimizer(model, optimizer, ...)``: the function is the switch."""


CLI = Spelling("lightmem estimate", (
    ("min_bytes", "offload-min-bytes"), ("include", "offload-include"), ("exclude", "offload-exclude"),
    ("targets", "checkpoint"), ("policy", "checkpoint-policy"),
    ("enabled", "offload-optimizer"), ("device_dtype", "offload-optimizer-device-dtype"),
    ("link_bytes_per_s", "link-bytes-per-s"),
), style="cli")  # fmt: skip
"""The ``lightmem estimate`` command's options."""


def reject_without_partner(spelling: Spelling, field: str, partner: str, what: str) -> None:
    """A flag that does nothing without its partner is an error that names both: ``partner`` as
    the user writes it, ``what`` the way to give it."""
    raise ValueError(
        f"{spelling.flag(field)}: has no effect without {partner}; {what} or leave {spelling.name(field)} unset"
    )
