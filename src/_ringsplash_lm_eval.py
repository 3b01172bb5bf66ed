"""lm-eval's ``lm_eval --model ringsplash``: registers the ``lm_eval.models`` entry points of the
installed distributions (ringsplash's: ``ringsplash.evals.lm_eval_adapter:RingsplashLM``) with
lm-eval's model registry as soon as lm-eval fills it, in any process.

lm-eval up to 0.4.13 reads no entry points: its registry knows its built-in names only. So
ringsplash installs ``ringsplash-lm-eval.pth`` into site-packages (``setup.py``), which Python's
``site`` runs at start-up: it calls :func:`install`, which puts a finder on ``sys.meta_path`` that
waits for the module ``lm_eval.models`` (the registry's built-in names) and, once it has run,
registers the entry points (lazily: a name's module is imported when lm-eval asks for it), never
replacing a built-in name. Standard library only, nothing imported before ``lm_eval.models`` is,
and any failure leaves lm-eval as it was. Top-level (not in ``ringsplash``): importing the package
would start JAX in every Python process.
"""

import importlib.abc
import importlib.metadata as md
import sys

#: the entry-point group lm-eval's plugin discovery reads for model backends
ENTRY_POINT_GROUP = "lm_eval.models"
#: the module whose import fills lm-eval's model registry with its built-in names
REGISTRY_FILLER = "lm_eval.models"


def register_entry_points(model_registry) -> list[str]:
    """Register every installed ``ENTRY_POINT_GROUP`` entry point with ``model_registry`` (lazily;
    names already there are kept); the names registered."""
    added = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in model_registry:
            continue
        # "module:Class" (not the EntryPoint): the class's own @register_model then upgrades it in place
        target = ep.value if ep.attr and "." not in ep.attr and "[" not in ep.value else ep
        model_registry.register(ep.name, target=target)
        added.append(ep.name)
    return added


class _RegisteringLoader(importlib.abc.Loader):
    """``lm_eval.models``'s own loader, then :func:`register_entry_points`."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            from lm_eval.api.registry import model_registry

            register_entry_points(model_registry)
        except Exception as e:  # never break lm-eval: its own names still work
            print(f"ringsplash: lm-eval entry points not registered ({type(e).__name__}: {e})", file=sys.stderr)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the inner loader's
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``REGISTRY_FILLER`` with the other finders and wraps its loader (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != REGISTRY_FILLER:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Wait for ``lm_eval.models`` (a no-op when it is already imported or a finder is in place)."""
    if REGISTRY_FILLER in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


__all__ = ["ENTRY_POINT_GROUP", "install", "register_entry_points"]
