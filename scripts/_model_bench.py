"""What the model benchmarks on a chip share (``bench_train_tpu.py``, ``bench_inference_tpu.py``): the platform
choice (a TPU, or ``--cpu-smoke``), the device line, the chip's peak FLOP/s and HBM bandwidth, the model of
issue 40 as a ``TransformerConfig``, parameter counts and FLOP formulas, compile counting, OOM detection, and
the attention peers injected into the model (``jax.nn.dot_product_attention``, JAX's splash).

Chip rates (per JAX device, bfloat16 dense peak and HBM bandwidth, from Google's Cloud TPU system
architecture pages); a chip not listed gets no MFU / roofline column unless ``--peak-tflops`` /
``--hbm-gbps`` is given."""

import contextlib
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp

#: bfloat16 dense peak TF/s per JAX device, by chip generation (``ringsplash.aot`` names)
PEAK_BF16_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}
#: HBM bandwidth GB/s (1e9 bytes / s) per JAX device
HBM_GBPS = {"v4": 1200.0, "v5e": 819.0, "v5p": 2765.0, "v6e": 1640.0}
#: the event JAX records once per XLA backend compile (``jax._src.dispatch``)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# ----------------------------------------------------------------------------------------- platform


def start(script: str, cpu_smoke: bool) -> jax.Device:
    """Choose the platform before JAX starts: the CPU for ``--cpu-smoke``, else the TPU (refused without one:
    CPU timings of these programs mean nothing). Returns the first device."""
    if cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    device = jax.devices()[0]
    if not cpu_smoke and device.platform != "tpu":
        sys.exit(f"{script} measures a TPU chip; this process sees {device.platform!r} devices "
                 f"(--cpu-smoke runs tiny shapes on the CPU to check the script end to end)")
    return device


def device_line(device: jax.Device) -> str:
    import jaxlib

    try:
        from importlib.metadata import version

        libtpu = version("libtpu")
    except Exception:
        libtpu = "-"
    return (f"device: {device.device_kind} x{jax.device_count()} (platform {device.platform}), jax {jax.__version__}, "
            f"jaxlib {jaxlib.__version__}, libtpu {libtpu}")


def chip_name(device: jax.Device) -> str | None:
    """The chip generation of ``device`` (``ringsplash.aot``'s table of device kinds), None off a TPU."""
    from ringsplash import aot

    if device.platform != "tpu":
        return None
    info = aot.find_chip(device.device_kind)
    return None if info is None else info.name


def chip_rate(table: dict, device: jax.Device, override: float | None) -> float | None:
    """``override``, else ``table``'s entry for the device's chip, else None (unknown: no ratio printed)."""
    return override if override is not None else table.get(chip_name(device) or "")


# ----------------------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shape of a model: issue 40's is 8 layers, d_model 1024, 8 heads of 128, SwiGLU 4096."""

    layers: int = 8
    d_model: int = 1024
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 4096
    vocab: int = 32768

    @property
    def label(self) -> str:
        gqa = f", GQA {self.heads}:{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"{self.layers} x {self.d_model}{gqa}"


def model_config(shape: Shape, seq_len: int, *, param_dtype: str, compute_dtype: str, remat: str = "none",
                 splash=None, strategy: str = "splash"):
    """``TransformerConfig`` of ``shape`` with Splash attention (``splash``: a ``SplashConfig``, None = default)
    under the context-parallel ``strategy`` (``"splash"``: one device; ``"ring"`` etc. over a 1-device axis)."""
    from ringsplash.model import ContextParallel, ModelFeatures, TransformerConfig
    from ringsplash.splash import SplashConfig

    return TransformerConfig(
        vocab_size=shape.vocab, d_model=shape.d_model, num_layers=shape.layers, num_heads=shape.heads,
        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, features=ModelFeatures(intermediate_size=shape.mlp),
        max_seq_len=seq_len, context_parallel=ContextParallel(strategy), splash=splash or SplashConfig(), remat=remat, param_dtype=param_dtype,
        compute_dtype=compute_dtype)


@dataclasses.dataclass(frozen=True)
class Counts:
    """Parameters of a model: ``body`` (every layer + the final norm: the non-embedding parameters),
    ``embedding`` (the input table, a lookup: no FLOPs) and ``unembedding`` (d_model x vocab, a matmul)."""

    body: int
    embedding: int
    unembedding: int
    param_bytes: int  # every parameter as stored (param dtype)


def param_counts(config) -> Counts:
    """``Counts`` of ``config``'s model, from shapes only (nothing allocated)."""
    from ringsplash.model import abstract_model

    model = abstract_model(config)
    size = lambda tree: sum(x.size for x in jax.tree.leaves(tree) if hasattr(x, "size"))
    nbytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(model) if hasattr(x, "size"))
    unembedding = config.d_model * config.vocab_size
    body = size(model.layers) + size(model.final_norm)
    return Counts(body=body, embedding=model.embedding.size, unembedding=unembedding, param_bytes=nbytes)


def causal_attention_flops(config, seq_len: int) -> float:
    """Forward FLOPs of causal attention over one sequence, every layer: QK^T and PV, 2 FLOPs per multiply-add,
    over the attended (query, key) pairs S(S+1)/2 of each head: ``L * 4 * H * dh * S(S+1)/2`` (~ 2·L·S²·H·dh)."""
    c = config
    pairs = seq_len * (seq_len + 1) / 2
    return c.num_layers * c.num_heads * 2.0 * (c.head_dim + c.v_head_dim) * pairs


# ----------------------------------------------------------------------------------------- compiles and memory


class CompileCounter:
    """Counts XLA backend compiles (``jax.monitoring``'s ``COMPILE_EVENT``, recorded once per compile) in this
    process; ``counter.count`` read before and after a call gives the compiles it caused."""

    count = 0
    _registered = False

    @classmethod
    def install(cls) -> "type[CompileCounter]":
        if not cls._registered:
            def listen(event: str, duration: float, **_):
                if event == COMPILE_EVENT:
                    cls.count += 1

            jax.monitoring.register_event_duration_secs_listener(listen)
            cls._registered = True
        return cls


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the program did not fit in device memory (at compile or run time)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Resource exhausted", "out of memory", "Out of memory",
                                    "ResourceExhausted"))


def short_error(exc: BaseException, limit: int = 160) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def peak_hbm_gib(device: jax.Device) -> str:
    """The device's peak bytes in use so far (GiB), ``-`` where the backend does not say (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    return "-" if peak is None else f"{peak / (1 << 30):.2f}"


def log_line(log, **fields) -> None:
    log.write(json.dumps(fields, default=str) + "\n")
    log.flush()


# ----------------------------------------------------------------------------------------- attention peers
#
# The model picks its attention in ``ringsplash.model.attention.attend(config, q, k, v, segment_ids, sinks, ...)``
# (``config.context_parallel.strategy``: reference / splash / the context-parallel strategies), which ``Attention.__call__``
# looks up as a module global at trace time. The peers below replace it for the programs traced inside
# ``attention_override`` (nothing in the library changes); the override counts its calls, so a program that
# did not go through it is reported instead of being timed as the peer.


def _check_plain(config, sinks, kw: dict) -> None:
    if config.mask != "causal" or config.logit_soft_cap is not None or sinks is not None or kw.get(
            "return_max_logits"):
        raise ValueError("the attention peers implement plain causal attention only (no soft-cap, sinks, "
                         "max logits, other masks)")


def xla_attention(config, q, k, v, segment_ids, sinks, *, original, **kw):
    """``jax.nn.dot_product_attention`` (XLA, causal; GQA native) on one example ``q [heads, seq, d]``.
    Segment ids are not passed: the benchmark's rows are one document each."""
    del original, segment_ids
    _check_plain(config, sinks, kw)
    t = lambda x: x.transpose(1, 0, 2)[None]  # [heads, seq, d] -> [1, seq, heads, d]
    out = jax.nn.dot_product_attention(t(q), t(k), t(v), scale=config.features.attention_scale, is_causal=True,
                                       implementation="xla")
    return out[0].transpose(1, 0, 2)


@functools.lru_cache(maxsize=16)
def jax_splash_kernel(heads: int, seq_len: int, blocks: tuple[int, int, int], interpret: bool):
    """JAX's ``make_splash_mha_single_device`` for a causal mask over ``heads`` heads, fused backward, blocks
    ``(block_q, block_kv, block_kv_compute)`` (each capped at ``seq_len``) used for dK/dV too."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bq, bkv, bkvc = (min(b, seq_len) for b in blocks)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkvc, use_fused_bwd_kernel=True)
    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len))] * heads)
    return sk.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def jax_splash_attention(blocks: tuple[int, int, int], interpret: bool):
    """JAX's splash (``jax.experimental.pallas.ops.tpu.splash_attention``) as the model's attention: q scaled
    first (the kernel applies no scale), K / V repeated to the query heads under GQA; the model vmaps it over
    the batch rows."""

    def attend(config, q, k, v, segment_ids, sinks, *, original, **kw):
        del original, segment_ids
        _check_plain(config, sinks, kw)
        heads, seq, d = q.shape
        group = heads // k.shape[0]
        if group > 1:
            k, v = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
        scale = d**-0.5 if config.features.attention_scale is None else config.features.attention_scale
        kernel = jax_splash_kernel(heads, seq, tuple(blocks), interpret)
        return kernel((q.astype(jnp.float32) * scale).astype(q.dtype), k, v)

    return attend


def without_segment_ids(config, q, k, v, segment_ids, sinks, *, original, **kw):
    """ringsplash's own attention called without the batch's segment ids (what the peers see)."""
    return original(config, q, k, v, None, sinks, **kw)


@contextlib.contextmanager
def attention_override(fn):
    """Within the block, the model's attention is ``fn(config, q, k, v, segment_ids, sinks, *, original, ...)``
    (``original``: the library's ``attend``); yields a list that gets one entry per traced call. ``fn=None``:
    the library's own attention, untouched."""
    from ringsplash.model import attention as attention_module

    calls: list[int] = []
    if fn is None:
        yield calls
        return
    original = attention_module.attend

    def patched(config, q, k, v, segment_ids, sinks, **kw):
        calls.append(1)
        return fn(config, q, k, v, segment_ids, sinks, original=original, **kw)

    attention_module.attend = patched
    try:
        yield calls
    finally:
        attention_module.attend = original
