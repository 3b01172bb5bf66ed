"""Optional dependencies: ``require`` imports one where it is needed, or raises one line naming
what needs it and the extra that installs it (never a ``ModuleNotFoundError`` from deep inside).

    tokenizers = require("tokenizers", extra="data", needed_for="a tokenizer.json tokenizer")

The extras are pyproject.toml's ``[project.optional-dependencies]``; ``extra=None`` names a core
dependency (``pip install -e .``), for an environment installed before it became one.
"""

import importlib
from types import ModuleType

#: pip's name where it differs from the module's
PIP_NAMES = {"lm_eval": "lm-eval"}


class MissingDependency(ImportError):
    """An optional package is not installed; the message says what needs it and how to install it."""


def install_hint(extra: str | None) -> str:
    """``pip install -e ".[extra]"`` (``pip install -e .`` for a core dependency)."""
    return 'pip install -e ".[' + extra + ']"' if extra else "pip install -e ."


def require(module: str, *, extra: str | None, needed_for: str) -> ModuleType:
    """``module`` imported, or ``MissingDependency`` (an ``ImportError``) when its package is not
    installed: ``<needed_for> needs <package>: pip install -e ".[<extra>]"``. An import error
    from inside an installed package (one of its own dependencies missing) is raised as it is."""
    top = module.split(".")[0]
    try:
        importlib.import_module(top)  # first: a cached submodule would be found even with its package gone
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise
        package = PIP_NAMES.get(top, top)
        raise MissingDependency(f"{needed_for} needs {package}: {install_hint(extra)}",
                                name=e.name) from None
