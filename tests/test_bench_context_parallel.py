"""scripts/bench_context_parallel.py: the HLO collective counter and the failure summaries (no compile)."""

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_context_parallel", ROOT / "scripts" / "bench_context_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# an entry all-gather over 4 devices and a loop of 5 trips around an async collective permute
HLO = """\
%body (p: (s32[], bf16[4,128])) -> (s32[], bf16[4,128]) {
  %cp = (bf16[4,128]{1,0}, bf16[4,128]{1,0}, u32[], u32[]) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = bf16[4,128]{1,0} collective-permute-done(%cp)
}

%cond (p: (s32[], bf16[4,128])) -> pred[] {
  %c = s32[] constant(7)
}

ENTRY %main (a: bf16[4,128]) -> bf16[16,128] {
  %ag = bf16[16,128]{1,0} all-gather(%a), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  %w = (s32[], bf16[4,128]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_collective_bytes_counts_loops_and_async_pairs_once():
    bench = _bench()
    gather = 16 * 128 * 2 * 3 / 4  # the 3/4 of the gathered bf16[16,128] that crosses devices
    permute = 4 * 128 * 2  # one bf16[4,128] buffer per trip (the -done is not counted again)
    assert bench.collective_bytes(HLO, 4) == gather + 5 * permute
    # without a known trip count, the loop condition's constant bounds it
    assert bench.collective_bytes(HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}', ""), 4) == (
        gather + 7 * permute)


def test_short_reason_names_the_smem_wall():
    bench = _bench()
    a = ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Allocation (size=1049088) would exceed memory "
         "(size=1048576) :: #allocation6 [shape = 'u8[1049088]{0}', space=smem, size = 0x100200, scoped")
    assert bench.short_reason(a) == "no compile: SMEM wall, a 1024.5 KiB work-list buffer > 1024 KiB SMEM"
    b = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space smem. "
         "Used 1.00M of 1.00M smem. Exceeded smem capacity by 3.6K.")
    assert bench.short_reason(b) == "no compile: SMEM wall, 3.6K over the 1.00M SMEM"
    assert bench.short_reason("compile timed out after 600 s") == "compile timed out after 600 s"


def test_cached_timeout_is_retried_only_under_a_longer_timeout(tmp_path, monkeypatch):
    bench = _bench()
    cache = tmp_path / "cache.json"
    cache.write_text('{"ulysses 8 8 8": "compile timed out after 1500 s on this CPU host", "ring 8 8 1": "compile '
                     'failed: x"}')
    calls = []

    def run(cmd, **kw):
        calls.append(cmd[-4:])
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(subprocess, "run", run)
    assert bench.compile_row("ulysses", 8, 8, 8, 1500, str(cache)).endswith("after 1500 s on this CPU host")
    assert bench.compile_row("ring", 8, 8, 1, 9999, str(cache)) == "compile failed: x"
    assert not calls
    assert bench.compile_row("ulysses", 8, 8, 8, 3000, str(cache)) == "compile timed out after 3000 s on this CPU host"
    assert calls == [["ulysses", "8", "8", "8"]]
    assert "after 3000 s" in cache.read_text()
