"""The import graph of ``src/ringsplash`` follows DESIGN.md's layers: imports point one way only
(never from a lower layer to a higher one) and no module imports itself back through others."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

#: layer of each top-level unit (a module, or a subpackage as a whole); imports go to the same
#: layer's unit itself or to a lower layer
LAYERS = {
    "_internal.types": 0, "_internal.caches": 0, "_internal.scalar_checks": 0, "_internal.softmax": 0,
    "_internal.shard_map": 0, "_internal.optional": 0, "aot": 0,
    "layouts": 1, "cli": 1,
    "masks": 2,
    "_internal.checks": 3,
    "reference": 4, "distributed": 4,
    "blocksparse": 5,
    "splash": 6,
    "parallel": 7,
    "model": 8, "partitioning": 8, "data": 8, "checkpoints": 8,
    "train": 9, "hf": 9,
    "inference": 10,
    "evals": 11,
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in (SRC / "ringsplash").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the ringsplash modules it imports (``from ringsplash import masks`` counts as
    ``ringsplash.masks``; the package itself only when a name is taken from its __init__)."""
    edges = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ringsplash":
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                found.update(subs or [node.module])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in mods)
        edges[name] = found - {name}
    return edges


def _unit(module: str) -> str | None:
    """A top-level module or subpackage; each module of the private helper package ``_internal`` is a unit
    of its own (its helpers sit at different layers: ``checks`` above ``masks``, the rest below)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "_internal":
        return f"_internal.{parts[2]}"
    return parts[1] if len(parts) > 1 and module != "ringsplash._internal" else None


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {None}
    assert units <= set(LAYERS), f"modules without a layer in this test: {sorted(units - set(LAYERS))}"


def test_imports_point_down_the_layers():
    bad = []
    for module, targets in _imports(_modules()).items():
        unit = _unit(module)
        if unit is None:  # the package __init__ re-exports the public API: it may import anything
            continue
        for target in targets:
            other = _unit(target)
            if other is None:
                bad.append(f"{module} imports the package root (import the submodule instead)")
            elif other != unit and LAYERS[other] >= LAYERS[unit]:
                bad.append(f"{module} (layer {LAYERS[unit]}) imports {target} (layer {LAYERS[other]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = _imports(_modules())
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if nxt == "ringsplash":
                continue
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, node, nxt]))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(edges):
        if module != "ringsplash" and module not in state:
            visit(module, [])


def test_clear_caches_empties_every_registered_cache():
    """``ringsplash.clear_caches()`` is the one public way to drop host work: after it, the mask
    metadata, ring plans and layouts are rebuilt (new objects), and no cache still holds entries."""
    import ringsplash as rs
    from ringsplash import layouts, masks
    from ringsplash._internal import caches as _caches
    from ringsplash.blocksparse import mask_info
    from ringsplash.parallel.ring_plan import ring_plan

    mask = masks.CausalMask((512, 512))
    info = rs.build_mask_info(mask, (128, 128))
    plan = ring_plan(mask, 2, "zigzag", rs.SplashConfig(block_q=128, block_kv=128, backend="xla"))
    perm = layouts.permutation("zigzag", 512, 2)
    assert rs.build_mask_info(mask, (128, 128)) is info and len(mask_info._CACHE) > 0
    rs.clear_caches()
    assert len(mask_info._CACHE) == 0
    lru = [c.__self__ for c in _caches._CLEARERS if hasattr(getattr(c, "__self__", None), "cache_info")]
    assert len(lru) >= 1 and all(f.cache_info().currsize == 0 for f in lru)  # layouts at least
    assert len(_caches.factories) == 0  # ring plans, Splash and ring factory objects
    assert rs.build_mask_info(mask, (128, 128)) is not info
    assert ring_plan(mask, 2, "zigzag", rs.SplashConfig(block_q=128, block_kv=128, backend="xla")) is not plan
    assert layouts.permutation("zigzag", 512, 2) is not perm


#: DESIGN.md's "must not" column for units of the same or neighbouring layers, which the layer
#: numbers alone do not forbid (data, model, partitioning and checkpoints share layer 8)
MUST_NOT = {
    "data": {"model", "splash", "parallel", "train"},
    "partitioning": {"masks", "splash", "parallel", "model"},
    "splash": {"parallel", "model"},
    "inference": {"train", "evals"},
    "model": {"train", "data"},
    "hf": {"train", "inference", "evals"},
    "checkpoints": {"model", "data", "splash", "parallel"},
}


def test_design_must_not_imports():
    bad = []
    for module, targets in _imports(_modules()).items():
        unit = _unit(module)
        for target in targets:
            if _unit(target) in MUST_NOT.get(unit, ()):
                bad.append(f"{module} imports {target} ({unit} must not depend on {_unit(target)})")
    assert not bad, "\n".join(bad)


def test_the_package_root_holds_public_modules_and_one_private_package_and_no_file_exceeds_450_lines():
    """The house rules of the structure review: concepts live in packages, files stay small; the package root
    holds public modules only, the private helpers one package (``_internal``), grouped by what they are for."""
    root = [p.name for p in (SRC / "ringsplash").glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= 12 and not [r for r in root if r.startswith("_")], sorted(root)
    private = [p.name for p in (SRC / "ringsplash").iterdir() if p.is_dir() and p.name.startswith("_")
               and p.name != "__pycache__"]
    assert private == ["_internal"], private
    long = {str(p.relative_to(SRC)): n for p in (SRC / "ringsplash").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
