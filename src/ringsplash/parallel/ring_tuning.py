"""The config a ring runs: the blocks single-device Splash would tune for the same kernel call, and the kind
of backward the chip keeps its transfers hidden with. Host-only; every ring entry point and ``ring_schedule``
resolve their config here, so plan, schedule and kernels agree."""

import dataclasses

from ringsplash import aot
from ringsplash import masks as masks_lib
from ringsplash.splash.blocks import tuned_for_call
from ringsplash.splash.config import SplashConfig

__all__ = ["SPLIT_BACKWARD_CHIPS", "ring_config"]


#: chips on which a ring over more than one device runs the split backward (dK/dV kernel, then dq kernel, in
#: every step): compiled for v5p:2x2x2 (ring fwd+bwd at 32K, causal, zigzag, 8 heads; tuned or 512-blocks, stored
#: or position-computed tiles alike), the fused backward kernel made XLA schedule the *forward* loop's K / V
#: transfers after that loop's kernel instead of behind it, which serialises every forward step; with the split
#: backward every transfer stays hidden (tests/test_ring_tpu_compile.py). v5e (2x2, 4x4) and v6e keep the fused one.
SPLIT_BACKWARD_CHIPS = ("v5p",)


def ring_config(config: SplashConfig, mask: masks_lib.AnyMask, num_shards: int, *, head_dim: int | None = None,
                dtype=None, segment_ids: bool = False, device_kind: str | None = None) -> SplashConfig:
    """``config`` with the blocks left at None tuned as ``splash_attention`` tunes them for the
    kernel calls of a ring over ``num_shards`` devices: each sees one shard of ``S / N`` keys,
    q's ``head_dim`` / ``dtype`` (None: 128, bfloat16), and is sparse with ``segment_ids`` or a
    banded mask (``splash.blocks.tuned_for_call``, for the chip traced on). Every ring entry point
    (and :func:`ring_schedule`) resolves its config through this, so plan, schedule and kernels
    agree. On the chips of :data:`SPLIT_BACKWARD_CHIPS` (``device_kind``, a mesh's; None: the chip
    traced on) a ring of more than one device also runs the split backward
    (``fused_backward=False``, which no schedule depends on)."""
    seq_len = masks_lib.head_masks(mask)[0].shape[0]
    config = tuned_for_call(config, kv_len=max(seq_len // int(num_shards), 1), head_dim=head_dim, dtype=dtype,
                            mask=mask, segment_ids=segment_ids)
    chip = aot.find_chip(device_kind or aot.trace_chip())
    if int(num_shards) > 1 and config.fused_backward and chip is not None and chip.name in SPLIT_BACKWARD_CHIPS:
        config = dataclasses.replace(config, fused_backward=False)
    return config
