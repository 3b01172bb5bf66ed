"""Smoke test of scripts/bench_data.py: both tables, on a few files and short rows (in this process;
the step's rate is given, not measured: fit fed by the loader is tested in test_data_train.py)."""

import importlib.util
import os

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_data.py")


def test_bench_data_prints_tokenize_and_loader_tables(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_data", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--seqs", "256", "--files", "6", "--repeats", "1", "--batches", "2", "--step-tokens-per-s", "1e4",
                      "--vocab", "300", "--workdir", str(tmp_path)])
    text = capsys.readouterr().out
    assert [r["tokenizer"] for r in out["tokenize"]] == ["bytes", "HF BPE 300"]
    assert [(r["seq_len"], r["packing"]) for r in out["loader"]] == [("256", "concat_split"), ("256", "best_fit")]
    for r in out["loader"]:
        assert float(r["loader tokens/s"]) > 0 and r["step tokens/s"] == "1e+04"
        assert f"| 256 | {r['packing']} | {r['loader tokens/s']} |" in text
    assert "| bytes |" in text and "MB/s" in text
