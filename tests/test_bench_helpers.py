"""scripts/_bench.py: the child-process protocol and the table helpers the benchmarks share."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("_bench", ROOT / "scripts" / "_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHILD = """
import sys
sys.path.insert(0, {scripts!r})
from _bench import child_main

@child_main
def main(x):
    if x < 0:
        raise ValueError(f"bad {{x=}}")
    print("noise before the result")
    return {{"twice": 2 * x}}

main(int(sys.argv[1]))
"""


def test_run_child_reads_the_json_line_or_the_error_and_caches(tmp_path):
    bench = _bench()
    child = tmp_path / "child.py"
    child.write_text(CHILD.format(scripts=str(ROOT / "scripts")))
    cache = str(tmp_path / "cache.json")
    assert bench.run_child([child, 21], timeout=120) == {"twice": 42}
    assert bench.run_child([child, -1], timeout=120) == "compile failed: ValueError: bad x=-1"
    assert bench.run_child([child, 3], 120, cache) == {"twice": 6}
    child.write_text("raise SystemExit(3)")  # a cached row is not run again
    assert bench.run_child([child, 3], 120, cache) == {"twice": 6}
    assert bench.run_child([child, 4], 120, cache, label="row").startswith("row failed")


def test_formatting_helpers():
    bench = _bench()
    assert bench.fmt_tokens(32768) == "32K" and bench.fmt_tokens(1 << 22) == "4M"
    assert bench.fmt_bytes(3 << 29) == "1.50" and bench.fmt_bytes(5 << 20, "MiB", 0) == "5"
    assert bench.md_table([(1, "a"), {"n": 2, "name": "b"}], ["n:", "name"]) == (
        "| n | name |\n|---:|---|\n| 1 | a |\n| 2 | b |")
    seconds, times = bench.median_of(lambda: None, 3)
    assert len(times) == 3 and min(times) <= seconds <= max(times)
    assert bench.peak_rss_mib() > 0
