"""Tokenizers for the evaluations: raw bytes (vocabulary 256) or a Hugging Face ``tokenizer.json``
(the ``tokenizers`` package, ``pip install -e ".[hf]"``). Both read local files only."""

import os
from typing import Protocol, runtime_checkable

from ringsplash._internal.optional import require


@runtime_checkable
class Tokenizer(Protocol):
    """What the evaluations need: text ↔ token ids, without special tokens."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class BytesTokenizer:
    """UTF-8 bytes as tokens 0..255 (a model with ``vocab_size >= 256``)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer read from a local ``tokenizer.json``; no special tokens are added."""

    def __init__(self, path: str):
        tokenizers = require("tokenizers", extra="hf", needed_for=f"the tokenizer {path!r} (a tokenizer.json)")
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path!r} is not a Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"``, a ``tokenizer.json`` file, or a directory holding one (e.g. a Hugging Face model dir)."""
    if spec == "bytes":
        return BytesTokenizer()
    if not isinstance(spec, (str, os.PathLike)):  # None was a TypeError from os.stat
        raise TypeError(f"tokenizer must be 'bytes' or a path (a tokenizer.json file or a directory holding one), "
                        f"got {spec!r}")
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer={spec!r} must be 'bytes', a tokenizer.json file or a directory holding "
                                f"one; {path} does not exist")
    return HFTokenizer(path)


def symbol_token(tokenizer: Tokenizer, symbol: str) -> int:
    """The one token id of ``symbol`` on its own (e.g. a digit), for answers assembled symbol by symbol."""
    if isinstance(tokenizer, HFTokenizer):
        tid = tokenizer.token_to_id(symbol)
        if tid is not None:
            return tid
    ids = tokenizer.encode(symbol)
    if len(ids) != 1:
        raise ValueError(f"symbol {symbol!r} must be one token of the tokenizer, got {len(ids)} tokens {ids}")
    return ids[0]


__all__ = ["BytesTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "symbol_token"]
