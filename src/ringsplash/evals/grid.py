"""The depth × length grid of a needle task: teacher-forced and generative scores of every prompt,
results JSONL, per-cell means and heatmaps (passkey retrieval and needle-in-a-haystack both run here).

Teacher-forced scores of one prompt (its answer = the key's ``key_len`` tokens, appended):

* ``logprob``: the answer's total log-probability; ``logprob_per_token`` its mean;
* ``exact``: every answer token is the model's argmax over the whole vocabulary;
* ``symbol_accuracy``: fraction of answer tokens that are the argmax over the key alphabet only
  (a uniform guess scores ``task.chance``).

Generative (with ``generate_fn``): ``generated`` text of ``key_len + extra_tokens`` new tokens and
``generated_match``: it starts, after leading whitespace, with the key's text.
"""

import json
import os
from collections.abc import Sequence

import numpy as np

from ringsplash.evals.haystack import Haystack
from ringsplash.evals.needle import NeedleTask, check_length_depth
from ringsplash.evals.scoring import GenerateFn, Scorer

METRICS = ("logprob", "logprob_per_token", "exact", "symbol_accuracy", "generated_match")


def run_grid(
    scorer: Scorer | None,
    task: NeedleTask,
    haystack: Haystack,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int = 4,
    *,
    generate_fn: GenerateFn | None = None,
    extra_tokens: int = 4,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> list[dict]:
    """One record per prompt: ``samples`` prompts (own key, own haystack offset) per (length, depth).

    As in RULER, ``length`` counts the prompt and the tokens generated after it (``key_len +
    extra_tokens``): the prompt has ``length - key_len - extra_tokens`` tokens, a teacher-forced row
    (prompt + key) ``length - extra_tokens``. ``scorer=None`` skips teacher-forced scoring,
    ``generate_fn=None`` generation.
    """
    if scorer is None and generate_fn is None:
        raise ValueError("run_grid needs a scorer (teacher-forced), a generate_fn (generative) or both")
    if samples < 1 or batch_size < 1:
        raise ValueError(f"samples={samples} and batch_size={batch_size} must be >= 1")
    if not lengths or not depths:
        raise ValueError(f"lengths={list(lengths)} and depths={list(depths)} must be non-empty")
    answer = task.key_len + extra_tokens
    if extra_tokens < 0:
        raise ValueError(f"extra_tokens={extra_tokens} must be >= 0")
    for length in lengths:  # every bad cell is reported before any work
        if length - answer < task.overhead:
            raise ValueError(f"length={length} does not fit the {task.name} prompt: its prefix, needle and question "
                             f"take {task.overhead} tokens and the answer {answer} more")
        for depth in depths:
            check_length_depth(task, length - answer, depth)
    if scorer is not None and max(lengths) > scorer.config.max_seq_len:
        raise ValueError(f"length={max(lengths)} does not fit the model's max_seq_len={scorer.config.max_seq_len}")
    from tqdm.auto import tqdm

    rng = np.random.default_rng(seed)
    records = []
    cells = [(int(L), float(d)) for L in lengths for d in depths]
    for L in tqdm(sorted({c[0] for c in cells}), desc=task.name, disable=not progress):
        rows = []
        for d in depths:
            for s in range(samples):
                key = task.draw_key(rng)
                offset = int(rng.integers(0, haystack.tokens.size))
                prompt = task.prompt(haystack, L - answer, float(d), key, offset)
                rows.append(({"task": task.name, "length": L, "depth": float(d), "sample": s,
                              "key": task.key_text(key)}, key, prompt))
        for i in range(0, len(rows), batch_size):
            part = rows[i:i + batch_size]
            prompts = np.stack([r[2] for r in part])
            keys = np.stack([r[1] for r in part])
            if scorer is not None:
                for rec, scores in zip((r[0] for r in part), _teacher_forced(scorer, task, prompts, keys)):
                    rec.update(scores)
            if generate_fn is not None:
                new = np.asarray(generate_fn(prompts, np.full(len(part), L - answer, np.int32), answer))
                for (rec, key, _), toks in zip(part, new):
                    text = task.decode([int(t) for t in toks])
                    rec["generated"] = text
                    rec["generated_match"] = bool(text.lstrip().startswith(task.key_text(key)))
            records.extend(r[0] for r in part)
    return records


def _teacher_forced(scorer: Scorer, task: NeedleTask, prompts: np.ndarray, keys: np.ndarray) -> list[dict]:
    b, L = prompts.shape
    answer = task.key_tokens(keys)  # [b, key_len]
    rows = np.concatenate([prompts, answer], axis=1)
    at = L - 1 + np.arange(task.key_len)
    logp = scorer.logprobs_at(rows, np.broadcast_to(at, (b, task.key_len)))  # [b, key_len, vocab]
    lp = np.take_along_axis(logp, answer[..., None], axis=-1)[..., 0]
    exact = (logp.argmax(-1) == answer).all(-1)
    sym = (logp[..., np.asarray(task.alphabet)].argmax(-1) == keys).mean(-1)
    return [{"logprob": float(lp[i].sum()), "logprob_per_token": float(lp[i].mean()), "exact": bool(exact[i]),
             "symbol_accuracy": float(sym[i])} for i in range(b)]


def summarize(records: list[dict]) -> list[dict]:
    """Per (length, depth) cell: the mean of each metric present, and the sample count."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["length"], r["depth"]), []).append(r)
    out = []
    for (L, d), rs in sorted(cells.items()):
        row = {"length": L, "depth": d, "samples": len(rs)}
        for m in METRICS:
            if m in rs[0]:
                row[m] = float(np.mean([float(r[m]) for r in rs]))
        out.append(row)
    return out


def write_grid(records: list[dict], out_dir: str, title: str = "") -> dict:
    """Write ``results.jsonl`` (every prompt), ``summary.json`` (per cell) and a heatmap PNG per metric
    (``heatmap_<metric>.png``, depth × length). Returns ``{"summary": per-cell rows, "table": markdown
    table of them, "files": paths written}``."""
    from ringsplash.evals.plots import heatmap

    os.makedirs(out_dir, exist_ok=True)
    files = [os.path.join(out_dir, "results.jsonl"), os.path.join(out_dir, "summary.json")]
    with open(files[0], "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    summary = summarize(records)
    with open(files[1], "w") as f:
        json.dump(summary, f, indent=1)
    lengths = sorted({r["length"] for r in summary})
    depths = sorted({r["depth"] for r in summary})
    for m in METRICS:
        if m not in summary[0]:
            continue
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in summary:
            grid[depths.index(r["depth"]), lengths.index(r["length"])] = r[m]
        path = os.path.join(out_dir, f"heatmap_{m}.png")
        rng = None if m.startswith("logprob") else (0.0, 1.0)
        if heatmap(grid, lengths, depths, path, title=f"{title} {m}".strip(), value_range=rng):
            files.append(path)
    return {"summary": summary, "table": grid_table(summary), "files": files}


def grid_table(summary: list[dict]) -> str:
    cols = [m for m in METRICS if summary and m in summary[0]]  # no rows: the header alone (was an IndexError)
    lines = ["| length | depth | samples | " + " | ".join(cols) + " |", "|" + "---|" * (3 + len(cols))]
    for r in summary:
        lines.append(f"| {r['length']} | {r['depth']:.2f} | {r['samples']} | "
                     + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


__all__ = ["METRICS", "grid_table", "run_grid", "summarize", "write_grid"]
