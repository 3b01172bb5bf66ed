"""``ringsplash.__version__``: the installed distribution's version, as pyproject.toml gives it."""

import pathlib
import re
import tomllib
from importlib import metadata

import ringsplash

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distributions_and_pyprojects():
    assert ringsplash.__version__ == metadata.version("ringsplash")
    assert re.fullmatch(r"\d+\.\d+\.\d+(\S*)", ringsplash.__version__)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == ringsplash.__version__
