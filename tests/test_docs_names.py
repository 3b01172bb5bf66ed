"""Every file path and every ringsplash name the docs cite exists, as cited.

README.md, CHANGELOG.md and docs/*.md name files (`splash/tuning.py`, `tests/test_x.py::test_y`) and code
(`rs.inference.generate`, `kernel_backward.DqAccumulator`, `build_mask_info(mask, block_shape, *, ...)`) in
inline code. A path must exist (from the repository root, `src/`, `src/ringsplash/` or `docs/`, as the page writes
it), a `file.py::test` must name a test defined there, a dotted name whose first part is ringsplash (`rs`,
`ringsplash`) or one of its modules must resolve to an attribute, and a cited signature must be the function's: the
keywords it names exist, and one written whole (with `*`) lists every parameter in order.
"""

import ast
import functools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ringsplash"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"`([^`]+)`")
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+\.(?:py|md|json|toml|yml|png)(?:::[\w\[\]-]+)?$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(.*\))?$")
CALL = re.compile(r"^[A-Za-z_]\w*\(.*\)$")  # a bare call: checked when ringsplash exports the name
FILE_NAME = re.compile(r"\.(?:py|md|json|jsonl|toml|yml|png|npy|safetensors|txt|pth)$")
#: first parts of dotted names that the docs use for a value (``config.max_seq_len``, ``model.with_config``),
#: not for the ringsplash module of that name
VALUES = {"config", "model", "loader", "source", "state", "metrics", "cache", "info", "mesh", "batch", "stream",
          "task", "tc", "mask", "m", "args", "self", "row", "out", "result", "manifest", "corpus", "hf"}


@functools.cache
def _module_file(module: str) -> pathlib.Path | None:
    """The source file of ``ringsplash.a.b`` (a module or a package's ``__init__``), from the files alone."""
    parts = module.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


@functools.cache
def _suffixes() -> dict[str, str]:
    """Every ringsplash module by each dotted suffix of its name (``tuning``, ``splash.tuning``): the shortest."""
    by_suffix: dict[str, str] = {}
    for file in PACKAGE.rglob("*.py"):
        parts = ["ringsplash", *file.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        for i in range(1, len(parts)):
            suffix = ".".join(parts[i:])
            if suffix not in by_suffix or len(parts) < by_suffix[suffix].count(".") + 1:
                by_suffix[suffix] = ".".join(parts)
    return by_suffix


@functools.cache
def _names(file: pathlib.Path) -> dict[str, ast.AST | str]:
    """Top-level names of a source file: their definition, or the module they are imported from."""
    names: dict[str, ast.AST | str] = {}
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(n, ast.Name):  # not `f.cache_clear = ...`, which binds no name
                        names[n.id] = node
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.If | ast.Try):  # optional imports and definitions
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    names.setdefault(sub.name, sub)
                elif isinstance(sub, ast.Assign):
                    names.update({n.id: sub for n in sub.targets if isinstance(n, ast.Name)})
    return names


def _lookup(module: str, attrs: list[str]):
    """The definition ``module.attrs[0].attrs[1]...`` names, following imports inside ringsplash; ``...`` for one
    outside it or a value the source cannot show; raises AttributeError naming what is missing."""
    if not attrs:
        return ...
    file = _module_file(module)
    if file is None:
        return ...
    found = _names(file).get(attrs[0])  # a name the package binds wins over its submodule of that name
    if found is None and _module_file(f"{module}.{attrs[0]}"):
        return _lookup(f"{module}.{attrs[0]}", attrs[1:])
    if found is None:
        raise AttributeError(f"{module}.{attrs[0]} does not exist")
    if isinstance(found, str):  # imported: follow it if it is ringsplash's
        if not found.startswith("ringsplash"):
            return ...
        if _module_file(found):
            return _lookup(found, attrs[1:])
        source, _, name = found.rpartition(".")
        return _lookup(source, [name, *attrs[1:]])
    for attr in attrs[1:]:
        if not isinstance(found, ast.ClassDef):
            return ...
        members = {n.name: n for n in found.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        members |= {t.id: n for n in found.body if isinstance(n, ast.Assign | ast.AnnAssign)
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        if attr not in members:
            if found.bases:  # inherited, or a NamedTuple / dataclass field: not followed
                return ...
            raise AttributeError(f"{module}.{'.'.join(attrs[:attrs.index(attr) + 1])} does not exist")
        found = members[attr]
    return found


def _resolve(name: str):
    """The definition a dotted ringsplash name names (``...`` when it cannot be seen in the source); None when
    its first part is not ringsplash's."""
    parts = name.split(".")
    if parts[0] in ("rs", "ringsplash"):
        return _lookup("ringsplash", parts[1:])
    if parts[0] in VALUES or FILE_NAME.search(name):
        return None
    for i in range(len(parts) - 1, 0, -1):
        if (module := _suffixes().get(".".join(parts[:i]))) is not None:
            return _lookup(module, parts[i:])
    return None


def _signature_problem(node, args: str) -> str | None:
    if isinstance(node, ast.ClassDef):
        node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    a = node.args
    params = [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg not in ("self", "cls")]
    cited = [c.strip() for c in args.split(",") if c.strip()]
    if "*" in cited and "..." not in cited:  # the whole signature
        named = [c.split("=")[0].strip() for c in cited if c != "*" and not c.startswith("**")]
        if named != params:
            return f"cited whole as ({', '.join(named)}), the function takes ({', '.join(params)})"
        return None
    keywords = [c.split("=")[0].strip() for c in cited if re.fullmatch(r"\w+\s*=.*", c)]
    unknown = [k for k in keywords if k not in params]
    if unknown and a.kwarg is None:
        return f"no parameter {unknown}"
    return None


def _path_problem(page: pathlib.Path, path: str, root: pathlib.Path) -> str | None:
    """None when ``path`` (``file`` or ``file::test``) exists; else what is missing."""
    file, _, test = path.partition("::")
    bases = [root, root / "src", root / "src" / "ringsplash", page.parent]
    found = next((base / file for base in bases if (base / file).exists()), None)
    if found is None:
        return f"no file {file}"
    if test and not re.search(rf"^(?:async )?def {re.escape(test.split('[')[0])}\(", found.read_text(), flags=re.M):
        return f"{file} defines no {test}"
    return None


def _spans(page: pathlib.Path) -> list[tuple[int, str]]:
    """Inline code outside fenced blocks, with its line."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), page.read_text(), flags=re.S | re.M)
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m[1].split())) for m in SPAN.finditer(text)]


def _problems(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    problems = []
    for line, span in _spans(page):
        where = f"{page.name}:{line}: `{span}`"
        if PATH.match(span):
            if span.split("/")[0].isupper():  # a placeholder: DIR/job_config.json
                continue
            if (why := _path_problem(page, span, root)) is not None:
                problems.append(f"{where}: {why}")
        elif DOTTED.match(span) or (CALL.match(span) and span.partition("(")[0] in _names(PACKAGE / "__init__.py")):
            name, _, args = span.partition("(")
            name = name if "." in name else f"rs.{name}"
            try:
                node = _resolve(name)
            except AttributeError as e:
                problems.append(f"{where}: {e}")
                continue
            if node not in (None, ...) and args and (why := _signature_problem(node, args.rstrip(")"))):
                problems.append(f"{where}: {why}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_cite_paths_and_names_that_exist(page):
    problems = _problems(page)
    assert not problems, "\n".join(problems)


def test_docs_name_check_catches_a_stale_name_path_and_signature(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`kernel_backward._DqAccumulator` `splash/nowhere.py` `rs.build_mask_info(mask, block_shape, *, "
                    "q_shards=1)` `tests/test_figures.py::test_gone` `rs.inference.generate(model, p, bucket=False)` "
                    "`splash/tuning.py` `jax.nn.dot_product_attention` `rs.inference.generate(model, p, bucketed=1)`"
                    "\n```\n`splash/in_a_fence.py`\n```\n")
    problems = "\n".join(_problems(page))
    assert "ringsplash.splash.kernel_backward._DqAccumulator does not exist" in problems
    assert "no file splash/nowhere.py" in problems
    assert "cited whole as (mask, block_shape, q_shards)" in problems
    assert "defines no test_gone" in problems
    assert "no parameter ['bucketed']" in problems and "bucket=False" not in problems
    assert "tuning.py" not in problems and "jax.nn" not in problems and "in_a_fence" not in problems
