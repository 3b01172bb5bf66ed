"""Block-sparse metadata of a mask: which (q block, kv block) tiles are empty, partial or full,
as work lists the kernels walk, built from block ranges without an S x S array.

- ``mask_info``: ``MaskInfo`` / ``BlockSchedule`` and ``build_mask_info`` (cached per mask and blocking);
- ``builder``: the builder itself (blockings, per-block summaries, partial-block storage).
"""

from ringsplash.blocksparse.mask_info import (
    MAX_STORED_PARTIAL_BLOCKS,
    PARTIAL_MODES,
    BlockSchedule,
    MaskInfo,
    PartialMode,
    build_mask_info,
)

__all__ = ["MAX_STORED_PARTIAL_BLOCKS", "PARTIAL_MODES", "BlockSchedule", "MaskInfo", "PartialMode", "build_mask_info"]
