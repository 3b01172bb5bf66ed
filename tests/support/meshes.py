"""Simulated CPU meshes for the context-parallel tests."""

import jax
from jax.sharding import AxisType


def mesh(n: int, name: str = "ctx"):
    """A 1-D mesh of the first ``n`` simulated devices, axis ``name``."""
    return jax.make_mesh((n,), (name,), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))
