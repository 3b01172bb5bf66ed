"""The Splash factory: host work bound to an object, as JAX's ``make_splash_mha`` does.

:func:`make_splash_attention` fits the blocks and builds the forward and dK/dV ``MaskInfo`` s
once; the :class:`SplashAttention` it returns takes arrays only. :func:`splash_attention`, the
functional entry point, is a thin wrapper: it validates the call, takes the object for its
(mask, config, head size, dtype, sparsity) from the one bounded cache
(``ringsplash._internal.caches.factories``, emptied by ``rs.clear_caches()``) and calls it.
"""

import dataclasses

import jax.numpy as jnp

from ringsplash import masks as masks_lib
from ringsplash._internal.caches import factories
from ringsplash._internal.checks import AttentionCall, check_attention_call
from ringsplash._internal.scalar_checks import check_bool, check_positive_int
from ringsplash._internal.types import Array, AttentionOutput, Float, Outputs, outputs
from ringsplash.blocksparse.mask_info import MaskInfo, build_mask_info
from ringsplash.masks.segment_ids import SegmentIds
from ringsplash.splash.attention import splash_info_attention
from ringsplash.splash.blocks import Extent, fit_blocks, is_sparse
from ringsplash.splash.config import NUM_LANES, SplashConfig
from ringsplash.splash.partial_tiles import partial_mode

__all__ = ["SplashAttention", "make_splash_attention", "splash_attention"]


@dataclasses.dataclass(frozen=True, eq=False)
class SplashAttention:
    """Splash attention for one mask, its host metadata built (:func:`make_splash_attention`).

    Call it as ``attn(q, k, v, segment_ids=None, ...)`` (per example; batch with ``jax.vmap``):
    the arguments and results of :func:`splash_attention` without ``mask`` and ``config``. It
    is not a pytree: close over it, or pass it to ``jit`` as a static argument (hashed by
    identity)."""

    mask: masks_lib.AnyMask  # the (q_len, kv_len) mask on original positions
    config: SplashConfig  # the fitted config the kernels run with
    info: MaskInfo  # forward / dq view
    info_dkv: MaskInfo | None  # transposed dK/dV view (None for the xla backend)

    @property
    def shape(self) -> tuple[int, int]:
        """``(q_len, kv_len)`` of the calls."""
        return self.info.q_len, self.info.kv_len

    def __call__(
        self,
        q: Float[Array, "heads q_len d"],
        k: Float[Array, "kv_heads kv_len d"],
        v: Float[Array, "kv_heads kv_len dv"],
        *,
        segment_ids: SegmentIds | None = None,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
        sinks: Float[Array, " heads"] | None = None,
        with_lse: bool = False,
        with_max_logits: bool = False,
    ) -> Float[Array, "heads q_len dv"] | AttentionOutput:
        """``out``, or an :class:`~ringsplash.AttentionOutput` with ``with_lse`` /
        ``with_max_logits`` (see :func:`splash_attention`). No host work: the metadata is built."""
        want = outputs("SplashAttention", with_lse=with_lse, with_max_logits=with_max_logits)
        call = check_attention_call(q, k, v, mask=self.mask, segment_ids=segment_ids, scale=scale,
                                    logit_soft_cap=logit_soft_cap, sinks=sinks)
        return self.run(call, q, k, v, sinks, want)

    def run(self, call: AttentionCall, q, k, v, sinks, want: Outputs):
        """The call on inputs :func:`~ringsplash._internal.checks.check_attention_call` validated."""
        result = splash_info_attention(q, k, v, self.info, self.info_dkv, segment_ids=call.segment_ids,
                                       scale=call.scale, logit_soft_cap=call.logit_soft_cap, sinks=sinks,
                                       config=self.config, return_residuals=want.lse,
                                       return_max_logits=want.max_logits)
        if not (want.lse or want.max_logits):
            return want.package(result)
        out, *rest = result
        lse = rest.pop(0) if want.lse else None
        return want.package(out, lse, rest[0] if want.max_logits else None)


def make_splash_attention(
    mask: masks_lib.AnyMask,
    *,
    config: SplashConfig = SplashConfig(),
    head_dim: int | None = None,
    dtype=None,
    segment_ids: bool = False,
) -> SplashAttention:
    """Build the host metadata of Splash attention under ``mask`` once.

    Args:
        mask: a ``ringsplash.masks`` mask of shape ``(q_len, kv_len)`` (``MultiHeadMask``: one per
            head); the calls' q and k have these lengths.
        config: ``SplashConfig``; its blocks are fitted to the lengths (``splash/blocks.py``).
        head_dim, dtype: q's head size and dtype, which pick the tuned blocks of blocks left at
            None (None: 128, bfloat16). Calls with other head sizes or dtypes still run.
        segment_ids: whether the calls pass segment ids (tuned blocks for sparse calls); calls
            run either way.

    Returns:
        a :class:`SplashAttention` holding the fitted config and the ``MaskInfo`` s.

    Raises:
        TypeError / ValueError: naming the argument, when one is not what is expected or no
            block tiles the lengths.
    """
    if not isinstance(mask, masks_lib.Mask | masks_lib.MultiHeadMask):
        raise TypeError(f"make_splash_attention: mask must be a ringsplash.masks.Mask or MultiHeadMask, got "
                        f"{type(mask).__name__} {mask!r}")
    if not isinstance(config, SplashConfig):
        raise TypeError(f"make_splash_attention: config must be a SplashConfig, got {type(config).__name__} "
                        f"{config!r}")
    if head_dim is not None:
        head_dim = check_positive_int("head_dim", head_dim)
    if dtype is not None:
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:
            raise TypeError(f"make_splash_attention: dtype must be a floating dtype or None, got {dtype!r}") from None
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"make_splash_attention: dtype must be a floating dtype or None, got {dtype}")
    sparse = is_sparse(mask, check_bool("segment_ids", segment_ids))
    q_len, kv_len = masks_lib.head_masks(mask)[0].shape
    blocks = fit_blocks(config, q=Extent(q_len, q_len, "q_len"), kv=Extent(kv_len, kv_len, "kv_len"),
                        what="splash_attention", length_hint=f"lengths divisible by {NUM_LANES}",
                        head_dim=head_dim, dtype=dtype, sparse=sparse)
    config = blocks.config
    mode = partial_mode(mask, config.backend, config.partial_tiles)
    info = build_mask_info(mask, blocks.block_shape, partial_mode=mode)
    info_dkv = None if config.backend == "xla" else build_mask_info(mask, blocks.block_shape_dkv, transpose=True,
                                                                    partial_mode=mode)
    return SplashAttention(mask, config, info, info_dkv)


def splash_attention(
    q: Float[Array, "heads q_len d"],
    k: Float[Array, "kv_heads kv_len d"],
    v: Float[Array, "kv_heads kv_len dv"],
    mask: masks_lib.AnyMask | None = None,
    *,
    segment_ids: SegmentIds | None = None,
    scale: float | None = None,
    logit_soft_cap: float | None = None,
    sinks: Float[Array, " heads"] | None = None,
    config: SplashConfig = SplashConfig(),
    with_lse: bool = False,
    with_max_logits: bool = False,
    return_residuals: bool = False,
    return_max_logits: bool = False,
) -> Float[Array, "heads q_len dv"] | AttentionOutput | tuple:
    """Block-sparse attention with the shapes and semantics of ``reference_attention``.

    Differentiable in q, k, v and sinks (custom VJP). The host metadata is built at trace time
    by :func:`make_splash_attention`, whose objects are cached (one bounded cache; see
    ``rs.clear_caches()``); build one yourself to hold it. Blocks are fitted to the lengths as
    on every path (``splash/blocks.py``): a block longer than a sequence shrinks to it, one that
    does not divide it to a multiple of 128 that does, or the call is refused with a config that
    works.

    Args:
        q: queries ``[heads, q_len, d]``, floating point (per example; batch with ``jax.vmap``).
        k: keys ``[kv_heads, kv_len, d]``, the dtype of ``q``; ``kv_heads`` divides ``heads``.
        v: values ``[kv_heads, kv_len, dv]``, the dtype of ``k``; ``dv`` (the output's head size)
            may differ from ``d`` (e.g. MLA: q/k 192, v 128).
        mask: a ``ringsplash.masks`` mask of shape ``(q_len, kv_len)`` (``MultiHeadMask``: one
            per head), or None to attend everything.
        segment_ids: ``SegmentIds(q=[q_len], kv=[kv_len])`` integer ids; a query attends only
            keys with an equal id. Concrete ids of any integer dtype are compared exactly;
            traced ids must fit int32.
        scale: positive multiplier of ``q k^T``; None means ``1 / sqrt(d)``.
        logit_soft_cap: None, or a positive cap ``c``: logits become ``c * tanh(logits / c)``.
        sinks: floating ``[heads]`` per-head sink logits that join each row's softmax
            denominator only, or None.
        config: ``SplashConfig`` (block sizes, backend).
        with_lse: also return ``lse`` (float32 ``[heads, q_len]``, natural log, sinks
            included); ``lse`` is differentiable too.
        with_max_logits: also return float32 ``max_logits [heads]``: per q head, the largest
            ``scale · q·k`` over the (query, key) pairs it attends (mask and segment ids
            applied), *before* the soft-cap, without the sinks (they are not q·k logits);
            ``-inf`` for a head that attends nothing. Computed by the forward pass itself (no
            extra pass over K/V); carries no gradient (``stop_gradient``, its cotangent is
            dropped). For QK-clip (``TransformerConfig.qk_clip_threshold``).
        return_residuals, return_max_logits: deprecated (``DeprecationWarning``): the tuples
            ``(out, lse)``, ``(out, max_logits)`` or ``(out, lse, max_logits)``.

    Returns:
        ``out`` (``q.dtype``, ``[heads, q_len, dv]``), or with ``with_lse`` / ``with_max_logits``
        an :class:`~ringsplash.AttentionOutput` ``(out, lse, max_logits)`` (None where not asked).
    """
    want = outputs("splash_attention", with_lse=with_lse, with_max_logits=with_max_logits,
                   return_residuals=return_residuals, return_max_logits=return_max_logits)
    call = check_attention_call(q, k, v, mask=mask, segment_ids=segment_ids, scale=scale,
                                logit_soft_cap=logit_soft_cap, sinks=sinks, config=config, config_type=SplashConfig)
    if mask is None:
        mask = masks_lib.FullMask((call.q_len, call.kv_len))
    has_ids = call.segment_ids is not None
    key = ("splash", mask, config, call.head_dim, jnp.dtype(q.dtype), has_ids)
    attn = factories.get(key, lambda: make_splash_attention(mask, config=config, head_dim=call.head_dim,
                                                            dtype=q.dtype, segment_ids=has_ids))
    return attn.run(call, q, k, v, sinks, want)
