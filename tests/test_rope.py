"""RoPE scaling against transformers' own rope functions (the oracle; torch is a test dependency).

Measured on this machine (torch 2.13.0 CPU, transformers 5.25.0) over the grid below: with
torch's own ``pow`` substituted for ours (``_torch_pow``) the inverse frequencies are
bit-identical for every type; with ours (float64 power rounded to float32) they differ where
torch's vectorised SLEEF ``powf`` is one ulp off: max relative error over ``GRID`` 0.9e-7
(default) to 1.9e-7 (yarn) and 2.5e-7 (llama3, whose smooth blend cancels digits). Attention
factors: bit-identical.

torch and transformers are imported inside the tests that use them (not at collection: they cost seconds).
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ringsplash as rs
import ringsplash.model.rope_scaling as rope_lib
from ringsplash.model import (
    ModelFeatures,
    RopeScaling,
    Transformer,
    TransformerConfig,
    rope,
    rope_attention_factor,
    rope_inv_freq,
    rope_scaling_from_flags,
)

# relative error of the inverse frequencies (module docstring: measured at most 2.5e-7)
INV_FREQ_RTOL = 1e-6
OMAX = 64  # original_max_position_embeddings of the grid


def _cases(dim: int, factor: float) -> list[RopeScaling]:
    rng = np.random.default_rng(dim)
    return [
        RopeScaling("default"),
        RopeScaling("linear", factor=factor),
        RopeScaling("dynamic", factor=factor, original_max_position_embeddings=OMAX),
        RopeScaling("yarn", factor=factor, original_max_position_embeddings=OMAX),
        RopeScaling("yarn", factor=factor, original_max_position_embeddings=OMAX, truncate=False, beta_fast=16.0,
                    beta_slow=2.0),
        RopeScaling("yarn", factor=factor, original_max_position_embeddings=OMAX, mscale=0.707, mscale_all_dim=1.0),
        RopeScaling("yarn", factor=factor, original_max_position_embeddings=OMAX, attention_factor=1.25),
        RopeScaling("llama3", factor=factor, original_max_position_embeddings=OMAX, low_freq_factor=1.0,
                    high_freq_factor=4.0),
        RopeScaling("longrope", factor=factor, original_max_position_embeddings=OMAX,
                    short_factor=tuple(rng.uniform(1, 2, dim // 2)), long_factor=tuple(rng.uniform(1, 40, dim // 2))),
        RopeScaling("longrope", factor=factor, original_max_position_embeddings=OMAX, attention_factor=0.9,
                    short_factor=(1.0,) * (dim // 2), long_factor=tuple(np.linspace(1, 8, dim // 2))),
    ]


def _hf_config(s: RopeScaling, dim: int, theta: float):
    """transformers' ``LlamaConfig`` for ``s``."""
    from transformers import LlamaConfig

    # dynamic scales from max_position_embeddings; the others' factor matches max / original
    mpe = OMAX if s.type == "dynamic" else int(OMAX * s.factor) if s.factor else OMAX
    return LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim, max_position_embeddings=mpe,
                       rope_parameters=s.to_hf(rope_theta=theta))


def _hf_init(s: RopeScaling, dim: int, theta: float, seq_len=None) -> tuple[np.ndarray, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(s, dim, theta)
    if s.type == "default":
        inv, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[s.type](config, "cpu", seq_len=seq_len)
    return inv.numpy(), factor


def _hf_lengths(s: RopeScaling):
    """(our seq_len, the seq_len transformers' forward passes its init function) pairs: below, at and
    above original_max_position_embeddings; a forward pass passes ``max(position_ids) + 1``, a tensor,
    which changes dynamic's arithmetic (float32), and longrope's long factors come from ``omax + 1``."""
    import torch

    if s.type == "dynamic":
        return [(17, None), (OMAX, None), (OMAX + 1, torch.tensor(OMAX + 1)), (1000, torch.tensor(1000))]
    if s.type == "longrope":
        return [(17, None), (OMAX, None), (OMAX + 1, OMAX + 1), (1000, OMAX + 1)]
    return [(None, None)]


def _torch_pow(base, exponent):
    import torch

    e = torch.from_numpy(np.atleast_1d(np.asarray(exponent, np.float32)).copy())
    out = (torch.tensor(float(np.float32(base)), dtype=torch.float32) ** e).numpy()
    return out if np.ndim(exponent) else out[0]


GRID = [(dim, theta, factor) for dim in (8, 64, 96, 128) for theta in (10_000.0, 500_000.0, 12_345.678)
        for factor in (1.5, 4.0, 32.0)]


def _compare_grid(exact: bool) -> dict:
    worst = {}
    for dim, theta, factor in GRID:
        for s in _cases(dim, factor):
            for ours_len, hf_len in _hf_lengths(s):
                ours = rope_inv_freq(s, dim, theta, seq_len=ours_len)
                ref, ref_factor = _hf_init(s, dim, theta, hf_len)
                assert ours.dtype == np.float32 and ours.shape == (dim // 2,) == ref.shape
                assert rope_attention_factor(s) == ref_factor, (s, ref_factor)
                if exact:
                    np.testing.assert_array_equal(ours, ref, err_msg=f"{s} {dim=} {theta=} {ours_len=}")
                else:
                    np.testing.assert_allclose(ours, ref, rtol=INV_FREQ_RTOL, atol=0, err_msg=f"{s} {dim=} {theta=}")
                worst[s.type] = max(worst.get(s.type, 0.0), float(np.max(np.abs(ours - ref) / ref)))
    return worst


def test_rope_inv_freq_and_attention_factor_match_transformers():
    worst = _compare_grid(exact=False)
    assert set(worst) == set(rope_lib.ROPE_TYPES)


def test_rope_inv_freq_formulas_bit_identical_with_torch_pow(monkeypatch):
    """Our formulas repeat transformers' float32 steps exactly: with torch's pow in place of ours
    (the only operation whose rounding differs) every inverse frequency is bit-identical."""
    monkeypatch.setattr(rope_lib, "_pow", _torch_pow)
    rs.clear_caches()
    try:
        _compare_grid(exact=True)
    finally:
        rs.clear_caches()


def test_rope_longrope_and_dynamic_switch_at_original_length():
    s = _cases(64, 4.0)[8]
    assert s.type == "longrope"
    short, long = (rope_inv_freq(s, 64, 1e4, seq_len=n) for n in (OMAX, OMAX + 1))
    assert not np.array_equal(short, long)
    np.testing.assert_array_equal(short, rope_inv_freq(s, 64, 1e4, seq_len=1))
    d = RopeScaling("dynamic", factor=4.0, original_max_position_embeddings=OMAX)
    at, past = rope_inv_freq(d, 64, 1e4, seq_len=OMAX), rope_inv_freq(d, 64, 1e4, seq_len=2 * OMAX)
    assert (past[1:] < at[1:]).all()  # a larger base past the original length
    with pytest.raises(ValueError, match="needs seq_len"):
        rope_inv_freq(d, 64, 1e4)


# rotary embedding applied: XLA's float32 cos / sin against torch's. Measured max abs error 4.8e-7
# (|q| ~ 1, positions up to 3 x original length, every type); bound ~8x that.
APPLY_ATOL = 4e-6


@pytest.mark.parametrize("dim", [32, 128])
def test_rope_applied_matches_transformers_rotary_embedding(dim):
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    theta, seq = 10_000.0, 3 * OMAX
    rng = np.random.default_rng(dim)
    q = rng.standard_normal((1, 2, seq, dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, seq, dim)).astype(np.float32)
    positions = np.arange(seq)
    worst = 0.0
    for s in _cases(dim, 4.0):
        config = _hf_config(s, dim, theta)
        module = LlamaRotaryEmbedding(config)  # a fresh module: dynamic's is stateful
        cos, sin = module(torch.from_numpy(q), torch.from_numpy(positions)[None])
        q_ref, k_ref = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
        call = jax.jit(lambda x, p, s=s: rope(x, p, theta, s, seq_len=seq))
        q_out, k_out = call(jnp.asarray(q[0]), positions), call(jnp.asarray(k[0]), positions)
        for ours, ref in ((q_out, q_ref), (k_out, k_ref)):
            np.testing.assert_allclose(np.asarray(ours), ref[0].numpy(), rtol=0, atol=APPLY_ATOL, err_msg=str(s))
            worst = max(worst, float(np.max(np.abs(np.asarray(ours) - ref[0].numpy()))))
        if rope_attention_factor(s) != 1.0:  # the cos / sin multiplier is applied (norms scale by it)
            ratio = np.linalg.norm(np.asarray(q_out)) / np.linalg.norm(q[0])
            np.testing.assert_allclose(ratio, rope_attention_factor(s), rtol=1e-5)


# --------------------------------------------------------------------------- Hugging Face dicts


@pytest.mark.parametrize("i", range(len(_cases(8, 4.0))))
def test_rope_scaling_hf_round_trip(i):
    s = _cases(8, 4.0)[i]
    d = s.to_hf()
    assert json.loads(json.dumps(d)) == d
    assert "original_max_position_embeddings" not in d if s.type == "dynamic" else True
    back = RopeScaling.from_hf(json.loads(json.dumps(d)), max_position_embeddings=OMAX)
    assert back == s and hash(back) == hash(s)
    # the older key spelling, and the rope_parameters shape with its rope_theta
    old = {("type" if k == "rope_type" else k): v for k, v in d.items()}
    assert RopeScaling.from_hf(old, max_position_embeddings=OMAX) == s
    params = s.to_hf(rope_theta=5e5)
    assert RopeScaling.from_hf({**params, "type": s.type}, max_position_embeddings=OMAX, rope_theta=5e5) == s
    # transformers reads what we write: its standardised parameters are ours plus its defaults
    config = _hf_config(s, 8, 5e5)
    assert RopeScaling.from_hf(dict(config.rope_parameters), max_position_embeddings=config.max_position_embeddings,
                               rope_theta=5e5) == s


def test_rope_scaling_from_hf_reads_transformers_defaults():
    # yarn / longrope without factor: max_position_embeddings / original (DeepSeek, Phi-3); a missing
    # original length defaults to max_position_embeddings; a top-level one (Phi-3) wins
    s = RopeScaling.from_hf({"type": "yarn", "original_max_position_embeddings": 4096}, max_position_embeddings=16384)
    assert s.factor == 4.0
    s = RopeScaling.from_hf({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
                            max_position_embeddings=8192)
    assert s.original_max_position_embeddings == 8192
    s = RopeScaling.from_hf({"type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                             "original_max_position_embeddings": 100}, max_position_embeddings=131072,
                            original_max_position_embeddings=4096)
    assert (s.original_max_position_embeddings, s.factor) == (4096, 32.0)
    assert RopeScaling.from_hf({"rope_type": "linear", "factor": 2, "attention_factor": None}) == \
        RopeScaling("linear", factor=2.0)
    assert RopeScaling.from_hf({}) == RopeScaling() == RopeScaling.from_hf({"rope_type": "default"})


def test_rope_scaling_unknown_type_lists_the_supported_ones():
    with pytest.raises((ValueError, TypeError), match="ntk"):  # the test run's type checks speak first
        RopeScaling(type="ntk")
    with pytest.raises(ValueError, match=r"rope_type must be one of \('default', 'linear', 'dynamic', 'yarn', "
                                         r"'llama3', 'longrope'\), got rope_type='ntk'"):
        RopeScaling.from_hf({"rope_type": "ntk", "factor": 2.0})


@pytest.mark.parametrize("d, kw, match", [
    ({"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 2]}, {}, r"keys \['mrope_section'\]"),
    ({"rope_type": "su", "factor": 2.0}, {}, "rope_type must be one of"),
    ({"rope_type": "linear", "type": "dynamic", "factor": 2.0}, {}, "must agree"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, {}, "rope_theta=10000.0 but rope_theta=None"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, {"rope_theta": 5e5}, "pass the same"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, {}, "partial_rotary_factor=0.5"),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "needs max_position_embeddings"),
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}, {"max_position_embeddings": 8},
     "has no original_max_position_embeddings"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 8}, {}, "without factor needs"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, {}, r"low_freq_factor=1.0 only applies to"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, {},
     "needs original_max_position_embeddings"),
])
def test_rope_scaling_from_hf_refuses(d, kw, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling.from_hf(d, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(type="linear"), r"type='linear'\) needs factor"),
    (dict(type="yarn", factor=4.0), "needs original_max_position_embeddings"),
    (dict(type="llama3", factor=8.0, original_max_position_embeddings=8, low_freq_factor=1.0), "needs high_freq_factor"),
    (dict(type="longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(1.0,)), "needs long_factor"),
    (dict(type="default", factor=2.0), r"factor=2.0 only applies to type in \('linear'"),
    (dict(type="linear", factor=2.0, beta_fast=32.0), r"beta_fast=32.0 only applies to type in \('yarn',\)"),
    (dict(type="llama3", factor=8.0, original_max_position_embeddings=8, low_freq_factor=1.0, high_freq_factor=4.0,
          attention_factor=1.0), "attention_factor=1.0 only applies to"),
    (dict(type="linear", factor=0.0), "factor must be > 0"),
    (dict(type="linear", factor=float("nan")), "factor must be finite"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=0), "original_max_position_embeddings must be"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=-1.0), "mscale must be >= 0"),
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=1.0, beta_slow=2.0),
     "beta_fast >= beta_slow"),
    (dict(type="llama3", factor=8.0, original_max_position_embeddings=8, low_freq_factor=4.0, high_freq_factor=4.0),
     "high_freq_factor > low_freq_factor"),
    (dict(type="longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(1.0,), long_factor=(1.0, 2.0)),
     "same length"),
    (dict(type="longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(), long_factor=()),
     "non-empty sequence"),
    (dict(type="longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(1.0,), long_factor=(-1.0,)),
     r"long_factor\[0\] must be > 0"),
])
def test_rope_scaling_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**kw)


def test_rope_scaling_refuses_wrong_types_and_dims():
    # JSON values are checked and normalised before construction (the constructor runs the same checks)
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8}
    with pytest.raises(TypeError, match="truncate must be a bool, got truncate=1"):
        RopeScaling.from_hf({**yarn, "truncate": 1})
    with pytest.raises(ValueError, match="original_max_position_embeddings must be a positive int"):
        RopeScaling.from_hf({**yarn, "original_max_position_embeddings": 8.5})
    with pytest.raises(TypeError, match="beta_fast must be a real number"):
        RopeScaling.from_hf({**yarn, "beta_fast": "32"})
    assert RopeScaling.from_hf(yarn).factor == 4.0
    s = RopeScaling.from_hf({"rope_type": "longrope", "factor": 2, "original_max_position_embeddings": 8,
                             "short_factor": [1.0] * 4, "long_factor": [2] * 4})
    assert s.long_factor == (2.0,) * 4 and hash(s) == hash(dataclasses.replace(s))
    assert RopeScaling.from_dict(json.loads(json.dumps(dataclasses.asdict(s)))) == s
    with pytest.raises(ValueError, match=r"needs dim // 2 = 8"):
        rope_inv_freq(s, 16, 1e4, seq_len=4)
    with pytest.raises(ValueError, match="must be even"):
        rope_inv_freq(RopeScaling(), 7, 1e4)
    with pytest.raises(ValueError, match=r"dynamic.*>= 4"):
        rope_inv_freq(RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=8), 2, 1e4, seq_len=4)
    with pytest.raises(TypeError, match="scaling"):  # (the test run's type checks speak first)
        rope_inv_freq({"rope_type": "linear"}, 8, 1e4)


# --------------------------------------------------------------------------- the model


def _model_config(**kw):
    return TransformerConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=2, max_seq_len=128, **kw)


def _old_rope(x, positions, theta):
    """The model's RoPE before rope scaling existed (verbatim)."""
    d = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def test_model_without_rope_scaling_is_unchanged(key, monkeypatch):
    """rope_scaling=None: logits bit-identical to the old RoPE. ``RopeScaling("default")`` (transformers'
    ``1 / theta ** (2i / d)``) differs from the old ``theta ** (-2i / d)`` by an ulp in some frequencies:
    measured max abs logit difference 2.0e-6 (logits ~3); bound 5x."""
    import ringsplash.model.attention as attention

    config = _model_config(rope_theta=5e5)
    model = Transformer(config, key=key)
    tokens = jax.random.randint(key, (128,), 0, config.vocab_size)
    positions = jnp.arange(128) * 7  # far positions, where frequency rounding shows
    new = np.asarray(eqx.filter_jit(lambda m: m(tokens, positions))(model))
    default = Transformer(config.replace(features=config.features.replace(rope_scaling=RopeScaling())), key=key)
    with_default = np.asarray(eqx.filter_jit(lambda m: m(tokens, positions))(default))
    monkeypatch.setattr(attention, "rope", lambda x, p, theta, scaling, seq_len: _old_rope(x, p, theta))
    old = np.asarray(eqx.filter_jit(lambda m: m(tokens, positions))(model))
    np.testing.assert_array_equal(new, old)
    np.testing.assert_allclose(with_default, new, rtol=0, atol=1e-5)


def test_model_rope_scaling_changes_far_positions_and_config_round_trips(key):
    s = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32)
    config = _model_config(features=ModelFeatures(rope_scaling=s))
    d = json.loads(json.dumps(config.to_dict()))
    assert TransformerConfig.from_dict(d) == config
    long = _model_config(features=ModelFeatures(rope_scaling=RopeScaling("longrope", factor=4.0, original_max_position_embeddings=32,
                                                  short_factor=(1.0,) * 8, long_factor=(2.0,) * 8)))
    assert TransformerConfig.from_dict(json.loads(json.dumps(long.to_dict()))) == long
    model = Transformer(config, key=key)
    plain = Transformer(_model_config(), key=key)
    tokens = jax.random.randint(key, (128,), 0, config.vocab_size)
    a, b = (np.asarray(eqx.filter_jit(lambda m: m(tokens, jnp.arange(128)))(m)) for m in (model, plain))
    assert np.isfinite(a).all() and not np.allclose(a, b)
    with pytest.raises(ValueError, match="needs dim // 2 = 8"):
        _model_config(features=ModelFeatures(rope_scaling=RopeScaling("longrope", factor=4.0, original_max_position_embeddings=32,
                                               short_factor=(1.0,) * 4, long_factor=(2.0,) * 4)))
    with pytest.raises(TypeError, match="rope_scaling"):  # (the test run's type checks speak first)
        _model_config(features=ModelFeatures(rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_import_ringsplash_does_not_import_torch():
    code = ("import sys, ringsplash, ringsplash.model, ringsplash.model.rope_scaling; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rope_scaling_from_flags():
    assert rope_scaling_from_flags("", 0.0, 0) is None
    assert rope_scaling_from_flags("linear", 4.0, 0) == RopeScaling("linear", factor=4.0)
    assert rope_scaling_from_flags("llama3", 8.0, 8192) == RopeScaling(
        "llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    assert rope_scaling_from_flags("yarn", 4.0, 256) == RopeScaling("yarn", factor=4.0,
                                                                    original_max_position_embeddings=256)
    for args, match in [(("", 2.0, 0), "need --rope-scaling"), (("longrope", 2.0, 8), "use one of"),
                        (("yarn", 0.0, 8), "needs --rope-factor > 0"), (("dynamic", 2.0, 0), "--rope-original-max-len"),
                        (("linear", 2.0, 8), "does not apply to --rope-scaling=linear")]:
        with pytest.raises(ValueError, match=match):
            rope_scaling_from_flags(*args)


def test_experiment_and_preflight_take_rope_flags():
    """Both configs parse the flags (a subprocess: the preflight sets TPU environment variables on import)."""
    code = """
import importlib.util, sys
from ringsplash.model import rope_scaling_from_flags
for path in ("experiments/train_long_context.py", "scripts/aot_preflight.py"):
    spec = importlib.util.spec_from_file_location(path.split("/")[-1][:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.parse_args(["--rope-scaling", "yarn", "--rope-factor", "4", "--rope-original-max-len", "256"])
    print(rope_scaling_from_flags(c.rope_scaling, c.rope_factor, c.rope_original_max_len).to_hf())
"""
    root = pathlib.Path(__file__).parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    expected = str({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    assert out.split("\n")[-3:-1] == [expected, expected], out
