"""Test session set-up: CPU platform with 8 simulated devices, set before JAX initialises.

TPU code is proven here without a TPU: Pallas interpret mode for numerics, libtpu compiles for
real TPU topologies (``jax.experimental.topologies``) and simulated CPU meshes.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu looks for TPU metadata on import; on a CPU machine tell it there is none to find.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
# test subprocesses (scripts) load libtpu too; let them share it
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ringsplash",
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ringsplash")

import pytest  # noqa: E402


@pytest.fixture
def key(request):
    """A fresh PRNG key per test, derived from the test's name (reproducible, never zeros)."""
    import zlib

    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))
