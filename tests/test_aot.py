"""ringsplash.aot: the chip table, topology meshes and a compile report for a real TPU target."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ringsplash import aot


def test_aot_imports_no_model_or_training_code():
    code = ("import sys, ringsplash.aot; "
            "print(sorted(m for m in sys.modules if m.startswith(('ringsplash.model', 'ringsplash.train', 'optax'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_chip_table_facts():
    v5e = aot.chip("v5e:2x2")
    assert v5e == aot.chip("TPU v5 lite") == aot.chip("TPU v5e") == aot.chip("v5e")
    assert v5e.name == "v5e" and v5e.hbm_bytes == 16 * aot.GiB
    assert v5e.smem_bytes == 1 << 20 and v5e.vmem_bytes == 128 * aot.MiB  # pltpu's hardware table
    assert v5e.scoped_vmem_bytes == 16 * aot.MiB
    assert aot.chip("TPU v6 lite").hbm_bytes == 32 * aot.GiB and aot.chip("v6e:2x4").scoped_vmem_bytes == 32 * aot.MiB
    assert aot.chip("v5p:2x2x1").hbm_bytes == 95 * aot.GiB and aot.chip("TPU v5").name == "v5p"
    assert aot.chip("TPU7x").hbm_bytes == aot.chip("tpu7x:2x2x1").hbm_bytes == 96 * aot.GiB  # per JAX device
    assert aot.chip("v4:2x2x1").hbm_bytes == 32 * aot.GiB


def test_unknown_chip_is_none_or_a_clear_error():
    assert aot.find_chip("cpu") is None and aot.find_chip(None) is None
    with pytest.raises(ValueError, match=r"device_kind_or_topology='v9x:2x2' names no known TPU chip"):
        aot.chip("v9x:2x2")


def test_bad_topology_name_names_the_argument():
    with pytest.raises(ValueError, match=r"topology name='v9x:2x2': expected '<chip>:<shape>'"):
        aot.topology_devices("v9x:2x2")
    with pytest.raises(ValueError, match=r"topology name='v5e': expected"):
        aot.topology_mesh("v5e", ("x",))


@pytest.mark.tpu_compile
def test_topology_mesh_shape():
    assert aot.topology_devices("v5e:2x4").size == 8
    mesh = aot.topology_mesh("v5e:2x4", ("data", "context"), (2, 4))
    assert dict(mesh.shape) == {"data": 2, "context": 4}
    assert dict(aot.topology_mesh("v5e:2x2", "x").shape) == {"x": 4}
    assert mesh.devices.flat[0].device_kind == "TPU v5 lite"
    with pytest.raises(ValueError, match=r"shape=\(3, 4\) over axis_names=\('a', 'b'\) must multiply to the 8"):
        aot.topology_mesh("v5e:2x4", ("a", "b"), (3, 4))
    with pytest.raises(ValueError, match="shape is needed"):
        aot.topology_mesh("v5e:2x4", ("a", "b"))
    # slices smaller than libtpu's default 2x2 host: one chip (the machine benchmarks run on), two chips
    for name, size, kind in (("v5e:1x1", 1, "TPU v5 lite"), ("v5e:2x1", 2, "TPU v5 lite"), ("v6e:1x1", 1, "TPU v6 lite")):
        devices = aot.topology_devices(name)
        assert devices.size == size and devices[0].device_kind == kind, (name, devices)


@pytest.mark.tpu_compile
def test_compile_report_of_a_tiny_function_for_v5e():
    mesh = aot.topology_mesh("v5e:2x2", ("x",))
    x = aot.abstract((4, 256), jnp.float32, mesh, P("x"))
    assert x.sharding.spec == P("x") and x.shape == (4, 256)
    report = aot.compile_report(lambda x: jnp.tanh(x) * 2.0, x)
    assert report.fits and report.hbm == 16 * aot.GiB
    assert report.args == report.out == 256 * 4  # one row of 256 float32 per device
    assert report.total == report.args + report.out - report.alias + report.temp + report.code > 0
    assert "tanh" in report.hlo_text and report.seconds > 0
    assert report.fits_within(1e-9) is False
    donated = aot.compile_report(jax.jit(lambda x: x + 1.0, donate_argnums=0), x)
    assert donated.alias == 256 * 4 and "add" in donated.hlo_text
