"""Segment ids for sequence packing: a query attends only keys of the same segment."""

from typing import NamedTuple

from ringsplash._internal.types import Array, Int


class SegmentIds(NamedTuple):
    q: Int[Array, " q_len"]
    kv: Int[Array, " kv_len"]
