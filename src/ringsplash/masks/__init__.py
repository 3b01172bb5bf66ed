"""Attention masks: lazy, immutable, hashable (True = may attend).

- ``base``: the ``Mask`` interface and its algebra (``&`` / ``|``, ``MultiHeadMask``, block classes);
- ``structured``: full, causal, sliding window, chunked, prefix-LM, global tokens, ``NumpyMask``;
- ``function``: ``FunctionMask``, a mask from a jnp predicate;
- ``segment_ids``: ``SegmentIds``, packed-document ids (a query attends keys of its own id).

The public names are importable from here (``from ringsplash import masks; masks.CausalMask(...)``).
"""

from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.masks.structured import (
    EMPTY,
    FULL,
    PARTIAL,
    AnyMask,
    CausalMask,
    ChunkedCausalMask,
    FullMask,
    FunctionMask,
    GlobalTokensMask,
    LocalMask,
    LogicalAnd,
    LogicalOr,
    Mask,
    MultiHeadMask,
    NumpyMask,
    PrefixLMMask,
    dense,
    head_masks,
)

__all__ = [
    "EMPTY", "FULL", "PARTIAL", "AnyMask", "CausalMask", "ChunkedCausalMask", "FullMask", "FunctionMask",
    "GlobalTokensMask", "LocalMask", "LogicalAnd", "LogicalOr", "Mask", "MultiHeadMask", "NumpyMask", "PrefixLMMask",
    "SegmentIds", "dense", "head_masks",
]
