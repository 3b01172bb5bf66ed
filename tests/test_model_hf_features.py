"""The Hugging Face family features of ``TransformerConfig`` / ``Transformer``: tiny random
transformers models (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3; float32, eager attention)
copied into our model give transformers' logits on 512 tokens with windows shorter than the
sequence; the defaults leave today's model bit for bit; a patterned model's program does not grow
with depth and runs the same under the ring; bad values are rejected naming the field.

torch and transformers (the oracle, test dependencies) are imported by the helpers that use them, not at
collection (they cost seconds there)."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ringsplash import data, layouts, partitioning, train
from ringsplash.model import ContextParallel, RopeScaling, Transformer, TransformerConfig
from ringsplash.model.hf_features import LayerSegment, ModelFeatures, layer_segments, nest_features
from ringsplash.model.schedule import schedule_bytes_per_device
from ringsplash.model.transformer import _layer_schedules
from ringsplash.splash import SplashConfig

S = 512
V = 96
#: transformers' class names per family (model class prefix, config class infix)
HF_NAMES = {"llama": ("Llama", ""), "mistral": ("Mistral", ""), "qwen2": ("Qwen2", ""), "qwen3": ("Qwen3", ""),
            "gemma2": ("Gemma2", ""), "gemma3": ("Gemma3", "Text")}


# ------------------------------------------------------------------ transformers oracle


def _hf_model(family: str, **kw):
    """A tiny random transformers causal LM of ``family`` (float32, eager attention), every weight
    (norms included) drawn at random so a wrong offset, bias or norm shows."""
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2 * S)
    import torch
    import transformers

    name, infix = HF_NAMES[family]
    cls, cfg_cls = getattr(transformers, f"{name}ForCausalLM"), getattr(transformers, f"{name}{infix}Config")
    config = cfg_cls(**{**base, **kw})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).float().eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (0.3 if "embed" in name and gemma else 1.0))
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


def _load(hf, config: TransformerConfig) -> Transformer:
    """Test-local name map: the transformers weights copied into our model (HF ``[out, in]`` transposed)."""
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    gemma = config.features.post_norms

    def stack(name, transpose=True):
        return jnp.asarray(np.stack([sd[f"model.layers.{i}.{name}"].T if transpose else sd[f"model.layers.{i}.{name}"]
                                     for i in range(config.num_layers)]))

    pairs = [(lambda m: m.embedding, jnp.asarray(sd["model.embed_tokens.weight"])),
             (lambda m: m.final_norm.weight, jnp.asarray(sd["model.norm.weight"]))]
    if not config.features.tie_embeddings:
        pairs.append((lambda m: m.unembedding, jnp.asarray(sd["lm_head.weight"].T)))
    a = "self_attn."
    names = {"attention.wq": a + "q_proj.weight", "attention.wk": a + "k_proj.weight",
             "attention.wv": a + "v_proj.weight", "attention.wo": a + "o_proj.weight",
             "mlp.w_gate": "mlp.gate_proj.weight", "mlp.w_up": "mlp.up_proj.weight",
             "mlp.w_down": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight"}
    vectors = {"attention.bq": a + "q_proj.bias", "attention.bk": a + "k_proj.bias", "attention.bv": a + "v_proj.bias",
               "attention.q_norm.weight": a + "q_norm.weight", "attention.k_norm.weight": a + "k_norm.weight"}
    if gemma:
        vectors.update({"mlp_norm.weight": "pre_feedforward_layernorm.weight",
                        "post_attention_norm.weight": "post_attention_layernorm.weight",
                        "post_mlp_norm.weight": "post_feedforward_layernorm.weight"})
    else:
        vectors["mlp_norm.weight"] = "post_attention_layernorm.weight"
    for ours, theirs in {**names, **vectors}.items():
        if f"model.layers.0.{theirs}" not in sd:
            continue

        def where(m, path=ours):
            for part in ("layers." + path).split("."):
                m = getattr(m, part)
            return m

        pairs.append((where, stack(theirs, transpose=ours in names and "norm" not in ours)))
    model = Transformer(config, key=jax.random.key(0))
    for where, value in pairs:
        assert where(model).shape == value.shape, (where, where(model).shape, value.shape)
        model = eqx.tree_at(where, model, value)
    return model


def _common(hf) -> dict:
    c = hf.config
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    return dict(vocab_size=c.vocab_size, d_model=c.hidden_size, num_layers=c.num_hidden_layers,
                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                intermediate_size=c.intermediate_size, max_seq_len=S, rope_theta=rope["rope_theta"],
                rope_scaling=RopeScaling(), norm_eps=c.rms_norm_eps, tie_embeddings=c.tie_word_embeddings)


def _flat_config(**fields) -> TransformerConfig:
    """A config from flat fields (the ``ModelFeatures`` ones nested into ``features``)."""
    return TransformerConfig(**nest_features(fields))


def _gemma(hf) -> dict:
    c = hf.config
    return dict(mlp_activation="gelu_tanh", norm_offset=1.0, post_norms=True, scale_embeddings=True,
                attention_scale=c.query_pre_attn_scalar**-0.5, logit_soft_cap=c.attn_logit_softcapping,
                final_logit_soft_cap=c.final_logit_softcapping, layer_types=tuple(c.layer_types),
                sliding_window=c.sliding_window)


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, S).astype(np.int32)


def _compare(hf, config, atol):
    tokens = _tokens()
    ours = np.asarray(eqx.filter_jit(_load(hf, config))(jnp.asarray(tokens), jnp.arange(S)))
    theirs = _hf_logits(hf, tokens)
    err = float(np.max(np.abs(ours - theirs)))
    assert err <= atol, (err, float(np.max(np.abs(theirs))))
    return err


# measured max |ours - transformers| over the 512 x 96 logits (float32, CPU; fixed seeds) is in each
# test's comment; every tolerance is 10x it. A wrong feature is off by 0.07 (Gemma 2 without its final
# soft cap) to 1.6 (Mistral's window one token too short): 4 orders of magnitude above the tolerances.
@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
@pytest.mark.parametrize("tie", [False, True])
def test_llama_matches_transformers(tie):
    """Llama (a tied one: the unembedding is the embedding itself). Measured 5.2e-6 / 6.0e-6 (tied)."""
    hf = _hf_model("llama", tie_word_embeddings=tie, rms_norm_eps=1e-5)
    _compare(hf, _flat_config(**_common(hf)), atol=6e-5)


@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
def test_qwen2_attention_bias_matches_transformers():
    """q/k/v biases. Measured 3.0e-6."""
    hf = _hf_model("qwen2")
    assert hf.model.layers[0].self_attn.q_proj.bias is not None
    _compare(hf, _flat_config(**_common(hf), features=ModelFeatures(attention_bias=True)), atol=3e-5)


@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
def test_qwen3_qk_norm_matches_transformers():
    """Per-head RMSNorm of q and k before RoPE. Measured 4.0e-6."""
    hf = _hf_model("qwen3")
    _compare(hf, _flat_config(**_common(hf), features=ModelFeatures(qk_norm=True)), atol=4e-5)


def _mistral(w=100):
    hf = _hf_model("mistral", sliding_window=w)
    return hf, _flat_config(**_common(hf), mask="local", local_window=w - 1)


@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
def test_mistral_sliding_window_matches_transformers():
    """Mistral's window of W keys (the query included) is mask='local' with local_window = W - 1.
    Measured 4.6e-6."""
    _compare(*_mistral(), atol=5e-5)


@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
def test_all_sliding_layer_types_equal_local_mask():
    """Mistral's two spellings agree: every layer 'sliding_attention' with sliding_window=W is mask='local'
    with local_window=W - 1 (the hf loader uses the latter: one mask, one ring schedule)."""
    n, w = 128, 40
    local = TransformerConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, max_seq_len=n, mask="local",
                              local_window=w - 1)
    typed = local.replace(mask="causal", local_window=None, features=local.features.replace(layer_types=("sliding_attention",) * 2, sliding_window=w))
    model = Transformer(local, key=jax.random.key(4))
    tokens = jnp.asarray(_tokens()[:n], jnp.int32)
    run = eqx.filter_jit(lambda m: m(tokens, jnp.arange(n)))
    np.testing.assert_array_equal(run(model), run(model.with_config(typed)))


@pytest.mark.slow
def test_sliding_window_one_token_off_is_caught():
    """The comparisons see a window one token too long or short: off by > 1 (Mistral), 0.34 (Gemma 2)."""
    hf, config = _mistral()
    for off in (config.local_window + 1, config.local_window - 1):
        with pytest.raises(AssertionError):
            _compare(hf, config.replace(local_window=off), atol=5e-5)
    hf, config = _gemma2()
    with pytest.raises(AssertionError):
        _compare(hf, config.replace(features=config.features.replace(sliding_window=config.features.sliding_window + 1)), atol=1.1e-5)


def _gemma2():
    hf = _hf_model("gemma2", sliding_window=100, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")
    return hf, _flat_config(**_common(hf), **_gemma(hf))


def test_gemma2_matches_transformers():
    """(1 + w) norms, sandwich norms, GeGLU (tanh), scaled embeddings, query_pre_attn_scalar, both soft
    caps, alternating sliding / full layers. Measured 1.1e-6."""
    hf, config = _gemma2()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    _compare(hf, config, atol=1.1e-5)


@pytest.mark.slow
def test_gemma3_matches_transformers():
    """Gemma 3: qk norms with Gemma's offset, sliding layers on their own unscaled RoPE base, full
    layers with linear scaling; 8 layers = one period of 6 (5 sliding, 1 full) + 2. Measured 1.6e-6
    (without local_rope_theta: off by 1.1)."""
    hf = _hf_model("gemma3", num_hidden_layers=8, sliding_window=100, query_pre_attn_scalar=24,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}})
    config = _flat_config(**{**_common(hf), **_gemma(hf), "qk_norm": True, "local_rope_theta": 1_000.0,
                                  "rope_scaling": RopeScaling(type="linear", factor=4.0)})
    assert config.rope_theta == 50_000.0 and hf.config.layer_types.count("full_attention") == 1
    assert [len(s.kinds) for s in layer_segments(config.features.layer_types, 8)] == [6, 2]
    _compare(hf, config, atol=1.6e-5)


# ------------------------------------------------------------------ defaults unchanged


def _default_model():
    config = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)
    return Transformer(config, key=jax.random.key(0))


@pytest.mark.skipif(os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") != "1",
                    reason="golden values recorded under conftest's JAX_DISABLE_MOST_OPTIMIZATIONS=1")
def test_defaults_bit_identical_to_before_hf_features():
    """Parameters and logits of a default model, recorded before the Hugging Face features existed
    (jax 0.10.2, XLA:CPU with conftest's settings): the new fields' defaults add nothing."""
    model = _default_model()
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    sums = [float(np.asarray(x, np.float64).sum()) for x in leaves]
    assert sums == [-61.46454806777183, 64.0, -1.2142124396259533, -0.0863424998242408, -2.2175570150866406,
                    0.7549337982536599, 64.0, 16.419366404206812, -6.8509412860439625, 3.6115470963413827, 32.0,
                    2.847027387952039]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, 64), jnp.int32)
    logits = np.asarray(model(tokens, jnp.arange(64)))
    # The parameters are bits of the PRNG (exact on any machine); the logits' last bits are not:
    # XLA:CPU blocks its matmuls by the host's cache sizes, so another CPU sums in another order
    # (measured 2.8e-7 between two machines, logits up to 3.2). 3e-6: ~10x that, far below any
    # change a new field's default could make. (Exactly the same program: the test below.)
    recorded = {(0, 3): 1.9294724464416504, (17, 40): 0.22965218126773834, (63, 63): 0.22944486141204834,
                **{(5, j): float(x) for j, x in enumerate(np.array([3209683123, 3193478236, 3190999420, 1066385347],
                                                                    np.uint32).view(np.float32))}}
    for (i, j), want in recorded.items():
        assert abs(float(logits[i, j]) - want) <= 3e-6, ((i, j), float(logits[i, j]), want)
    assert abs(float(logits.astype(np.float64).sum()) - -187.9973592367187) <= 64 * 64 * 3e-6


def test_defaults_add_no_parameters_or_ops():
    """Default fields: no bias / qk-norm / post-norm leaves, and the same program as with every new
    option spelled out at its default."""
    model = _default_model()
    a = model.layers.attention
    assert a.bq is None and a.q_norm is None and model.layers.post_attention_norm is None
    spelled = model.config.replace(features=model.config.features.replace(intermediate_size=None, mlp_activation="silu", attention_bias=False, qk_norm=False, norm_eps=1e-6, norm_offset=0.0, post_norms=False, scale_embeddings=False, attention_scale=None, final_logit_soft_cap=None, layer_types=None))
    tokens = jnp.zeros(64, jnp.int32)
    jaxpr = lambda m: str(jax.make_jaxpr(lambda t: m(t, jnp.arange(64)))(tokens))
    assert jaxpr(model) == jaxpr(model.with_config(spelled))


def test_tied_unembedding_is_the_embedding():
    config = TransformerConfig(vocab_size=512, d_model=64, num_layers=1, num_heads=4, max_seq_len=64,
                               features=ModelFeatures(tie_embeddings=True))
    model = Transformer(config, key=jax.random.key(0))
    assert model.unembedding is None
    np.testing.assert_array_equal(model.unembedding_matrix(), model.embedding.T)
    # fresh init: embedding std d_model ** -0.5, so the initial logits have std ~1, as untied ones do
    assert abs(float(jnp.std(model.embedding)) * 64**0.5 - 1) < 0.05
    logits = eqx.filter_jit(model)(jnp.arange(64, dtype=jnp.int32), jnp.arange(64))
    assert 0.5 < float(jnp.std(logits)) < 2


def test_fresh_offset_norm_is_the_plain_norm():
    """norm_offset=1 (Gemma): fresh weights are 0, so a fresh model computes what norm_offset=0 would."""
    from ringsplash.model import RMSNorm

    x = jax.random.normal(jax.random.key(0), (3, 5, 16))
    gemma, plain = RMSNorm(16, jnp.float32, offset=1.0), RMSNorm(16, jnp.float32)
    assert not np.any(np.asarray(gemma.weight))
    np.testing.assert_array_equal(gemma(x), plain(x))


# ------------------------------------------------------------------ layer patterns


def test_layer_segments():
    g2 = ("sliding_attention", "full_attention")
    assert layer_segments(None, 5) == (LayerSegment(0, 5, (None,)),)
    assert layer_segments(g2 * 3, 6) == (LayerSegment(0, 3, g2),)
    g3 = ("sliding_attention",) * 5 + ("full_attention",)
    assert layer_segments((g3 * 5)[:26], 26) == (LayerSegment(0, 4, g3), LayerSegment(24, 1, g3[:2]))
    assert layer_segments(("full_attention",) * 4, 4) == (LayerSegment(0, 4, ("full_attention",)),)
    qwen2 = ("full_attention",) * 3 + ("sliding_attention",) * 2  # no repeat: one scan per run
    assert layer_segments(qwen2, 5) == (LayerSegment(0, 3, qwen2[:1]), LayerSegment(3, 2, qwen2[3:4]))


def _patterned(num_layers=2, **kw):
    types = ("sliding_attention", "full_attention") * (num_layers // 2) + ("sliding_attention",) * (num_layers % 2)
    base = dict(vocab_size=V, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2, max_seq_len=S,
                layer_types=types, sliding_window=60, local_rope_theta=500.0, norm_offset=1.0, post_norms=True,
                qk_norm=True, scale_embeddings=True, mlp_activation="gelu_tanh", final_logit_soft_cap=4.0,
                logit_soft_cap=20.0, attention_scale=0.2, tie_embeddings=True, sinks=True)
    return TransformerConfig(**nest_features({**base, **kw}))


def _count_eqns(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count_eqns(inner)
    return n


@pytest.mark.parametrize("shallow, deep", [(6, 12), (7, 13)])
def test_patterned_program_size_does_not_grow_with_depth(shallow, deep):
    """Traced equations (sub-programs included) of a period-2 model (odd: + a remainder layer): the
    same at any depth."""
    sizes = []
    for n in (shallow, deep):
        model = eqx.filter_eval_shape(Transformer, _patterned(n), key=jax.random.key(0))
        jaxpr = jax.make_jaxpr(lambda m: m(jnp.zeros(S, jnp.int32), jnp.arange(S)))(model)
        sizes.append(_count_eqns(jaxpr.jaxpr))
    assert sizes[0] == sizes[1]


def _unrolled(model: Transformer, tokens, positions):
    """Oracle of the segment scans: a Python loop over the layers, each run with its layer type."""
    c = model.config
    x = model.embedding[tokens] * jnp.float32(c.d_model**0.5)
    mx = []
    for i in range(c.num_layers):
        layer = jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, model.layers)
        x, m = layer(x, positions, None, return_max_logits=True, layer_type=c.features.layer_types[i])
        mx.append(m)
    return model.logits(model.final_norm(x)), jnp.stack(mx)


@pytest.mark.parametrize("num_layers", [pytest.param(5, marks=pytest.mark.slow), 2])
def test_patterned_scan_matches_layer_loop(num_layers):
    """The grouped scans (5 layers: 2 groups of 2 + 1) run each layer with its own type, in order,
    with max logits per layer. 128 tokens: windows of 60 matter."""
    n = 128
    model = Transformer(_patterned(num_layers, max_seq_len=n), key=jax.random.key(1))
    tokens, pos = jnp.asarray(_tokens()[:n], jnp.int32), jnp.arange(n)
    want, want_mx = eqx.filter_jit(_unrolled)(model, tokens, pos)
    (_, mx), got = eqx.filter_jit(lambda m: (m.hidden(tokens, pos, return_max_logits=True), m(tokens, pos)))(model)
    errs = float(np.max(np.abs(got - want))), float(np.max(np.abs(mx - want_mx)))
    print(f"{num_layers} layers: max |d logits| {errs[0]:.1e}, max |d max logits| {errs[1]:.1e}")
    assert mx.shape == (num_layers, 4)
    assert errs[0] <= 3e-5 and errs[1] <= 3e-5  # measured <= 3.1e-6 (XLA fuses a scan and a loop differently)


@pytest.mark.slow
def test_patterned_gradients_under_remat():
    """A 3-layer pattern (a group of 2 + 1) under remat='full' and 'save_attention': the gradients of 'none'."""
    n = 128
    model = Transformer(_patterned(3, max_seq_len=n), key=jax.random.key(1))
    tokens, pos = jnp.asarray(_tokens()[:n], jnp.int32), jnp.arange(n)
    loss = lambda m: jnp.mean(m(tokens, pos) ** 2)
    want = eqx.filter_jit(eqx.filter_grad(loss))(model)
    for remat in ("full", "save_attention"):
        got = eqx.filter_jit(eqx.filter_grad(loss))(model.with_config(model.config.replace(remat=remat)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_final_soft_cap_in_chunked_loss():
    """The trainer's chunked loss applies final_logit_soft_cap as the model's logits do."""
    model = Transformer(_patterned(2, max_seq_len=128), key=jax.random.key(2))
    tokens = jnp.asarray(_tokens()[:128], jnp.int32)
    labels = jnp.roll(tokens, -1)
    logits, hidden = eqx.filter_jit(lambda m: (m(tokens, jnp.arange(128)), m.hidden(tokens, jnp.arange(128))))(model)
    assert float(jnp.max(jnp.abs(logits))) < 4.0
    want = float(jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels)))
    s, _ = train.chunked_loss_sums(hidden, model.unembedding_matrix(), labels, jnp.ones(128), 32,
                                   model.config.features.final_logit_soft_cap)
    np.testing.assert_allclose(float(s), want, rtol=1e-5)


# ------------------------------------------------------------------ patterned model under every strategy

BLOCKS = SplashConfig(block_q=128, block_kv=128, block_q_dkv=128, block_kv_dkv=128, backend="xla")
RING = dict(splash=BLOCKS)
STRATEGIES = {
    "splash": dict(context_parallel=ContextParallel("splash"), splash=BLOCKS),
    "ring-4-zigzag": dict(context_parallel=ContextParallel("ring", ring_size=4), **RING),
    "allgather-4": dict(context_parallel=ContextParallel("allgather", ring_size=4), **RING),
    "ulysses-2": dict(context_parallel=ContextParallel("ulysses", ulysses_size=2), splash=BLOCKS),
    "usp-2x2": dict(context_parallel=ContextParallel("usp", ring_size=2, ulysses_size=2), **RING),
}


def _strategy_logits(config, model, tokens, *, fsdp=False):
    """Logits in original order through the trainer's mesh, batch layout and ring schedule(s)."""
    batch = data.pack_documents([np.asarray(tokens)], S, 1)
    mesh = train.mesh_for(config)
    sharded = train.shard_batch(batch, mesh, config)
    params, static = eqx.partition(model, eqx.is_array)
    plan = train.sharding_plan(config, mesh, fsdp=fsdp)
    assert plan.sharded == fsdp  # sharded: each layer's weights are gathered inside the scanned step
    params = jax.device_put(params, partitioning.shardings(plan.specs, mesh))
    logits_fn = train.make_logits_fn(config, mesh, plan=plan)
    logits = np.asarray(logits_fn(eqx.combine(params, static), sharded))
    if config.context_shards > 1:
        logits = layouts.unpermute(logits, config.context_parallel.layout, config.layout_shards, axis=1)
    return logits[0]


@pytest.fixture(scope="module")
def patterned_reference():
    config = _patterned(2, context_parallel=ContextParallel("reference"))  # the dense oracle
    model = Transformer(config, key=jax.random.key(3))
    tokens = _tokens(1)
    return model, tokens, np.asarray(eqx.filter_jit(model)(jnp.asarray(tokens), jnp.arange(S)))


@pytest.mark.slow  # compiles models (tests/test_hf.py keeps Llama and Gemma 3 in the fast tier)
def test_patterned_ring_matches_reference(patterned_reference):
    """A Gemma-2-like model (sliding + full layer, each with its own ring schedule) under the zigzag
    ring on 4 devices, parameters FSDP-sharded: the reference's logits. Measured 2.2e-6."""
    model, tokens, want = patterned_reference
    config = model.config.replace(**STRATEGIES["ring-4-zigzag"])
    mesh = train.mesh_for(config)
    schedule = train.batch_ring_schedule(config, mesh, train.shard_batch(data.pack_documents([tokens], S, 1), mesh,
                                                                         config))
    assert set(schedule) == {"full_attention", "sliding_attention"}
    assert schedule_bytes_per_device(schedule) == sum(s.nbytes_per_device for s in schedule.values()) > 0
    got = _strategy_logits(config, model.with_config(config), tokens, fsdp=True)
    err = float(np.max(np.abs(got - want)))
    print(f"ring: max |d logits| {err:.1e}")
    assert err <= 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in STRATEGIES if c != "ring-4-zigzag"])
def test_patterned_strategies_match_reference(patterned_reference, case):
    model, tokens, want = patterned_reference
    config = model.config.replace(**STRATEGIES[case])
    got = _strategy_logits(config, model.with_config(config), tokens)
    err = float(np.max(np.abs(got - want)))
    print(f"{case}: max |d logits| {err:.1e}")
    assert err <= 2e-5  # measured <= 2.2e-6 over the cases


def test_one_schedule_for_two_masks_is_rejected():
    config = _patterned(2).replace(**STRATEGIES["ring-4-zigzag"])
    with pytest.raises(ValueError, match="pass schedule as a dict"):
        _layer_schedules(config, object())
    with pytest.raises(ValueError, match="map each layer type"):
        _layer_schedules(config, {"full_attention": None})


# ------------------------------------------------------------------ config: bad values, round trip


BAD = [
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(norm_offset=float("nan")), "norm_offset"),
    (dict(attention_scale=-1.0), "attention_scale"),
    (dict(final_logit_soft_cap=0.0), "final_logit_soft_cap"),
    (dict(layer_types=("full_attention",)), "layer_types"),
    (dict(layer_types=("full_attention", "sliding_attention")), "sliding_window"),
    (dict(layer_types=("full_attention", "sliding_attention"), sliding_window=0), "sliding_window"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(layer_types=("full_attention",) * 2, sliding_window=8), "sliding_window"),
    (dict(local_rope_theta=1e4), "local_rope_theta"),
    (dict(layer_types=("full_attention", "sliding_attention"), sliding_window=8, local_rope_theta=0.0),
     "local_rope_theta"),
    (dict(qk_norm=True, qk_clip_threshold=50.0), "qk_clip_threshold"),
]


@pytest.mark.parametrize("changes, field", BAD, ids=[str(c) for c, _ in BAD])
def test_bad_hf_feature_values_rejected(changes, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**nest_features(dict(vocab_size=V, d_model=32, num_layers=2, num_heads=4, **changes)))


# a flag of another type is a TypeError, an option outside its choices a ValueError
WRONG_TYPES = [("attention_bias", 1, TypeError), ("qk_norm", "yes", TypeError), ("post_norms", None, TypeError),
               ("scale_embeddings", 0, TypeError), ("layer_types", "full_attention", ValueError),
               ("mlp_activation", "gelu", ValueError), ("layer_types", ("full_attention", "local"), ValueError)]


@pytest.mark.parametrize("field, value, error", WRONG_TYPES)
def test_wrong_typed_hf_feature_values_rejected(field, value, error):
    """Outside the tests' annotation checks (as in library use) __post_init__ names the field too."""
    features = ModelFeatures()
    with pytest.raises(error, match=field):
        object.__setattr__(features, field, value)
        features.__post_init__()


def test_config_dict_round_trip_through_json():
    config = _patterned(2, rope_scaling=RopeScaling(type="linear", factor=2.0), intermediate_size=40,
                        attention_bias=True, norm_eps=1e-5, attention_scale=0.25)
    d = json.loads(json.dumps(config.to_dict()))
    assert isinstance(d["features"]["layer_types"], list)
    back = TransformerConfig.from_dict(d)
    assert back == config and isinstance(back.features.layer_types, tuple) and hash(back) == hash(config)
    assert back.mlp_hidden == 40
