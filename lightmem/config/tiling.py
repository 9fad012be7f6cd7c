"""The sequence-tiling flags (``apply_tiling``, ``LightMem(tile=...)``, ``estimate_memory(tile=...)``),
parsed once into ``TileSettings``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightmem.config.checkpointing import parse_module_targets
from lightmem.config.spelling import APPLY_TILING, Spelling, reject_without_partner
from lightmem.config.values import parse_count


@dataclass(frozen=True)
class TileSettings:
    """Which position-wise modules run in sequence shards, and how long a shard is, parsed once
    (``apply_tiling``, ``LightMem(tile=...)``, ``estimate_memory(tile=...)``); ``lightmem.tiling``
    turns a sequence length into shards (``shard_lengths``)."""

    modules: tuple[Any, ...]
    tile_tokens: int | None = None
    """Positions per shard (the last shard may be shorter); None with ``shards`` None: as many as
    the module's input is wide (``lightmem.tiling.shard_lengths``)."""
    shards: int | None = None
    """Split the sequence into this many shards of nearly equal length instead."""
    spelling: Spelling = APPLY_TILING

    @classmethod
    def parse(
        cls, modules: Any = None, *, tile_tokens: int | None = None, shards: int | None = None,
        spelling: Spelling = APPLY_TILING,
    ) -> TileSettings | None:  # fmt: skip
        """None when ``modules`` is None (nothing tiled); ``tile_tokens`` and ``shards`` need it, and
        exclude each other."""
        flag = spelling.flag
        tokens = parse_count(tile_tokens, flag=flag("tile_tokens"), allow_none=True)
        count = parse_count(shards, flag=flag("shards"), allow_none=True)
        if modules is None:
            for field, value in (("tile_tokens", tokens), ("shards", count)):
                if value is not None:
                    reject_without_partner(spelling, field, flag("modules"), "name the modules to tile")
            return None
        if tokens is not None and count is not None:
            raise ValueError(
                f"{flag('shards')}: give either {spelling.name('tile_tokens')} (positions per shard) or "
                f"{spelling.name('shards')} (shards per sequence), not both"
            )
        targets = parse_module_targets(modules, flag=flag("modules"), empty="tiles nothing")
        return cls(modules=targets, tile_tokens=tokens, shards=count, spelling=spelling)

    def flag(self, field: str) -> str:
        return self.spelling.flag(field)
