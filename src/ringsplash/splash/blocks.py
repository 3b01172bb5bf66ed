"""The block sizes a Splash call runs with: one rule for every path (``splash_attention``, the
context-parallel strategies, the model's config check).

A kernel tiles each sequence dimension it sees (an array of ``whole`` tokens) in blocks that
must also tile a ``part`` of it: the whole sequence for ``splash_attention``, all-gather and
Ulysses; a shard, or a zigzag half-shard, for the ring. TPU lowering (Pallas / Mosaic) takes a
block that is a multiple of 128 tokens (one lane width) or the whole array dimension. So a
configured block (a multiple of 128, ``SplashConfig``)

* runs as configured when it divides the part;
* shrinks to the part when the part is shorter and is either a multiple of 128 or the whole
  array dimension (a short sequence is one block); with ``backend="xla"`` (plain XLA, never the
  Pallas kernels, on any platform) any shorter part;
* otherwise shrinks to the largest multiple of 128 dividing both (their ``gcd``);
* and is refused, with the configs or lengths that would work, when none of these exists:
  what runs on a CPU laptop also lowers for TPU, and what would not lower is refused there.
"""

import dataclasses
import math
from typing import NamedTuple

from ringsplash import masks as masks_lib
from ringsplash.splash.config import NUM_LANES, SplashConfig

__all__ = ["Blocks", "Extent", "fit_block", "fit_blocks", "is_sparse", "tuned_for_call"]

_FIELDS = (("block_q", "q"), ("block_kv", "kv"), ("block_q_dkv", "q"), ("block_kv_dkv", "kv"))


class Extent(NamedTuple):
    """One sequence dimension as a kernel sees it."""

    part: int  # tokens every block must tile (divides ``whole``)
    whole: int  # tokens of the array dimension the kernel blocks
    name: str  # what the part is, for errors: "q_len", "shard", "zigzag half-shard", ...


class Blocks(NamedTuple):
    """Fitted block sizes (possibly shorter than 128: a whole short sequence is one block)."""

    block_shape: tuple[int, int]  # forward / dq
    block_shape_dkv: tuple[int, int]  # dK/dV
    config: SplashConfig  # the config to run: ``block_kv_compute`` tiles the fitted block_kv


def fit_block(block: int, extent: Extent, *, tpu_tiling: bool = True) -> int | None:
    """The block (see the module docstring) that tiles ``extent``, or None when none lowers;
    ``tpu_tiling=False`` (the xla backend) takes any shorter part whole."""
    part = extent.part
    if part % block == 0:
        return block
    if part < block and (part == extent.whole or part % NUM_LANES == 0 or not tpu_tiling):
        return part
    g = math.gcd(block, part)
    return g if g % NUM_LANES == 0 else None


def fit_blocks(config: SplashConfig, *, q: Extent, kv: Extent, what: str, length_hint: str = "",
               head_dim: int | None = None, dtype=None, sparse: bool = False) -> Blocks:
    """``config``'s four blocks fitted to the q and kv extents (:func:`fit_block`), blocks
    left at None first taken from the tuned table (``SplashConfig.with_tuned_blocks``).

    Args:
        config: the user's ``SplashConfig``.
        head_dim, dtype: q's head size and dtype, for the tuned table (None: 128, bfloat16).
        sparse: the call has segment ids or a mask other than causal / full (tuned table).
        q, kv: the query and key/value dimensions the kernels tile.
        what: the caller, named first in errors (e.g. ``"ring_attention (layout 'zigzag', 4 devices)"``).
        length_hint: how to pick a sequence length that works, appended to errors.

    Raises:
        ValueError: naming the field, the part it cannot tile and, where one exists, a
            ``SplashConfig`` that works, then ``length_hint``.
    """
    # keyed on the kv length one kernel call sees (the whole array: a ring's shard, not its zigzag half)
    config = config.with_tuned_blocks(kv_len=kv.whole, head_dim=head_dim, dtype=dtype, sparse=sparse)
    fitted = {}
    for name, side in _FIELDS:
        extent = q if side == "q" else kv
        block = getattr(config, name)
        fitted[name] = fit_block(block, extent, tpu_tiling=config.backend != "xla")
        if fitted[name] is None:
            raise ValueError(_refusal(what, name, block, extent, length_hint))
    bkv = fitted["block_kv"]
    compute = math.gcd(config.block_kv_compute, bkv)
    if config.block_kv_compute < bkv and bkv % config.block_kv_compute:
        # slices of the fitted kv block: a multiple of 128 dividing it, else the whole block
        config = dataclasses.replace(config, block_kv_compute=compute if compute % NUM_LANES == 0 else config.block_kv)
    return Blocks((fitted["block_q"], bkv), (fitted["block_q_dkv"], fitted["block_kv_dkv"]), config)


def is_sparse(mask, segment_ids: bool) -> bool:
    """Whether a call takes the tuned table's ``sparse`` rows: it has segment ids, or some head's mask
    is neither causal nor full (mostly partial tiles)."""
    heads = mask.masks if isinstance(mask, masks_lib.MultiHeadMask) else (mask,)
    return bool(segment_ids) or not all(type(m) in (masks_lib.CausalMask, masks_lib.FullMask) for m in heads)


def tuned_for_call(config: SplashConfig, *, kv_len: int, head_dim: int | None, dtype, mask,
                   segment_ids: bool) -> SplashConfig:
    """``config`` with its blocks left at None filled from the tuned table for a kernel that sees
    ``kv_len`` keys (``SplashConfig.with_tuned_blocks``), as ``splash_attention`` tunes them: every
    context-parallel strategy resolves its config this way once, at its entry point, so its plan,
    schedule and kernels run the blocks single-device Splash would run on the same kernel call."""
    return config.with_tuned_blocks(kv_len=int(kv_len), head_dim=head_dim, dtype=dtype,
                                    sparse=is_sparse(mask, segment_ids))


def _refusal(what: str, name: str, block: int, extent: Extent, length_hint: str) -> str:
    part, whole = extent.part, extent.whole
    msg = (f"{what}: SplashConfig.{name}={block} cannot tile the {part}-token {extent.name}: a block is a "
           f"multiple of {NUM_LANES} dividing the {extent.name}, or the whole {extent.name} when it is shorter than "
           f"the block")
    if part != whole:
        msg += (f" and a multiple of {NUM_LANES} (the {extent.name} is part of the {whole}-token array the kernel "
                f"tiles, and the Pallas TPU kernels tile an array dimension in multiples of {NUM_LANES} or whole)")
    if part == whole:  # a block at least as long as the part shrinks to all of it
        good = -(-part // NUM_LANES) * NUM_LANES
        msg += (f". Pass SplashConfig(block_q={good}, block_kv={good}, block_q_dkv={good}, block_kv_dkv={good}) "
                f"(blocks shrink to the {part}-token {extent.name})")
        return msg + (f", or {length_hint}" if length_hint else "")
    return msg + (f". No block size fits: {length_hint}" if length_hint else ". No block size fits") + (
        ", or SplashConfig(backend='xla') (plain XLA, never the Pallas kernels: any whole part)")
