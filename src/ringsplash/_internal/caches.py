"""The process-global caches of host work, cleared together by :func:`clear_caches`.

Host work that depends only on hashable values (mask metadata, ring plans, permutations, RoPE
tables, compiled steps) is cached per process. Each cache registers here where it is defined
(:func:`lru_cache` for a function, :func:`register` for a hand-made one), so one public call
empties them all: after editing a mask class in a notebook, to bound memory between
experiments, or between tests that count builds.
"""

import collections
import functools
import threading
from collections.abc import Callable, Hashable

__all__ = ["LRU", "clear_caches", "factories", "lru_cache", "register"]

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


class LRU:
    """A thread-safe least-recently-used map of at most ``maxsize`` entries, registered with
    :func:`clear_caches`. ``get(key, build)`` returns the entry of ``key``, calling ``build()``
    (outside the lock) on a miss; the least recently used entry goes when it is full."""

    def __init__(self, maxsize: int, name: str):
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"{name}: maxsize must be a positive int, got {maxsize!r}")
        self.maxsize, self.name = maxsize, name
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        register(self.clear)

    def get(self, key: Hashable, build: Callable[[], object]):
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = build()
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __repr__(self) -> str:
        return f"LRU({self.name!r}, {len(self)}/{self.maxsize})"


#: the one cache of host-work objects behind the functional entry points: the Splash and ring
#: factories' objects (``make_splash_attention``, ``make_ring_attention``) and the ring plans
factories = LRU(64, "ringsplash factories")


def clear_caches() -> None:
    """Empty every cache of ringsplash's host work in this process (mask metadata, ring plans,
    kernel operands, layouts, RoPE tables, traced training steps, ...). Results are unchanged;
    the next call rebuilds what it needs."""
    for clear in _CLEARERS:
        clear()
