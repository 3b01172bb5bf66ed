"""Needle prompts in token space: a key hidden in a haystack at a depth, a question, the answer.

A prompt of ``length`` tokens is ``prefix + haystack[:i] + needle + haystack[i:] + question``,
with the needle (``needle_before + key + needle_after``) starting at haystack token
``i = round(depth * haystack_len)``; the answer is the key. Keys are ``key_len`` symbols drawn
from ``alphabet`` (one token each, e.g. the ten digits), assembled token by token so the answer's
tokens are known exactly. Passkey retrieval and needle-in-a-haystack are two ``NeedleTask`` s.
"""

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_float, check_int, check_positive_int, plain_fields
from ringsplash.evals.haystack import Haystack
from ringsplash.evals.tokenizer import Tokenizer, symbol_token


@dataclasses.dataclass(frozen=True)
class NeedleTask:
    name: str
    prefix: tuple[int, ...]
    needle_before: tuple[int, ...]
    needle_after: tuple[int, ...]
    question: tuple[int, ...]
    alphabet: tuple[int, ...]  # the token of each key symbol
    symbols: tuple[str, ...]  # the text of each key symbol (generated text is matched against it)
    key_len: int
    decode: Callable[[Sequence[int]], str] = dataclasses.field(compare=False)

    def __post_init__(self):
        plain_fields(self)  # NumPy scalars as Python numbers; then key_len and every token id by name
        check_positive_int("key_len", self.key_len)  # 2.5 and True were taken (passkey_task(digits=...))
        for name in ("prefix", "needle_before", "needle_after", "question", "alphabet"):
            object.__setattr__(self, name, tuple(check_int(f"{name}[{i}]", as_scalar(t), minimum=0)
                                                 for i, t in enumerate(getattr(self, name))))
        if len(self.alphabet) < 2 or len(self.alphabet) != len(self.symbols):
            raise ValueError(f"alphabet ({len(self.alphabet)} tokens) needs >= 2 tokens and one symbol each "
                             f"(got {len(self.symbols)} symbols)")

    @property
    def overhead(self) -> int:
        """Prompt tokens that are not haystack."""
        return len(self.prefix) + len(self.needle_before) + self.key_len + len(self.needle_after) + len(self.question)

    @property
    def chance(self) -> float:
        """Per-symbol accuracy of a guess uniform over the alphabet."""
        return 1.0 / len(self.alphabet)

    def draw_key(self, rng: np.random.Generator) -> np.ndarray:
        """``key_len`` indices into the alphabet."""
        return rng.integers(0, len(self.alphabet), size=self.key_len)

    def key_tokens(self, key: np.ndarray) -> np.ndarray:
        return np.asarray(self.alphabet, np.int32)[key]

    def key_text(self, key: np.ndarray) -> str:
        return "".join(self.symbols[i] for i in key)

    def prompt(self, haystack: Haystack, length: int, depth: float, key: np.ndarray, offset: int = 0) -> np.ndarray:
        """int32 ``[length]``: the prompt with the needle at ``depth`` of the haystack part."""
        check_length_depth(self, length, depth)
        n = length - self.overhead
        hay = haystack.window(n, offset)
        i = round(float(depth) * n)
        needle = np.concatenate([self.needle_before, self.key_tokens(key), self.needle_after]).astype(np.int32)
        parts = [np.asarray(self.prefix, np.int32), hay[:i], needle, hay[i:], np.asarray(self.question, np.int32)]
        return np.concatenate(parts).astype(np.int32)


def check_length_depth(task: NeedleTask, length: int, depth: float) -> None:
    check_positive_int("length", as_scalar(length))  # 512.0 was an IndexError inside the haystack window
    if isinstance(depth, bool) or not isinstance(as_scalar(depth), (int, float)):
        check_float("depth", as_scalar(depth))  # a TypeError naming depth
    if not 0.0 <= float(depth) <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (0 = needle at the start of the haystack, 1 = at its end)")
    if int(length) < task.overhead:
        raise ValueError(f"length={length} does not fit the {task.name} prompt: its prefix, needle and question "
                         f"alone take {task.overhead} tokens")


def _text_task(name: str, tokenizer: Tokenizer, prefix: str, before: str, after: str, question: str,
               key_len: int) -> NeedleTask:
    enc = lambda s: tuple(tokenizer.encode(s)) if s else ()
    digits = tuple("0123456789")
    return NeedleTask(name=name, prefix=enc(prefix), needle_before=enc(before), needle_after=enc(after),
                      question=enc(question), alphabet=tuple(symbol_token(tokenizer, d) for d in digits),
                      symbols=digits, key_len=key_len, decode=tokenizer.decode)


def passkey_task(tokenizer: Tokenizer, digits: int = 5) -> NeedleTask:
    """Passkey retrieval (Mohtashami & Jaggi 2023): a ``digits``-digit pass key in filler text."""
    return _text_task(
        "passkey", tokenizer,
        "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
        "memorise it; you will be asked about it.\n",
        "\nThe pass key is ", ". Remember it. The pass key is the number just given.\n",
        "\nWhat is the pass key? The pass key is ", digits)


def niah_task(tokenizer: Tokenizer, digits: int = 7) -> NeedleTask:
    """Needle in a haystack: a "special magic number" sentence in a long text."""
    return _text_task(
        "niah", tokenizer, "A special magic number is hidden in the following text. Memorise it.\n",
        " One of the special magic numbers mentioned in this text is: ", ". ",
        "\nWhat is the special magic number mentioned in the text above? The special magic number is ", digits)


def token_passkey_task(key_token: int, separator: int, values: Sequence[int]) -> NeedleTask:
    """Passkey in the associative-recall vocabulary (``ringsplash.data.RecallTask``): the needle is
    ``key_token value`` in filler tokens, the question ``separator key_token``, the answer the value."""
    # token ids by name (int() truncated 1.5 to 1; -1 was kept)
    key_token = check_int("key_token", as_scalar(key_token), minimum=0)
    separator = check_int("separator", as_scalar(separator), minimum=0)
    values = tuple(check_int(f"values[{i}]", as_scalar(v), minimum=0) for i, v in enumerate(values))
    return NeedleTask(name="passkey", prefix=(), needle_before=(key_token,), needle_after=(),
                      question=(separator, key_token), alphabet=values,
                      symbols=tuple(f"<{v}>" for v in values), key_len=1,
                      decode=lambda ids: "".join(f"<{int(i)}>" for i in ids))


__all__ = ["NeedleTask", "check_length_depth", "niah_task", "passkey_task", "token_passkey_task"]
