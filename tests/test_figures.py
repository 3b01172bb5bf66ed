"""docs/figures.json: the headline figures README.md and docs/*.md state are the ones the benchmarks recorded.

The TPU benchmarks write their rows into docs/figures.json with ``--record`` (scripts/_figures.py). Every
``headlines`` template of that file, filled in with the recorded figures, must appear in each file it names;
README.md's headline paragraph (between ``<!-- figures: begin -->`` and ``<!-- figures: end -->``) is exactly its
headlines, in order; and docs/tpu.md's kernel table has one row per recorded kernel figure, as recorded. A
re-measurement recorded with ``--record`` therefore fails here until the docs say the new figure.
"""

import importlib.util
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _module("_figures")


def _flat(text: str) -> str:
    """Markdown as a reader sees it: line breaks and runs of spaces are one space."""
    return " ".join(text.split())


def test_every_headline_is_stated_as_recorded():
    data = figures.load()
    missing = []
    for headline in data["headlines"]:
        stated = _flat(figures.render(data, headline["text"]))
        for name in headline["in"]:
            if stated not in _flat((ROOT / name).read_text()):
                missing.append(f"{name}: {stated!r}")
    assert not missing, "not stated as recorded in docs/figures.json:\n" + "\n".join(missing)


def test_readme_headline_paragraph_is_its_headlines():
    """Every figure of README's headline paragraph comes from docs/figures.json, none typed in by hand."""
    data = figures.load()
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- figures: begin -->(.*?)<!-- figures: end -->", readme, flags=re.S)
    assert block, "README.md: no <!-- figures: begin --> ... <!-- figures: end --> paragraph"
    ours = [figures.render(data, h["text"]) for h in data["headlines"] if "README.md" in h["in"]]
    assert _flat(block[1]) == _flat(" ".join(ours))


def test_tpu_kernel_table_rows_are_the_recorded_rows():
    data = figures.load()
    text = (ROOT / "docs" / "tpu.md").read_text()
    table = text.split("<!-- figures: splash_tpu")[1].split("\n\n")[0]
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row ")]
    assert len(lines) == len(data["splash_tpu"])
    for spec, row in data["splash_tpu"].items():
        cells = [row["label"]] + [f"{row[f'{impl}_ms']:.2f} ({row[f'{impl}_tflops']:.0f})"
                                  for impl in ("ringsplash", "jax", "tokamax")]
        stated = "| " + " | ".join([*cells, f"{row['faster_peer_over_ringsplash']:.2f}"]) + " |"
        assert any(line.startswith(stated) for line in lines), (spec, stated)


def test_every_figure_names_where_it_comes_from():
    data = figures.load()
    for section in ("splash_tpu", "train_tpu", "inference_tpu", "main_job_tpu", "context_parallel_tpu", "generate_tpu"):
        for key, row in data[section].items():
            for field in ("date", "commit", "device", "jax", "libtpu", "command"):
                assert row.get(field), f"docs/figures.json {section}/{key}: no {field}"
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), (section, key, row["date"])


def test_record_keeps_other_figures_and_headlines(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"headlines": [{"text": "{s/a/x|.1f} ms", "in": ["README.md"]}],
                                "s": {"b": {"x": 2.0}}}))
    figures.record("s", "a", {"x": 1.25}, {"date": "2026-12-07", "commit": "abc1234"}, path=path)
    data = figures.load(path)
    assert data["s"] == {"b": {"x": 2.0}, "a": {"x": 1.25, "date": "2026-12-07", "commit": "abc1234"}}
    assert figures.render(data, data["headlines"][0]["text"]) == "1.2 ms"
    with pytest.raises(KeyError, match="'s/c/x'"):
        figures.render(data, "{s/c/x|}")


def test_bench_splash_row_spec_parses_back_to_the_row():
    """``--record`` keys a kernel row by its ``--rows`` spelling, so the row it names is the row measured."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        bench = _module("bench_splash_tpu")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for row in bench.default_rows():
        assert bench.parse_rows(row.spec) == [row]
    assert set(figures.load()["splash_tpu"]) <= {row.spec for row in bench.default_rows()} | {"docs:65536:fwd"}
