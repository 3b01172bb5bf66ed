"""The process-global caches of host work, cleared together by :func:`clear_caches`.

Host work that depends only on hashable values (mask metadata, ring plans, permutations, RoPE
tables, compiled steps) is cached per process. Each cache registers here where it is defined
(:func:`lru_cache` for a function, :func:`register` for a hand-made one), so one public call
empties them all: after editing a mask class in a notebook, to bound memory between
experiments, or between tests that count builds.
"""

import functools
from collections.abc import Callable

__all__ = ["clear_caches", "lru_cache", "register"]

_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Register ``clear`` (a no-argument function emptying one cache); returns it."""
    _CLEARERS.append(clear)
    return clear


def lru_cache(maxsize: int | None):
    """``functools.lru_cache(maxsize)`` whose cache :func:`clear_caches` empties."""

    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        register(cached.cache_clear)
        return cached

    return wrap


def clear_caches() -> None:
    """Empty every cache of ringsplash's host work in this process (mask metadata, ring plans,
    kernel operands, layouts, RoPE tables, traced training steps, ...). Results are unchanged;
    the next call rebuilds what it needs."""
    for clear in _CLEARERS:
        clear()
