"""``docs/figures.json``: the headline figures the README and the docs state, as the benchmarks measured them.

The TPU benchmark scripts write the rows they measure here with ``--record`` (each figure with its date, commit,
device, versions and command); ``headlines`` lists the sentences and table cells of README.md and docs/*.md that
state a figure, as templates (``{section/key/field|format}``), and ``tests/test_figures.py`` checks that each file
says what the template gives. After a re-measurement, ``--record`` updates the figure and that test names every
sentence to rewrite.
"""

import datetime
import json
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures.json"
#: ``{section/key/field|format}``: a figure's field, formatted with ``format`` (``.2f``, ``,.0f``, ...)
TEMPLATE = re.compile(r"\{([^{}|]+)\|([^{}]*)\}")


def load(path: pathlib.Path = FIGURES) -> dict:
    return json.loads(path.read_text())


def derived(data: dict, section: str, field: str):
    """Figures of a whole section: ``rows`` (how many), ``min_ratio`` / ``max_ratio`` (of the faster peer over
    ringsplash, ``splash_tpu``)."""
    rows = data[section]
    if field == "rows":
        return len(rows)
    ratios = [r["faster_peer_over_ringsplash"] for r in rows.values()]
    return {"min_ratio": min, "max_ratio": max}[field](ratios)


def figure(data: dict, ref: str):
    """The value ``section/key/field`` names (``derived/section/field``: see ``derived``); a KeyError naming the
    reference when it is missing."""
    section, key, field = ref.split("/")
    if section == "derived":
        return derived(data, key, field)
    try:
        return data[section][key][field]
    except KeyError:
        raise KeyError(f"docs/figures.json has no {ref!r}") from None


def render(data: dict, text: str) -> str:
    """``text`` with every ``{section/key/field|format}`` replaced by that figure, formatted."""
    return TEMPLATE.sub(lambda m: format(figure(data, m[1]), m[2]), text)


def provenance(device_kind: str) -> dict:
    """Where a figure comes from: today's date (UTC), the checkout's commit, the device, the versions and the
    command line of this process."""
    import jax
    try:
        from importlib.metadata import version
        libtpu = version("libtpu")
    except Exception:
        libtpu = "?"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    script = pathlib.Path(sys.argv[0])
    script = script.relative_to(ROOT) if script.is_absolute() and ROOT in script.parents else script
    return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(), "commit": commit, "device": device_kind,
            "jax": jax.__version__, "libtpu": libtpu,
            "command": shlex.join(["python", str(script), *sys.argv[1:]])}


def record(section: str, key: str, values: dict, meta: dict, path: pathlib.Path = FIGURES) -> None:
    """Set figure ``section/key`` to ``values`` and ``meta`` (``provenance``), keeping every other entry."""
    data = load(path) if path.exists() else {"headlines": []}
    data.setdefault(section, {})[key] = {**values, **meta}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
