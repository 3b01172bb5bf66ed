"""Haystacks: the filler text of the retrieval evaluations, from any local text file or, by default,
from text the Python installation ships (no download): the English prose of the Python
documentation's pydoc topics (``pydoc_data.topics``, sorted by topic), then the standard
library's ``.py`` and ``.txt`` files in sorted order if more is asked for."""

import dataclasses
import os
import sysconfig

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_int, check_positive_int
from ringsplash.evals.tokenizer import Tokenizer


def default_text(max_chars: int = 2_000_000) -> str:
    """Deterministic local text: pydoc topics, then stdlib source files, up to ``max_chars``."""
    max_chars = check_positive_int("max_chars", as_scalar(max_chars))  # -1 cut the last character off
    parts, total = [], 0
    try:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            parts.append(topics[name])
            total += len(topics[name])
    except ImportError:  # pragma: no cover - some minimal Pythons strip pydoc_data
        pass
    stdlib = sysconfig.get_paths()["stdlib"]
    if total < max_chars and os.path.isdir(stdlib):
        for name in sorted(os.listdir(stdlib)):
            if total >= max_chars or not name.endswith((".py", ".txt")):
                continue
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            parts.append(text)
            total += len(text)
    return "\n\n".join(parts)[:max_chars]


def read_text(path: str | None = None, max_chars: int = 2_000_000) -> str:
    """The text of ``path`` (UTF-8), or :func:`default_text` when ``path`` is None."""
    if path is None:
        text = default_text(max_chars)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    if not text.strip():
        raise ValueError(f"haystack text must not be empty, got an empty text from {path or 'the default source'}")
    return text


@dataclasses.dataclass(frozen=True)
class Haystack:
    """A token stream cut into windows; a window longer than the stream wraps around (cyclic)."""

    tokens: np.ndarray  # int32 [n]

    def __post_init__(self):
        t = np.asarray(self.tokens)
        if t.ndim != 1 or t.size == 0:
            raise ValueError(f"haystack tokens must be a non-empty 1-D array, got shape {t.shape}")
        object.__setattr__(self, "tokens", t.astype(np.int32))

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer) -> "Haystack":
        if not text.strip():
            raise ValueError("haystack text must not be empty")
        return cls(np.asarray(tokenizer.encode(text), np.int32))

    def window(self, n: int, offset: int = 0) -> np.ndarray:
        """``n`` tokens starting at ``offset`` (mod the stream's length), wrapping around."""
        n = check_int("n", as_scalar(n), minimum=0)  # -5 gave no tokens, 10.0 an IndexError
        idx = (check_int("offset", as_scalar(offset)) + np.arange(n)) % self.tokens.size
        return self.tokens[idx]


__all__ = ["Haystack", "default_text", "read_text"]
