"""Loss / perplexity by position: the mean next-token loss at each position of long documents,
bucketed by position (does the model use the context it is given, and how far out?).

Position ``p`` scores the prediction of token ``p + 1`` from tokens ``0..p``, so a row of
``seq_len`` tokens has ``seq_len - 1`` scored positions.
"""

import json
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_bool, check_int, check_positive_int
from ringsplash.evals.scoring import Scorer


class LossByPosition(NamedTuple):
    per_position: np.ndarray  # float64 [seq_len - 1]: mean loss (nats) over documents at each position
    bucket_starts: np.ndarray  # int [buckets]: first position of each bucket
    bucket_ends: np.ndarray  # int [buckets]: one past its last position
    bucket_loss: np.ndarray  # float64 [buckets]: mean loss over the bucket's positions and documents
    bucket_accuracy: np.ndarray  # float64 [buckets]: mean next-token argmax accuracy
    documents: int

    @property
    def bucket_perplexity(self) -> np.ndarray:
        return np.exp(self.bucket_loss)

    def table(self) -> str:
        lines = ["| positions | loss (nats) | perplexity | accuracy |", "|---|---|---|---|"]
        for s, e, l, a in zip(self.bucket_starts, self.bucket_ends, self.bucket_loss, self.bucket_accuracy):
            lines.append(f"| {s}-{e - 1} | {l:.4f} | {np.exp(l):.3f} | {a:.3f} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"documents": self.documents, "per_position": self.per_position.tolist(),
                "buckets": [{"start": int(s), "end": int(e), "loss": float(l), "perplexity": float(np.exp(l)),
                             "accuracy": float(a)} for s, e, l, a in
                            zip(self.bucket_starts, self.bucket_ends, self.bucket_loss, self.bucket_accuracy)]}


def document_rows(tokens: np.ndarray | Sequence[int], seq_len: int, num_docs: int) -> np.ndarray:
    """``[num_docs, seq_len]``: consecutive, non-overlapping windows of a token stream."""
    tokens = np.asarray(tokens)
    seq_len, num_docs = check_int("seq_len", as_scalar(seq_len)), check_int("num_docs", as_scalar(num_docs))  # 10.0
    if seq_len < 2 or num_docs < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 2 and num_docs={num_docs} >= 1")
    if tokens.size < seq_len * num_docs:
        raise ValueError(f"the text has {tokens.size} tokens, fewer than num_docs={num_docs} x seq_len={seq_len} = "
                         f"{seq_len * num_docs}: pass a longer text or fewer / shorter documents")
    return tokens[: seq_len * num_docs].reshape(num_docs, seq_len).astype(np.int32)


def bucket_edges(seq_len: int, bucket_size: int | None = None, *, log: bool = False) -> np.ndarray:
    """Bucket edges over the ``seq_len - 1`` scored positions: every ``bucket_size`` positions
    (default ``(seq_len - 1) / 16`` rounded up), or with ``log`` at 0, 1, 2, 4, 8, ..."""
    # by name: seq_len 0 gave edges [-1], bucket_size 0 meant the default, 4.5 gave float edges
    n = check_int("seq_len", as_scalar(seq_len), minimum=2) - 1
    if bucket_size is not None:
        bucket_size = check_positive_int("bucket_size", as_scalar(bucket_size))
    if check_bool("log", as_scalar(log)):
        edges = [0] + [2**k for k in range(int(np.ceil(np.log2(n))) + 1) if 2**k < n] + [n]
        return np.unique(np.asarray(edges))
    size = max(1, -(-n // 16)) if bucket_size is None else bucket_size
    return np.unique(np.append(np.arange(0, n, size), n))


def loss_by_position(scorer: Scorer, rows: np.ndarray, *, bucket_size: int | None = None, log_buckets: bool = False,
                     batch_size: int = 4) -> LossByPosition:
    """Teacher-forced loss of ``rows [docs, seq_len]`` (each a document from its start), by position."""
    rows = scorer.check_rows(rows)
    n, seq_len = rows.shape
    if n == 0 or seq_len < 2:
        raise ValueError(f"rows must hold >= 1 document of >= 2 tokens, got shape {rows.shape}")
    nll, correct = [], []
    for i in range(0, n, batch_size):
        s = scorer.token_scores(rows[i:i + batch_size])
        nll.append(-s.logprob.astype(np.float64))
        correct.append(s.correct)
    nll, correct = np.concatenate(nll), np.concatenate(correct)
    edges = bucket_edges(seq_len, bucket_size, log=log_buckets)
    starts, ends = edges[:-1], edges[1:]
    return LossByPosition(
        per_position=nll.mean(0), bucket_starts=starts, bucket_ends=ends,
        bucket_loss=np.array([nll[:, s:e].mean() for s, e in zip(starts, ends)]),
        bucket_accuracy=np.array([correct[:, s:e].mean() for s, e in zip(starts, ends)]),
        documents=n)


def write_loss_by_position(result: LossByPosition, out_dir: str, title: str = "") -> list[str]:
    """``loss_by_position.json``, ``loss_by_position.md`` (the table) and ``loss_by_position.png``."""
    from ringsplash.evals.plots import line_plot

    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "loss_by_position.json"), os.path.join(out_dir, "loss_by_position.md")]
    with open(files[0], "w") as f:
        json.dump(result.to_dict(), f)
    with open(files[1], "w") as f:
        f.write(result.table() + "\n")
    mid = (result.bucket_starts + result.bucket_ends - 1) / 2
    png = os.path.join(out_dir, "loss_by_position.png")
    if line_plot(mid + 1, {"loss": result.bucket_loss}, png, xlabel="position (bucket centre)",
                 ylabel="next-token loss (nats)", title=title or f"loss by position ({result.documents} documents)",
                 logx=True):
        files.append(png)
    return files


__all__ = ["LossByPosition", "bucket_edges", "document_rows", "loss_by_position", "write_loss_by_position"]
