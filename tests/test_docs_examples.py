"""Every ```python block of README.md and docs/*.md runs: a file's blocks in order, sharing one namespace,
in a fresh interpreter started in a temporary directory (README.md's blocks each alone, as its tour promises).

A block that cannot run on a CPU laptop in seconds (a TPU, several hosts, a download, minutes of training) is
marked in the markdown, visibly, by an HTML comment on the line before its fence::

    <!-- not run: the reason -->

and a file whose blocks each run in a fresh interpreter says so once, anywhere in it::

    <!-- docs examples: each block alone -->

A file whose ```bash blocks run too, in the page's order with its python blocks (``python`` is this
interpreter; ``scripts/`` is the repository's), says::

    <!-- docs examples: shell blocks run too -->

Every other block runs; one that raises fails its file's test, pointing at the markdown's own line (the
blocks are compiled with the markdown's file name and line numbers).

On a TPU machine the same blocks run on the chip: ``RINGSPLASH_DOCS_PLATFORM=tpu python -m pytest -n 0
tests/test_docs_examples.py`` (pytest itself stays on the CPU; each file's interpreter takes the chip in turn).
"""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import FAKED_TPU_ENV
from support.processes import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
EACH_ALONE = "<!-- docs examples: each block alone -->"
WITH_SHELL = "<!-- docs examples: shell blocks run too -->"
#: a ```bash block as python: the block run by bash -e, ``python`` being this interpreter
SHELL = "import subprocess; subprocess.run(['bash', '-ec', {script!r}], check=True)\n"
TIMEOUT_S = 600  # generous for a loaded 2-core machine; a file's blocks take ~10-60 s of CPU
#: the platform the blocks run on (``tpu`` on a TPU machine: the module docstring)
PLATFORM = os.environ.get("RINGSPLASH_DOCS_PLATFORM", "cpu")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the block's first code line
    code: str
    not_run: str | None  # the reason, for a block marked not run


def python_blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a markdown file, each with the reason it is not run (or None)."""
    text = path.read_text()
    lines = text.splitlines()
    fences = ("```python", "```bash") if WITH_SHELL in text else ("```python",)
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() in fences:
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            assert j < len(lines), f"{path}:{i + 1}: a ```python block without its closing fence"
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mark = NOT_RUN.match(lines[k].strip()) if k >= 0 else None
            code = textwrap.dedent("\n".join(lines[i + 1:j]) + "\n")  # a block in a list item is indented
            if lines[i].strip() == "```bash":
                code = SHELL.format(script=f'python() {{ "{sys.executable}" "$@"; }}\n' + code)
            blocks.append(Block(path, i + 2, code, mark and mark["reason"]))
            i = j
        i += 1
    return blocks


#: runs the blocks in a JSON file (argv[1]) in order in one namespace; each compiled with its markdown
#: file name and line numbers, so a traceback points into the markdown
RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    print(f"--- running {b['path']}:{b['line']}", flush=True)
    exec(compile("\\n" * (b["line"] - 1) + b["code"], b["path"], "exec"), ns)
"""


def run_blocks(blocks: list[Block], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``blocks`` in order in a fresh interpreter started in ``cwd`` (one namespace)."""
    if not (cwd / "scripts").exists():
        (cwd / "scripts").symlink_to(ROOT / "scripts")  # shell blocks run the repository's scripts
    spec = cwd / ".docs_blocks.json"
    spec.write_text(json.dumps([{"path": str(b.path), "line": b.line, "code": b.code} for b in blocks]))
    env = child_env(JAX_PLATFORMS=PLATFORM)
    if PLATFORM != "cpu":  # the chip's own metadata, not this process's stand-ins
        for name in FAKED_TPU_ENV:
            env.pop(name, None)
    return subprocess.run([sys.executable, "-c", RUNNER, str(spec)], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


def _failure(proc: subprocess.CompletedProcess, blocks: list[Block]) -> str:
    shown = "\n".join(f"--- {b.path.name}:{b.line}\n{b.code}" for b in blocks)
    return (f"the blocks exited {proc.returncode}\n{shown}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}")


def _cases() -> list:
    """One case per file (its runnable blocks together), or per block where the file says each runs alone."""
    cases = []
    for path in DOCS:
        run = [b for b in python_blocks(path) if b.not_run is None]
        name = path.relative_to(ROOT).as_posix()
        if EACH_ALONE in path.read_text():
            cases += [pytest.param([b], id=f"{name}:{b.line}") for b in run]
        elif run:
            cases.append(pytest.param(run, id=name))
    return cases


@pytest.mark.e2e
@pytest.mark.parametrize("blocks", _cases())
def test_docs_python_blocks_run(blocks, tmp_path):
    proc = run_blocks(blocks, tmp_path)
    assert proc.returncode == 0, _failure(proc, blocks)


def test_docs_blocks_found_and_marks_give_reasons():
    """The tour and the guides with code have blocks that run (evals.md's all train or need a trained model);
    a marked block gives its reason; no marker is
    misspelt (one the parser would not honour would leave its block to fail, but say why here)."""
    by_file = {p.name: python_blocks(p) for p in DOCS}
    assert len(by_file["README.md"]) >= 2 and EACH_ALONE in (ROOT / "README.md").read_text()
    for name in ("hf.md", "inference.md", "data.md", "INTERNALS.md"):
        assert any(b.not_run is None for b in by_file[name]), f"docs/{name}: no block runs"
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^<!--\s*not[ _-]?run", line.strip(), flags=re.I):
                assert NOT_RUN.match(line.strip()), f"{path}:{n}: write the marker as <!-- not run: reason -->"


def test_docs_runner_fails_on_an_unmarked_block_and_skips_a_marked_one(tmp_path):
    md = tmp_path / "guide.md"
    md.write_text("# guide\n\n```python\nx = 1\n```\n\n<!-- not run: needs a TPU -->\n```python\nraise SystemExit(3)\n"
                  "```\n\n```python\nassert x == 1  # the namespace is shared\nraise ValueError('outdated')\n```\n")
    blocks = python_blocks(md)
    assert [(b.line, b.not_run) for b in blocks] == [(4, None), (9, "needs a TPU"), (13, None)]
    proc = run_blocks([b for b in blocks if b.not_run is None], tmp_path)
    assert proc.returncode == 1 and "ValueError: outdated" in proc.stderr
    assert f'File "{md}", line 14' in proc.stderr  # the markdown's own line
    assert run_blocks(blocks[:1], tmp_path).returncode == 0
