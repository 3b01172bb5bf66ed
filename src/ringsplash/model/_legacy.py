"""The flat ``TransformerConfig`` spellings of the previous release, kept working for one release.

The six context-parallel fields became ``TransformerConfig.context_parallel`` (a ``ContextParallel``)
and the Hugging Face family options ``TransformerConfig.features`` (a ``ModelFeatures``). Passing or
reading an old name still works and warns (``DeprecationWarning``) with the new spelling; a config
dict in the old flat form (checkpoints and run directories written before) is read silently.
"""

import dataclasses
import warnings

from ringsplash.model.hf_features import FEATURE_NAMES, ModelFeatures
from ringsplash.model.parallelism import ContextParallel

#: old flat name -> ``ContextParallel`` field
PARALLEL_NAMES = {"attention": "strategy", "ring_axis_name": "ring_axis", "ring_size": "ring_size",
                  "ulysses_axis_name": "ulysses_axis", "ulysses_size": "ulysses_size", "ring_layout": "layout"}
OLD_NAMES = frozenset(PARALLEL_NAMES) | frozenset(FEATURE_NAMES)

__all__ = ["FEATURE_NAMES", "OLD_NAMES", "PARALLEL_NAMES", "nest", "nest_dict", "read_old"]


def _spelling(name: str) -> str:
    if name in PARALLEL_NAMES:
        return f"context_parallel.{PARALLEL_NAMES[name]}"
    return f"features.{name}"


def nest(kwargs: dict, *, warn: bool = True, stacklevel: int = 3) -> dict:
    """``kwargs`` of ``TransformerConfig(...)`` with old flat names folded into ``context_parallel`` /
    ``features`` (on top of those given); warns once per call naming the new spellings."""
    old = [k for k in kwargs if k in OLD_NAMES]
    if not old:
        return kwargs
    if warn:
        new = ", ".join(f"{k} -> {_spelling(k)}" for k in old)
        warnings.warn(f"TransformerConfig's flat fields {old} are deprecated and will be removed in the next "
                      f"release: use {new} (context_parallel=ContextParallel(...), features=ModelFeatures(...), "
                      f"or config.replace(context_parallel=config.context_parallel.replace(...)))",
                      DeprecationWarning, stacklevel=stacklevel)
    kwargs = dict(kwargs)
    parallel = {PARALLEL_NAMES[k]: kwargs.pop(k) for k in old if k in PARALLEL_NAMES}
    features = {k: kwargs.pop(k) for k in old if k in FEATURE_NAMES}
    if parallel:
        cp = kwargs.get("context_parallel", ContextParallel())
        if isinstance(cp, ContextParallel):
            for axis in ("ring_axis", "ulysses_axis"):
                if parallel.get(axis) == "":  # the old spelling of "no axis"
                    parallel[axis] = None
            kwargs["context_parallel"] = dataclasses.replace(cp, **parallel)
    if features:
        f = kwargs.get("features", ModelFeatures())
        if isinstance(f, ModelFeatures):
            kwargs["features"] = dataclasses.replace(f, **features)
    return kwargs


def nest_dict(d: dict) -> dict:
    """A ``TransformerConfig.to_dict`` dict of the previous release (flat) in today's nested form, as
    plain data (a run directory's config.json being compared on resumption); today's form unchanged."""
    if not any(k in d for k in OLD_NAMES):
        return d
    d = dict(d)
    cp = {PARALLEL_NAMES[k]: d.pop(k) for k in PARALLEL_NAMES if k in d}
    d["context_parallel"] = dataclasses.asdict(ContextParallel(**{**cp, **d.get("context_parallel", {})}))
    features = {k: d.pop(k) for k in FEATURE_NAMES if k in d}
    d["features"] = {**dataclasses.asdict(ModelFeatures()), **features, **d.get("features", {})}
    return d


def read_old(config, name: str):
    """``config.<old name>`` (warns with the new spelling)."""
    warnings.warn(f"TransformerConfig.{name} is deprecated and will be removed in the next release: "
                  f"read config.{_spelling(name)}", DeprecationWarning, stacklevel=3)
    if name in PARALLEL_NAMES:
        return getattr(config.context_parallel, PARALLEL_NAMES[name])
    return getattr(config.features, name)
