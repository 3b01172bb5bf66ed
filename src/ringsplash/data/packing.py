"""Packing documents into rows of ``seq_len`` tokens: a plan (which piece of which document goes
where, from the document lengths alone) and the rows it describes.

Policies (``PackingPolicy``):

* ``"concat_split"`` — documents one after another, cut at every row boundary: no padding
  except at the very end; a document crossing a boundary continues at the start of the next
  row as a new piece (positions restart at 0 there: it cannot see its first part).
* ``"first_fit"`` — each document (in order) goes whole into the first row with room for it.
* ``"best_fit"`` — each document goes whole into the row it fills most tightly (least room
  left; ties to the earliest row).

Under first / best fit a document longer than ``seq_len`` is handled by ``long_documents``:
``"split"`` cuts it into ``seq_len`` pieces (the remainder packed as a document),
``"truncate"`` keeps its first ``seq_len`` tokens, ``"error"`` raises.

Every piece is its own segment (ids 1, 2, … in a row; padding is 0, never scored); positions
count from 0 in each piece. The label of a token is the next token of the same document, so no
target crosses a document boundary: the last token of a document predicts nothing (loss mask 0);
the last token of a piece whose document continues in another piece predicts that piece's first
token (it is the document's next token).
"""

import bisect
from typing import Literal, NamedTuple

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_int
from ringsplash.data.batch import Batch

PackingPolicy = Literal["concat_split", "first_fit", "best_fit"]
LongDocuments = Literal["split", "truncate", "error"]
POLICIES = ("concat_split", "first_fit", "best_fit")
LONG_DOCUMENTS = ("split", "truncate", "error")


class PackPlan(NamedTuple):
    """Pieces ``row_start[r]:row_start[r + 1]`` make row ``r``; piece ``p`` is
    ``document[doc[p]][start[p] : start[p] + length[p]]``."""

    row_start: np.ndarray  # int64 [rows + 1]
    doc: np.ndarray  # int64 [pieces]
    start: np.ndarray  # int64 [pieces]
    length: np.ndarray  # int64 [pieces]

    @property
    def num_rows(self) -> int:
        return len(self.row_start) - 1


def _items(lengths: np.ndarray, order: np.ndarray, seq_len: int, long_documents: str):
    """(doc, start, length) of the pieces first / best fit place, long documents handled."""
    docs, starts, lens = [], [], []
    for d in order:
        n = int(lengths[d])
        if n <= seq_len:
            docs.append(d), starts.append(0), lens.append(n)
        elif long_documents == "error":
            raise ValueError(f"document {int(d)} has {n} tokens, more than {seq_len=}; pass "
                             "long_documents='split' or 'truncate', or a longer seq_len")
        elif long_documents == "truncate":
            docs.append(d), starts.append(0), lens.append(seq_len)
        else:
            for s in range(0, n, seq_len):
                docs.append(d), starts.append(s), lens.append(min(seq_len, n - s))
    return np.array(docs, np.int64), np.array(starts, np.int64), np.array(lens, np.int64)


def _first_fit(lens: np.ndarray, seq_len: int) -> np.ndarray:
    """The row of each item: the leftmost row with room (a max segment tree over the rows' room)."""
    size = 1
    while size < max(len(lens), 1):
        size *= 2
    tree = np.full(2 * size, seq_len, np.int64)
    rows = np.empty(len(lens), np.int64)
    for i, n in enumerate(lens.tolist()):
        node = 1
        while node < size:  # descend to the leftmost leaf with room >= n (an unused row always has)
            node = 2 * node if tree[2 * node] >= n else 2 * node + 1
        rows[i] = node - size
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return rows


def _best_fit(lens: np.ndarray, seq_len: int) -> np.ndarray:
    """The row of each item: the row with the least room that still fits it (ties: earliest row)."""
    open_rows: list[tuple[int, int]] = []  # (room, row), sorted
    rows = np.empty(len(lens), np.int64)
    count = 0
    for i, n in enumerate(lens.tolist()):
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, row = open_rows.pop(k)
        else:
            room, row, count = seq_len, count, count + 1
        rows[i] = row
        if room - n > 0:
            bisect.insort(open_rows, (room - n, row))
    return rows


def int_vector(name: str, x, *, minimum: int | None = None) -> np.ndarray:
    """``x`` as a 1-D ``int64`` array (empty too), refused by ``name`` when it is not 1-D, not integers or has an
    entry below ``minimum``: float token ids or lengths were truncated, negative lengths packed as given."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if minimum is not None and a.size and a.min() < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}[{int(np.argmin(a))}]={int(a.min())}")
    return a


def plan_packing(lengths: np.ndarray, seq_len: int, policy: PackingPolicy = "best_fit", *,
                 long_documents: LongDocuments = "split", order: np.ndarray | None = None) -> PackPlan:
    """The plan packing documents of ``lengths`` (taken in ``order``, default as given) into rows."""
    if policy not in POLICIES:
        raise ValueError(f"packing={policy!r} must be one of {POLICIES}")
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"long_documents={long_documents!r} must be one of {LONG_DOCUMENTS}")
    seq_len = check_int("seq_len", as_scalar(seq_len))  # "16" and 16.0 failed deeper
    if seq_len < 2:
        raise ValueError(f"{seq_len=} must be >= 2 (a token and its target)")
    lengths = int_vector("lengths", lengths, minimum=0)
    order = np.arange(len(lengths)) if order is None else int_vector("order", order, minimum=0)
    if order.size and order.max() >= len(lengths):  # was an IndexError inside the plan
        raise ValueError(f"order must index lengths (< {len(lengths)}), got {int(order.max())}")
    if policy == "concat_split":
        docs, starts, lens, rows = [], [], [], []
        row, col = 0, 0
        for d in order.tolist():
            s, n = 0, int(lengths[d])
            while s < n:
                k = min(n - s, seq_len - col)
                docs.append(d), starts.append(s), lens.append(k), rows.append(row)
                s, col = s + k, col + k
                if col == seq_len:
                    row, col = row + 1, 0
        doc, start, length, row_of = (np.array(x, np.int64) for x in (docs, starts, lens, rows))
    else:
        doc, start, length = _items(lengths, order, seq_len, long_documents)
        row_of = (_first_fit if policy == "first_fit" else _best_fit)(length, seq_len)
    by_row = np.argsort(row_of, kind="stable")  # pieces of a row in the order they were placed
    num_rows = int(row_of.max()) + 1 if len(row_of) else 0
    row_start = np.searchsorted(row_of[by_row], np.arange(num_rows + 1))
    return PackPlan(row_start.astype(np.int64), doc[by_row], start[by_row], length[by_row])


def pack_row(documents, lengths: np.ndarray, plan: PackPlan, row: int, seq_len: int, pad_id: int = 0) -> Batch:
    """Row ``row`` of ``plan`` as a ``Batch`` of 1-D ``[seq_len]`` fields; ``documents[d]`` gives
    the tokens of document ``d`` (a ``TokenizedCorpus`` or a list of arrays)."""
    tokens = np.full(seq_len, pad_id, np.int32)
    labels = np.zeros(seq_len, np.int32)
    mask = np.zeros(seq_len, np.float32)
    positions = np.zeros(seq_len, np.int32)
    segments = np.zeros(seq_len, np.int32)
    col = 0
    for seg, p in enumerate(range(plan.row_start[row], plan.row_start[row + 1]), start=1):
        d, s, n = int(plan.doc[p]), int(plan.start[p]), int(plan.length[p])
        full = documents[d]
        more = s + n < int(lengths[d])  # the document continues past this piece: its last token has a target
        piece = np.asarray(full[s : s + n + more], np.int32)
        tokens[col : col + n] = piece[:n]
        labels[col : col + n - 1 + more] = piece[1:]
        mask[col : col + n - 1 + more] = 1.0
        positions[col : col + n] = np.arange(n)
        segments[col : col + n] = seg
        col += n
    return Batch(tokens, labels, mask, positions, segments)
