"""Sequence tiling: position-wise modules run in shards along the sequence, keeping only their input.

``apply``: choosing and wrapping the modules (``apply_tiling``); ``function``: the tiled forward and
backward of one call, and ``shard_lengths``, the one rule that cuts a sequence into shards (the
callback, the dry run and the planner use it); ``position_wise``: the check that refuses a module
mixing positions.
"""

from lightmem.tiling.apply import TilingHandle, apply_tiling, is_tiled, tile_modules
from lightmem.tiling.function import shard_lengths

__all__ = ["TilingHandle", "apply_tiling", "is_tiled", "shard_lengths", "tile_modules"]
