"""Ring attention compiled for real TPU topologies from a CPU host (libtpu, ``tpu`` extra).

Forward + backward of ``ring_attention_sharded`` with the Mosaic Splash kernels, bf16,
8 heads, d = 128, S = 32768, causal, zigzag, on ``v5e:2x2`` (4 chips) and ``v6e:2x4`` (8).
From the compiled, scheduled HLO: every ``collective-permute-start`` has a Splash kernel
(``tpu_custom_call``, or a loop / conditional / call holding one) scheduled before its
``collective-permute-done``, i.e. every K/V and dK/dV transfer overlaps a kernel. Per-device
temp memory must stay O(S/N): a small multiple of the local q shard, nowhere near S x S/N.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ringsplash import masks
from ringsplash.ring import ring_attention_sharded
from ringsplash.splash.config import SplashConfig

pytestmark = pytest.mark.tpu_compile

S, HEADS, D = 32768, 8, 128
TOPOLOGIES = {"v5e:2x2": 4, "v6e:2x4": 8}
#: temp bytes per device allowed, in units of the local q shard (bf16 [heads, S/N, d]): the
#: float32 output/dq/dK/dV accumulators, the visiting K/V and their in-flight copies
TEMP_LIMIT_IN_LOCAL_Q = 24


@functools.lru_cache(maxsize=None)
def compiled_ring(topology: str, layout: str = "zigzag"):
    topo = topologies.get_topology_desc(topology, "tpu")
    devices = np.asarray(topo.devices)
    mesh = Mesh(devices.reshape(devices.size), ("ctx",))
    mask = masks.CausalMask((S, S))
    config = SplashConfig(backend="mosaic_tpu")

    def fwd_bwd(q, k, v, d_out):
        fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout=layout,
                                                    config=config)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    spec = jax.ShapeDtypeStruct((HEADS, S, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "ctx")))
    compiled = jax.jit(fwd_bwd).lower(spec, spec, spec, spec).compile()
    return devices.size, compiled.as_text(), compiled.memory_analysis()


# ----------------------------------------------------------------------------------------
# scheduled-HLO parsing

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?([%\w.\-, ]+)\}?")


def parse_hlo(text: str):
    """{computation: [(name, opcode, line)]} in scheduled order."""
    comps, current = {}, None
    for line in text.splitlines():
        if m := _COMP.match(line):
            current = comps.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTR.match(line)):
            current.append((m.group(1), m.group(2), line))
    return comps


def holds_kernel(comps, line: str, seen=None) -> bool:
    """Whether an instruction is a Pallas TPU kernel or calls a computation that holds one."""
    if 'custom_call_target="tpu_custom_call"' in line:
        return True
    seen = set() if seen is None else seen
    for group in _CALLS.findall(line):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
            if callee in comps and callee not in seen:
                seen.add(callee)
                if any(holds_kernel(comps, l, seen) for _, _, l in comps[callee]):
                    return True
    return False


def permute_windows(text: str):
    """For every collective-permute-start: (computation, start, done, kernels scheduled between)."""
    comps = parse_hlo(text)
    windows = []
    for comp, instrs in comps.items():
        for i, (name, op, _) in enumerate(instrs):
            if op != "collective-permute-start":
                continue
            done = next(j for j, (_, op2, l) in enumerate(instrs)
                        if op2 == "collective-permute-done" and re.search(rf"\(%{re.escape(name)}\)", l))
            between = [n for n, _, l in instrs[i + 1 : done] if holds_kernel(comps, l)]
            windows.append((comp, name, instrs[done][0], between))
    return windows


# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topology, layout",
    # zigzag causal: every shard pair is active and XLA folds the skip-conds away;
    # contiguous causal: half the pairs are empty, so the kernels sit inside conditionals
    [("v5e:2x2", "zigzag"), ("v6e:2x4", "zigzag"), ("v5e:2x2", "contiguous")],
)
def test_ring_tpu_compile_overlaps_every_transfer_with_a_kernel(topology, layout):
    n, text, _ = compiled_ring(topology, layout)
    assert n == TOPOLOGIES[topology]
    windows = permute_windows(text)
    # forward: K, V per loop step; backward: K, V and dK, dV per loop step, plus the peeled
    # first step's K, V and the last step's dK, dV hops (XLA may fuse operands into one permute)
    assert len(windows) >= 4, f"expected the ring's collective permutes, found {windows}"
    bare = [(c, s, d) for c, s, d, kernels in windows if not kernels]
    assert not bare, f"collective permutes with no Splash kernel scheduled between start and done: {bare}"
    # one kernel per peeled step / loop body: forward (loop, last), dq and dK/dV (first, loop,
    # last) -- the last step's two conds must not run a kernel twice
    counts = {k: len(re.findall(rf"%{k}[.\d]* = .*custom-call", text)) for k in ("splash_forward", "splash_dq", "splash_dkv")}
    assert counts == {"splash_forward": 2, "splash_dq": 3, "splash_dkv": 3}, counts


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ring_tpu_compile_temp_memory_is_per_shard(topology, record_property):
    n, _, mem = compiled_ring(topology)
    local_q = HEADS * (S // n) * D * 2  # bf16 bytes of one device's q shard
    record_property("temp_bytes_per_device", mem.temp_size_in_bytes)
    print(f"{topology}: temp {mem.temp_size_in_bytes / 2**20:.0f} MiB per device "
          f"= {mem.temp_size_in_bytes / local_q:.1f} x local q ({local_q / 2**20:.0f} MiB)")
    assert mem.temp_size_in_bytes <= TEMP_LIMIT_IN_LOCAL_Q * local_q
