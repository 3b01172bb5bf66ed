"""Ring attention compiled for real TPU topologies from a CPU host (libtpu, ``tpu`` extra).

Forward + backward of ``ring_attention_sharded`` with the Mosaic Splash kernels, bf16,
8 heads, d = 128, S = 32768, causal, zigzag, on ``v5e:2x2`` (4 chips) and ``v6e:2x4`` (8).
From the compiled, scheduled HLO (``overlap_violations``, itself tested on crafted schedules):
no synchronous ``collective-permute``, and every ``collective-permute-start`` has a Splash
kernel call (a ``tpu_custom_call`` named ``splash_*``, or a loop / conditional branch / call
holding one) scheduled before its ``collective-permute-done``, i.e. every K/V and dK/dV
transfer overlaps a kernel. Per-device
temp memory must stay O(S/N): a small multiple of the local q shard, nowhere near S x S/N.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from ringsplash import aot, masks
from ringsplash.parallel.ring import ring_attention_sharded
from ringsplash.splash.config import SplashConfig

pytestmark = pytest.mark.tpu_compile

S, HEADS, D = 32768, 8, 128
TOPOLOGIES = {"v5e:2x2": 4, "v6e:2x4": 8}
#: temp bytes per device allowed, in units of the local q shard (bf16 [heads, S/N, d]): the
#: float32 output/dq/dK/dV accumulators, the visiting K/V and their in-flight copies
TEMP_LIMIT_IN_LOCAL_Q = 24


@functools.cache
def compiled_ring(topology: str, layout: str = "zigzag"):
    mesh = aot.topology_mesh(topology, ("ctx",))
    mask = masks.CausalMask((S, S))
    config = SplashConfig(backend="mosaic_tpu")

    def fwd_bwd(q, k, v, d_out):
        fn = lambda q, k, v: ring_attention_sharded(q, k, v, mask, mesh=mesh, axis_name="ctx", layout=layout,
                                                    config=config)
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    spec = aot.abstract((HEADS, S, D), jnp.bfloat16, mesh, P(None, "ctx"))
    report = aot.compile_report(fwd_bwd, spec, spec, spec, spec)
    return mesh.size, report.hlo_text, report


# ----------------------------------------------------------------------------------------
# scheduled-HLO check: pure functions over the text of ``compiled.as_text()``

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations|true_computation|false_computation)="
                    r"\{?([%\w.\-, ]+)\}?")
_KERNEL = re.compile(r'^\s+(?:ROOT )?%splash_\w+(?:\.\d+)? = .*\bcustom-call\(.*custom_call_target="tpu_custom_call"')


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
    """Whether an instruction is a Splash Mosaic kernel call (a ``tpu_custom_call`` named
    ``splash_*``) or calls a computation holding one (a loop body, a fusion, a conditional with
    a kernel in some branch; a conditional whose branches hold none does not count)."""
    if _KERNEL.match(line):
        return True
    seen = set() if seen is None else seen
    for group in _CALLS.findall(line):
        for callee in (c.strip().lstrip("%") for c in group.split(",")):
            if callee in comps and callee not in seen:
                seen.add(callee)
                if any(holds_kernel(comps, l, seen) for _, _, l in comps[callee]):
                    return True
    return False


def overlap_violations(text: str) -> list[str]:
    """Every way the schedule fails to hide a ring transfer behind a Splash kernel: no
    collective permute at all, a synchronous ``collective-permute``, a ``-start`` without its
    ``-done`` in the same computation, or a start/done window with no kernel scheduled inside."""
    comps = parse_hlo(text)
    problems, starts = [], 0
    for comp, instrs in comps.items():
        for i, (name, op, _) in enumerate(instrs):
            if op == "collective-permute":
                problems.append(f"synchronous collective-permute %{name} in %{comp}")
            if op != "collective-permute-start":
                continue
            starts += 1
            done = [j for j, (_, op2, l) in enumerate(instrs)
                    if op2 == "collective-permute-done" and re.search(rf"\(%{re.escape(name)}\)", l)]
            if not done:
                problems.append(f"%{name} in %{comp} has no collective-permute-done in the same computation")
            elif not any(holds_kernel(comps, l) for _, _, l in instrs[i + 1 : done[0]]):
                problems.append(f"no Splash kernel between %{name} and %{instrs[done[0]][0]} in %{comp}")
    if not starts:
        problems.append("no collective-permute-start: the ring's transfers are missing")
    return problems


def permute_windows(text: str):
    """For every collective-permute-start: (computation, start, done, kernels scheduled between);
    used where some windows may legitimately overlap other collectives instead (USP)."""
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


def count_permute_starts(text: str) -> int:
    return sum(op == "collective-permute-start" for instrs in parse_hlo(text).values() for _, op, _ in instrs)


# crafted schedules: the check must reject each bad one and accept the good ones
_KERNEL_LINE = ('  %splash_forward.3 = (f32[8,128,128]) custom-call(%q, %k), custom_call_target="tpu_custom_call", '
                'backend_config="x"')
_START = "  %collective-permute-start = (bf16[8,128,128], bf16[8,128,128]) collective-permute-start(%k), channel_id=1"
_DONE = "  %collective-permute-done = bf16[8,128,128] collective-permute-done(%collective-permute-start), metadata={}"
_SKIP_BRANCHES = """%skip (p: f32[8,128,128]) -> f32[8,128,128] {
  %p = f32[8,128,128] parameter(0)
  ROOT %copy.1 = f32[8,128,128] copy(%p)
}

%also_skip (p.1: f32[8,128,128]) -> f32[8,128,128] {
  ROOT %p.1 = f32[8,128,128] parameter(0)
}
"""
_KERNEL_BRANCH = f"""%run (p.2: f32[8,128,128]) -> f32[8,128,128] {{
{_KERNEL_LINE}
  ROOT %gte = f32[8,128,128] get-tuple-element(%splash_forward.3), index=0
}}
"""


def _entry(*body: str, prelude: str = "") -> str:
    return prelude + "\nENTRY %main (k: bf16[8,128,128]) -> bf16[8,128,128] {\n" + "\n".join(body) + "\n}\n"


_COND = "  %conditional.1 = f32[8,128,128] conditional(%pred, %x, %x), branch_computations={{%{}, %{}}}"
CRAFTED = {
    "kernel_in_window": (_entry(_START, _KERNEL_LINE, _DONE), True),
    "conditional_with_kernel_branch": (_entry(_START, _COND.format("run", "skip"), _DONE,
                                              prelude=_SKIP_BRANCHES + _KERNEL_BRANCH), True),
    "synchronous_permute": (_entry(_KERNEL_LINE, "  %collective-permute = bf16[8,128,128] "
                                   "collective-permute(%k), channel_id=1, source_target_pairs={{0,1},{1,0}}"), False),
    "kernel_outside_window": (_entry(_START, _DONE, _KERNEL_LINE), False),
    "only_skipped_conditional": (_entry(_START, _COND.format("skip", "also_skip"), _DONE, _KERNEL_LINE,
                                        prelude=_SKIP_BRANCHES), False),
    "other_custom_call_in_window": (_entry(_START, '  %custom-call.1 = bf16[8,128,128] custom-call(%k), '
                                           'custom_call_target="ConcatBitcast"', _DONE, _KERNEL_LINE), False),
    "start_without_done": (_entry(_START, _KERNEL_LINE), False),
    "no_permute": (_entry(_KERNEL_LINE), False),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_overlap_check_on_crafted_schedules(case):
    text, good = CRAFTED[case]
    problems = overlap_violations(text)
    assert (problems == []) == good, problems


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
    assert overlap_violations(text) == []
    # K and V travel separately: forward loop 2; backward loop 4 (K, V, dK, dV), peeled first
    # step 2 (K, V); dK and dV travel together into the last step (1) and on the final hop (1)
    assert count_permute_starts(text) == 10
    # one kernel per peeled step / loop body: forward (loop, last), dq and dK/dV (first, loop,
    # last) -- the last step's two conds must not run a kernel twice
    counts = {k: len(re.findall(rf"%{k}[.\d]* = .*custom-call", text)) for k in ("splash_forward", "splash_dq", "splash_dkv")}
    assert counts == {"splash_forward": 2, "splash_dq": 3, "splash_dkv": 3}, counts


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ring_tpu_compile_temp_memory_is_per_shard(topology, record_property):
    n, _, mem = compiled_ring(topology)
    local_q = HEADS * (S // n) * D * 2  # bf16 bytes of one device's q shard
    record_property("temp_bytes_per_device", mem.temp)
    print(f"{topology}: temp {mem.temp / 2**20:.0f} MiB per device "
          f"= {mem.temp / local_q:.1f} x local q ({local_q / 2**20:.0f} MiB)")
    assert mem.temp <= TEMP_LIMIT_IN_LOCAL_Q * local_q
