"""Decoding compiled for one v5e chip from a CPU host (libtpu): the abstract model, cache and tokens, and what
the scheduled program says about cache copies and temporaries."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DecodeCompile(NamedTuple):
    model: object
    cache: object
    token: object

    @property
    def cache_bytes(self) -> int:
        return self.cache.k.size * self.cache.k.dtype.itemsize

    def report(self, fn):
        """``(compiled text, cache copies in its entry computation, temp bytes)`` of ``jit(fn, donate the
        cache)(model, cache, token)``."""
        compiled = jax.jit(fn, donate_argnums=1).trace(self.model, self.cache, self.token).lower().compile()
        text = compiled.as_text()
        entry = text[text.index("ENTRY"):]
        slots = self.cache.k.shape[3]
        copies = [line for line in entry.splitlines() if " copy(" in line and f",{slots}," in line]
        return text, copies, compiled.memory_analysis().temp_size_in_bytes


def v5e_decode_inputs(config, batch: int, max_len: int) -> DecodeCompile:
    """Abstract inputs of ``config``'s decoding on one v5e chip: ``batch`` rows of ``max_len`` slots."""
    from ringsplash import aot
    from ringsplash.inference import empty_cache
    from ringsplash.model import abstract_model

    sharding = jax.sharding.SingleDeviceSharding(aot.topology_devices("v5e:1x1")[0])
    put = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) if hasattr(a, "shape") else a
    model = jax.tree.map(put, abstract_model(config))
    cache = jax.tree.map(put, jax.eval_shape(lambda: empty_cache(config, batch, max_len)))
    return DecodeCompile(model, cache, put(jax.ShapeDtypeStruct((batch,), jnp.int32)))
