"""The model with any mask: a function ``fn(q_pos, kv_pos) -> bool`` (a FunctionMask at every
length) or a ``Mask`` of the training length, under the reference and the ring; bad masks are
refused at construction, and config.json records them."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ringsplash import masks
from ringsplash.model import ContextParallel, Transformer, TransformerConfig
from support.errors import assert_refused
from test_model_strategies import S, _batch, _config, _run

# float32, CPU: the reference strategy with a FunctionMask and with the same rule as a NumpyMask
# evaluates the same dense mask, so the logits are bit-identical (measured); the ring (zigzag, 4
# devices) against the reference: measured max |d logits| 1.2e-6, relative grad error 6.8e-7 (4x, 9x headroom)
LOGITS_ATOL, GRAD_RTOL = 5e-6, 6e-6


def sink_window(q, kv):
    """Four global tokens plus a causal window of 100: the "attention sinks + sliding window" rule."""
    return (kv < 4) & (kv <= q) | ((q >= kv) & (q - kv < 100))


def _dense(fn, s):
    pos = np.arange(s)
    return np.asarray(fn(jnp.asarray(pos)[:, None], jnp.asarray(pos)[None, :]))


def test_function_mask_config_builds_a_function_mask_at_every_length():
    config = _config(mask=sink_window)
    for s in (S, 256):
        m = config.make_mask(s)
        assert isinstance(m, masks.FunctionMask) and m.shape == (s, s)
        assert m == config.make_mask(s)  # equal (shape, fn): the mask-info and schedule caches hit
        np.testing.assert_array_equal(m[:, :], _dense(sink_window, s))


def test_mask_object_config_serves_its_length_only():
    m = masks.CausalMask((S, S)) & masks.LocalMask((S, S), window=(64, 0))
    config = _config(mask=m)
    assert config.make_mask(S) is m
    with pytest.raises(ValueError, match=r"has shape \(512, 512\), but the model is called on 256 tokens.*function"):
        config.make_mask(256)


@pytest.mark.parametrize("mask, error, fragments", [
    (masks.CausalMask((256, 256)), ValueError, ["has shape (256, 256), not (max_seq_len, max_seq_len) = (512, 512)"]),
    (masks.MultiHeadMask([masks.CausalMask((S, S))] * 8), TypeError, ["one 2-D mask for every head"]),
    (3, TypeError, ["mask must be one of", "a function fn(q_pos, kv_pos) -> bool, got int 3"]),
    ("diagonal", ValueError, ["mask", "diagonal"]),
])
def test_bad_masks_are_refused_at_construction(mask, error, fragments):
    # the config's own check: called directly, since under the test run's jaxtyping/beartype hook the
    # constructor's annotation check refuses the wrong types first (a TypeError naming `mask`, below)
    config = _config()
    object.__setattr__(config, "mask", mask)
    assert_refused(error, config._check_mask, fragments)
    with pytest.raises((ValueError, TypeError), match="mask"):
        _config(mask=mask)


def test_named_kind_options_are_refused_with_a_custom_mask():
    with pytest.raises(ValueError, match=r"local_window=64 only applies to a named mask kind"):
        _config(mask=sink_window, local_window=64)


def test_a_function_that_does_not_trace_is_named_at_construction():
    with pytest.raises(Exception, match=r"fn"):
        _config(mask=lambda q, kv: q.nonexistent_method(kv))


def test_config_json_records_a_custom_mask_and_refuses_to_rebuild_it():
    for mask, record in [(sink_window, "function test_model_masks.sink_window"),
                         (masks.CausalMask((S, S)), repr(masks.CausalMask((S, S))))]:
        d = _config(mask=mask).to_dict()
        assert json.loads(json.dumps(d))["mask"] == record
        with pytest.raises(ValueError, match=r"records a custom mask .*pass the mask itself"):
            TransformerConfig.from_dict(d)
        assert TransformerConfig.from_dict({**d, "mask": mask}) == _config(mask=mask)
    assert TransformerConfig.from_dict(_config(mask="local", local_window=8).to_dict()).mask == "local"


@pytest.mark.slow
def test_model_with_a_function_mask_matches_the_same_rule_dense_and_under_the_ring():
    """The reference strategy with ``mask=fn`` equals it with the rule as a NumpyMask (an oracle
    independent of FunctionMask); the ring over 4 devices (zigzag: the kernels evaluate ``fn`` on
    permuted positions) gives the reference's logits and gradients."""
    batch = _batch()
    fn_config = _config(mask=sink_window, context_parallel=ContextParallel("reference"))  # the dense oracle
    model = Transformer(fn_config, key=jax.random.key(0))
    logits, grads = _run(fn_config, model, batch)
    dense_config = fn_config.replace(mask=masks.NumpyMask(_dense(sink_window, S)))
    dense_logits, _ = _run(dense_config, model.with_config(dense_config), batch)
    np.testing.assert_array_equal(logits, dense_logits)
    causal_logits, _ = _run(fn_config.replace(mask="causal"), model.with_config(fn_config.replace(mask="causal")),
                            batch)
    assert float(np.max(np.abs(logits - causal_logits))) > 1e-3  # the window matters at S = 512

    ring_config = fn_config.replace(context_parallel=fn_config.context_parallel.replace(strategy="ring", ring_size=4, layout="zigzag"))
    ring_logits, ring_grads = _run(ring_config, model.with_config(ring_config), batch)
    err = float(np.max(np.abs(ring_logits - logits)))
    grad_err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / np.max(np.abs(np.asarray(r))))
                   for g, r in zip(jax.tree.leaves(ring_grads), jax.tree.leaves(grads), strict=True))
    print(f"ring vs reference: max |d logits| = {err:.2e}, relative grad error = {grad_err:.2e}")
    assert err <= LOGITS_ATOL and grad_err <= GRAD_RTOL
