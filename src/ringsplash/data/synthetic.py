"""Synthetic data, host side (numpy): the recall task and packing of in-memory documents.

* :func:`recall_batch` — multi-query associative recall: key–value pairs scattered through
  filler noise, then a separator and queries (``key -> value``) at the end. The model must
  find each queried key far back in the context and copy the value that followed it.
* :func:`pack_documents` — pack variable-length documents into fixed-length rows with segment
  ids (attention never crosses documents), per-document positions and a loss mask that never
  predicts across a document boundary.

Both return a :class:`~ringsplash.data.batch.Batch`; :class:`~ringsplash.data.stream.DataStream`
turns either into a stream of batches.
"""

import dataclasses

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_float, check_int, check_positive_int, plain_fields
from ringsplash.data.batch import Batch
from ringsplash.data.packing import int_vector

# ----------------------------------------------------------------------------- associative recall


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall over ``seq_len`` tokens.

    Vocabulary: ``0`` = separator, then ``num_filler`` filler tokens, ``num_keys`` keys and
    ``num_values`` values (chance accuracy = ``1 / num_values``). A row is::

        filler ... k1 v1 filler ... k2 v2 ... (num_pairs pairs, placed at random) SEP
        q1 a1 q2 a2 ... (num_queries queried keys with their values)

    Only the answers are scored: the loss mask is 1 at each queried key, whose label is its
    value. ``min_distance`` keeps every pair at least that many tokens before the separator,
    so the answers are long-range.

    The filler is i.i.d. uniform when ``filler_rule == 0``. Otherwise it is a "local grammar":
    with probability ``filler_rule`` the next filler token is a fixed function (seeded by
    ``rule_seed``, the same for every row) of the previous two, else uniform. Predicting it
    needs the previous token, so scoring it (loss weight ``filler_weight``, at filler tokens
    whose two predecessors are filler) teaches the previous-token heads that recall builds on,
    as local syntax does in natural text.
    """

    seq_len: int = 1024
    num_pairs: int = 32
    num_queries: int = 32
    num_keys: int = 64
    num_values: int = 16
    num_filler: int = 16
    min_distance: int = 0
    filler_rule: float = 0.0
    filler_weight: float = 0.0
    rule_seed: int = 0

    def __post_init__(self):
        # every field checked by name first (NumPy scalars as Python numbers): filler_rule 1.5 / NaN, negative
        # min_distance and num_keys=True were taken, num_values / num_filler 0 failed inside the draws
        plain_fields(self)
        for name in ("seq_len", "num_keys", "num_values", "num_filler"):
            check_positive_int(name, getattr(self, name))
        for name in ("num_pairs", "num_queries", "min_distance", "rule_seed"):
            check_int(name, getattr(self, name), minimum=0)
        object.__setattr__(self, "filler_rule", check_float("filler_rule", self.filler_rule, minimum=0.0,
                                                            maximum=1.0))
        object.__setattr__(self, "filler_weight", check_float("filler_weight", self.filler_weight, minimum=0.0))
        if self.num_queries > self.num_pairs:
            raise ValueError(f"num_queries={self.num_queries} must be <= num_pairs={self.num_pairs}")
        if self.num_pairs > self.num_keys:
            raise ValueError(f"num_pairs={self.num_pairs} must be <= num_keys={self.num_keys} (keys are distinct)")
        if self.context_len - self.min_distance < 2 * self.num_pairs:
            raise ValueError(
                f"seq_len={self.seq_len} too short for {self.num_pairs} pairs, {self.num_queries} queries "
                f"and min_distance={self.min_distance}"
            )

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_filler + self.num_keys + self.num_values

    @property
    def context_len(self) -> int:
        return self.seq_len - 1 - 2 * self.num_queries

    @property
    def key_offset(self) -> int:
        return 1 + self.num_filler

    @property
    def value_offset(self) -> int:
        return 1 + self.num_filler + self.num_keys

    def batch(self, rng: np.random.Generator, batch_size: int, episode_len: int | None = None) -> Batch:
        return recall_batch(rng, batch_size, self, episode_len=episode_len)

    def episode(self, episode_len: int) -> "RecallTask":
        """The same task on ``episode_len`` tokens: as many pairs as fit without filler, at most
        ``num_pairs`` (queries likewise, at most ``num_queries``)."""
        episode_len = check_positive_int("episode_len", as_scalar(episode_len))  # 0 made num_pairs -1
        pairs = min(self.num_pairs, (episode_len - 1) // 4)
        return dataclasses.replace(
            self, seq_len=episode_len, num_pairs=pairs, num_queries=min(self.num_queries, pairs), min_distance=0
        )


def recall_batch(
    rng: np.random.Generator, batch_size: int, task: RecallTask, *, episode_len: int | None = None
) -> Batch:
    """One batch of the recall task (see :class:`RecallTask`).

    With ``episode_len < task.seq_len`` (a divisor), each row packs ``seq_len // episode_len``
    independent shorter episodes (``task.episode(episode_len)``) as documents: segment ids keep
    them apart and positions restart in each — a sequence-length curriculum.
    """
    batch_size = check_positive_int("batch_size", as_scalar(batch_size))  # 0 gave an empty batch
    if episode_len is not None:  # 0 was a ZeroDivisionError
        episode_len = check_positive_int("episode_len", as_scalar(episode_len))
    if episode_len is not None and episode_len != task.seq_len:
        if task.seq_len % episode_len:
            raise ValueError(f"episode_len={episode_len} must divide seq_len={task.seq_len}")
        per_row = task.seq_len // episode_len
        b = recall_batch(rng, batch_size * per_row, task.episode(episode_len))
        rows = [x.reshape(batch_size, task.seq_len) for x in b]
        seg = np.repeat(np.arange(per_row, dtype=np.int32), episode_len)
        return Batch(rows[0], rows[1], rows[2], rows[3], np.broadcast_to(seg, (batch_size, task.seq_len)).copy())
    t = task
    S, P, Q, C = t.seq_len, t.num_pairs, t.num_queries, t.context_len
    tokens = _filler(rng, batch_size, t)
    keys = np.argsort(rng.random((batch_size, t.num_keys)), axis=1)[:, :P].astype(np.int32) + t.key_offset
    values = rng.integers(0, t.num_values, size=(batch_size, P), dtype=np.int32) + t.value_offset
    # Pair starts: P non-overlapping 2-token slots in [0, C - min_distance), sorted, uniformly at random.
    room = C - t.min_distance - 2 * P  # free filler tokens to distribute
    gaps = np.sort(rng.integers(0, room + 1, size=(batch_size, P)), axis=1)
    starts = gaps + 2 * np.arange(P)[None, :]
    rows = np.arange(batch_size)[:, None]
    tokens[rows, starts] = keys
    tokens[rows, starts + 1] = values
    tokens[:, C] = 0  # separator
    which = np.argsort(rng.random((batch_size, P)), axis=1)[:, :Q]
    q_pos = C + 1 + 2 * np.arange(Q)
    tokens[:, q_pos] = np.take_along_axis(keys, which, axis=1)
    tokens[:, q_pos + 1] = np.take_along_axis(values, which, axis=1)
    labels = np.concatenate([tokens[:, 1:], np.zeros((batch_size, 1), np.int32)], axis=1)
    loss_mask = np.zeros((batch_size, S), np.float32)
    if t.filler_rule > 0 and t.filler_weight > 0:
        filler = (tokens >= 1) & (tokens < 1 + t.num_filler)
        scored = filler[:, 2:] & filler[:, 1:-1] & filler[:, :-2]  # target and its two predecessors
        loss_mask[:, 1:-1][scored] = t.filler_weight  # predict token i+1 at position i
    loss_mask[:, q_pos] = 1.0
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (batch_size, S)).copy()
    segment_ids = np.zeros((batch_size, S), np.int32)
    return Batch(tokens, labels, loss_mask, positions, segment_ids)


def _filler(rng: np.random.Generator, batch_size: int, t: RecallTask) -> np.ndarray:
    F = t.num_filler
    out = rng.integers(1, 1 + F, size=(batch_size, t.seq_len), dtype=np.int32)
    if t.filler_rule <= 0:
        return out
    table = np.random.default_rng([t.rule_seed, 7]).integers(1, 1 + F, size=(1 + F, 1 + F), dtype=np.int32)
    follow = rng.random((batch_size, t.seq_len)) < t.filler_rule
    for i in range(2, t.seq_len):
        out[:, i] = np.where(follow[:, i], table[out[:, i - 2], out[:, i - 1]], out[:, i])
    return out


# ----------------------------------------------------------------------------- packed documents


def pack_documents(docs: list[np.ndarray], seq_len: int, num_rows: int, *, pad_id: int = 0) -> Batch:
    """Greedily pack ``docs`` (1-D int arrays, in order) into ``num_rows`` rows of ``seq_len``.

    A document longer than the room left in a row is split; its continuation starts the next
    row (positions restart at 0 there: each row piece is its own segment). Segment ids number
    the pieces of a row from 1; padding is segment 0 with loss mask 0. Labels are the next
    token of the same piece; the last token of every piece is not scored.
    """
    # sizes by name (seq_len 0 / num_rows 0 gave empty batches, 8.0 a numpy TypeError), documents 1-D integer
    # arrays (float tokens were truncated, a 2-D document a broadcast error)
    seq_len, num_rows = (check_positive_int(n, as_scalar(v)) for n, v in (("seq_len", seq_len), ("num_rows", num_rows)))
    pad_id = check_int("pad_id", as_scalar(pad_id), minimum=0)
    docs = [int_vector(f"docs[{i}]", doc) for i, doc in enumerate(docs)]
    tokens = np.full((num_rows, seq_len), pad_id, np.int32)
    labels = np.zeros((num_rows, seq_len), np.int32)
    mask = np.zeros((num_rows, seq_len), np.float32)
    positions = np.zeros((num_rows, seq_len), np.int32)
    segments = np.zeros((num_rows, seq_len), np.int32)
    row, col, seg = 0, 0, 1
    for doc in docs:
        doc = np.asarray(doc, np.int32)
        while doc.size and row < num_rows:
            n = min(doc.size, seq_len - col)
            piece = doc[:n]
            tokens[row, col : col + n] = piece
            labels[row, col : col + n - 1] = piece[1:]
            mask[row, col : col + n - 1] = 1.0
            positions[row, col : col + n] = np.arange(n)
            segments[row, col : col + n] = seg
            doc, col, seg = doc[n:], col + n, seg + 1
            if col == seq_len:
                row, col, seg = row + 1, 0, 1
        if row >= num_rows:
            break
    return Batch(tokens, labels, mask, positions, segments)
