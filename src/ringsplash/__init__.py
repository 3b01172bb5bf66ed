"""ringsplash: exact long-context attention for JAX.

Masks (``ringsplash.masks``) -> block metadata (``build_mask_info``) -> Splash kernels
(``splash_attention``) -> ring attention over a mesh axis (``ring_attention``) -> model.
"""

from importlib import metadata as _metadata

from ringsplash import layouts, masks
from ringsplash._internal.caches import clear_caches
from ringsplash._internal.softmax import MASKED_LSE
from ringsplash._internal.types import AttentionOutput
from ringsplash.blocksparse.mask_info import BlockSchedule, MaskInfo, build_mask_info
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.reference import reference_attention

try:
    __version__ = _metadata.version("ringsplash")  # the installed distribution's, from pyproject.toml
except _metadata.PackageNotFoundError:  # a source tree on sys.path without being installed
    __version__ = "0+unknown"

__all__ = [
    "MASKED_LSE",
    "AttentionOutput",
    "BlockSchedule",
    "MaskInfo",
    "SegmentIds",
    "build_mask_info",
    "clear_caches",
    "layouts",
    "masks",
    "reference_attention",
]

from ringsplash.parallel import (
    allgather_attention,
    allgather_attention_sharded,
    ulysses_attention,
    ulysses_attention_sharded,
    usp_attention,
    usp_attention_sharded,
)
from ringsplash.parallel.ring import (
    RingAttention,
    RingSchedule,
    make_ring_attention,
    ring_attention,
    ring_attention_sharded,
    ring_schedule,
)
from ringsplash.splash import (
    SplashAttention,
    SplashConfig,
    make_splash_attention,
    splash_attention,
    splash_backward,
    splash_forward,
)

__all__ += [
    "SplashAttention",
    "SplashConfig",
    "make_splash_attention",
    "ring_attention",
    "ring_attention_sharded",
    "splash_attention",
    "splash_backward",
    "splash_forward",
]

__all__ += [
    "allgather_attention",
    "allgather_attention_sharded",
    "ulysses_attention",
    "ulysses_attention_sharded",
    "usp_attention",
    "usp_attention_sharded",
]

__all__ += ["RingAttention", "RingSchedule", "make_ring_attention", "ring_schedule"]


def __getattr__(name: str):
    """``rs.hf`` and ``rs.inference`` imported on first use (``import ringsplash`` stays light)."""
    if name in ("hf", "inference"):
        import importlib

        return importlib.import_module(f"ringsplash.{name}")
    raise AttributeError(f"module 'ringsplash' has no attribute {name!r}")
