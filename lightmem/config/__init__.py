"""Parsing and validation of user-facing configuration values, and the settings they make.

Every bad value fails with a message that names the flag and what it accepts. Each flag is parsed
once into one frozen settings object per concern, which the callback, the functions, the
estimator/planner and the CLI all read; a settings object carries its entry point's ``Spelling``,
so an error names the flag as the user typed it. One module per group: ``units`` (sizes),
``values`` (switches, counts, choices, patterns), ``spelling``, ``offload``,
``optimizer_offload``, ``checkpointing``, ``tiling``, ``fit`` (metrics, host guard, ``plan="auto"``,
``LightMemSettings``) and ``estimator`` (the estimator's and planner's flags).
"""

from lightmem.config.checkpointing import (
    CHECKPOINT_POLICIES,
    POLICY_HELP,
    CheckpointSettings,
    parse_checkpoint_policy,
    parse_checkpoint_targets,
    parse_module_targets,
)  # fmt: skip
from lightmem.config.estimator import PlanPrices
from lightmem.config.fit import HostGuardSettings, LightMemSettings, MetricsSettings, PlanSettings
from lightmem.config.offload import (
    DEFAULT_HOST_BUDGET,
    DEFAULT_HOST_MIN_AVAILABLE,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_MIN_BYTES,
    DEFAULT_PREFETCH,
    OffloadSettings,
)  # fmt: skip
from lightmem.config.optimizer_offload import (
    DEFAULT_GRAD_INFLIGHT,
    OptimizerOffloadSettings,
    parse_optimizer_offload,
)
from lightmem.config.spelling import (
    APPLY_CHECKPOINTING,
    APPLY_TILING,
    CLI,
    LIGHTMEM,
    OFFLOAD_ACTIVATIONS,
    OFFLOAD_OPTIMIZER,
    Spelling,
    reject_without_partner,
)  # fmt: skip
from lightmem.config.tiling import TileSettings
from lightmem.config.units import (
    DECIMAL_UNITS_NOTE,
    SIZE_HELP,
    available_ram_bytes,
    decimal_reading,
    format_bytes,
    host_ram_share_bytes,
    parse_fraction,
    parse_host_limit,
    parse_size,
    ranks_per_node_from_env,
    total_ram_bytes,
)  # fmt: skip
from lightmem.config.values import (
    DEVICE_DTYPES,
    device_dtype_name,
    parse_bool,
    parse_choices,
    parse_count,
    parse_device_dtype,
    parse_devices,
    parse_path,
    parse_patterns,
    warn_once,
)  # fmt: skip

__all__ = [
    "APPLY_CHECKPOINTING", "APPLY_TILING", "CHECKPOINT_POLICIES", "CLI", "DECIMAL_UNITS_NOTE", "DEFAULT_GRAD_INFLIGHT",
    "DEFAULT_HOST_BUDGET", "DEFAULT_HOST_MIN_AVAILABLE", "DEFAULT_MAX_INFLIGHT", "DEFAULT_MIN_BYTES", "DEFAULT_PREFETCH",
    "DEVICE_DTYPES", "LIGHTMEM", "OFFLOAD_ACTIVATIONS", "OFFLOAD_OPTIMIZER", "POLICY_HELP", "SIZE_HELP",
    "CheckpointSettings", "HostGuardSettings", "LightMemSettings", "MetricsSettings", "OffloadSettings",
    "OptimizerOffloadSettings", "PlanPrices", "PlanSettings", "Spelling", "TileSettings", "available_ram_bytes",
    "decimal_reading", "device_dtype_name", "format_bytes", "host_ram_share_bytes", "parse_bool",
    "parse_checkpoint_policy", "parse_checkpoint_targets", "parse_choices", "parse_count", "parse_device_dtype",
    "parse_devices", "parse_fraction", "parse_host_limit", "parse_module_targets", "parse_optimizer_offload",
    "parse_path", "parse_patterns", "parse_size", "ranks_per_node_from_env", "reject_without_partner",
    "total_ram_bytes", "warn_once",
]  # fmt: skip
