"""RULER-style synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER), generated locally, and RULER's
scoring.

Tasks (``RULER_TASKS``): ``niah_single`` (one key, one value), ``niah_multikey`` (four keys, one
queried), ``niah_multivalue`` (one key with four values, all asked for), ``variable_tracking`` (a
chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in noise sentences; name every variable
holding the value) and ``common_words`` (a numbered word list; name the ten most frequent). As in
RULER, ``length`` counts the prompt and the tokens to generate, and the prompt ends with the
answer prefix, so the model continues straight into the answer.

Scoring follows RULER's evaluator (``scripts/eval/evaluate.py`` and
``scripts/eval/synthetic/constants.py``): a prediction is stripped and its control characters
(``\\x00``-``\\x1f``) become newlines (``postprocess_pred``); ``string_match_all`` is the mean over
samples of the fraction of references contained (case-insensitive) in the prediction,
``string_match_part`` the mean of whether any reference is; both are percentages rounded to 2
decimals. Every task here is scored with ``string_match_all``, as RULER scores these tasks.
"""

import dataclasses
import json
import os
import re
import string
from collections.abc import Callable, Sequence

import numpy as np

from ringsplash._internal.scalar_checks import as_scalar, check_int, check_positive_int
from ringsplash.evals.scoring import GenerateFn
from ringsplash.evals.tokenizer import Tokenizer

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words")
#: new tokens generated per task (RULER's defaults)
TOKENS_TO_GENERATE = {"niah_single": 128, "niah_multikey": 128, "niah_multivalue": 128, "variable_tracking": 30,
                      "common_words": 120}
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


# ----------------------------------------------------------------------------- scoring (RULER's evaluator)


def postprocess_pred(pred: str) -> str:
    pred = pred.strip()
    return re.sub(r"[\x00-\x1f]", "\n", pred).strip()


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of references found (case-insensitive) in the prediction, in %."""
    _check_pairs(preds, refs)
    per = [sum(r.lower() in p.lower() for r in ref) / len(ref) for p, ref in zip(preds, refs)]
    return round(100.0 * sum(per) / len(preds), 2)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """Mean over samples of whether any reference is found (case-insensitive) in the prediction, in %."""
    _check_pairs(preds, refs)
    per = [max(float(r.lower() in p.lower()) for r in ref) for p, ref in zip(preds, refs)]
    return round(100.0 * sum(per) / len(preds), 2)


def _check_pairs(preds, refs) -> None:
    if len(preds) == 0 or len(preds) != len(refs):
        raise ValueError(f"preds and refs must be non-empty and of one length, got {len(preds)} and {len(refs)}")
    if any(isinstance(r, str) for r in refs):  # a string's characters were matched as its references
        raise TypeError("refs must hold one sequence of reference strings per sample (e.g. [['42']]), got a string "
                        "as a sample's references")
    if any(len(r) == 0 for r in refs):
        raise ValueError("every sample needs at least one reference")


METRIC_FNS: dict[str, Callable[[Sequence[str], Sequence[Sequence[str]]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}


def score_predictions_file(path: str, metric: str = "string_match_all") -> float:
    """Score a RULER prediction file (JSONL; ``pred`` and ``outputs`` fields, as RULER writes them)."""
    if metric not in METRIC_FNS:
        raise ValueError(f"metric={metric!r} must be one of {tuple(METRIC_FNS)}")
    preds, refs = [], []
    with open(path) as f:
        for line in filter(str.strip, f):
            row = json.loads(line)
            preds.append(postprocess_pred(row["pred"]))
            refs.append(row.get("outputs", [row.get("output", "")]))
    return METRIC_FNS[metric](preds, refs)


# ----------------------------------------------------------------------------- task generation


@dataclasses.dataclass(frozen=True)
class RulerSample:
    index: int
    task: str
    input: str  # the prompt, ending with the answer prefix
    outputs: tuple[str, ...]  # the references
    length: int  # the task length (prompt + tokens to generate)
    input_tokens: int


def _tokens_of_text(text: str) -> list[str]:
    """The haystack as whitespace-separated words (RULER builds its essay haystack from words too)."""
    out = text.split()
    if not out:
        raise ValueError("haystack text must not be empty")
    return out


def _words(text: str) -> list[str]:
    words = sorted(set(re.findall(r"[a-z]{4,12}", text.lower())))
    if len(words) < 50:
        raise ValueError(f"the haystack text has {len(words)} distinct words of 4-12 letters; RULER-style tasks need "
                         f">= 50 (pass a longer text)")
    return words


def _fit(build: Callable[[int], str], budget: int, tokenizer: Tokenizer, what: str, max_n: int | None = None) -> str:
    """``build(n)`` for the largest ``n`` (at most ``max_n``) whose text has at most ``budget`` tokens."""
    count = lambda n: len(tokenizer.encode(build(n)))
    if count(0) > budget:
        raise ValueError(f"length does not fit the {what} prompt: even without filler it takes {count(0)} tokens, "
                         f"more than the {budget} available")
    if max_n is not None and count(max_n) <= budget:
        return build(max_n)
    hi = 1
    while count(hi) <= budget:
        hi *= 2
    hi = hi if max_n is None else min(hi, max_n)
    lo = hi // 2  # count(lo) fits (lo = 0 or a power of two that fitted), count(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return build(lo)


def _insert(words: list[str], items: list[str], rng: np.random.Generator, keep_order: bool = False) -> str:
    """``items`` placed at uniformly random sentence ends of ``words`` (any word boundary if none)."""
    ends = [i for i in range(1, len(words)) if words[i - 1].endswith((".", "!", "?"))]
    bounds = np.asarray([0, *ends, len(words)])
    at = sorted(bounds[rng.integers(0, len(bounds), size=len(items))].tolist())
    if not keep_order:
        items = [items[i] for i in rng.permutation(len(items))]
    out, j = [], 0
    for i in range(len(words) + 1):
        while j < len(items) and at[j] == i:
            out.append(items[j])
            j += 1
        if i < len(words):
            out.append(words[i])
    return " ".join(out)


def _niah(rng, hay_words, words, num_keys, num_values, tokenizer, budget):
    keys = list(rng.choice(words, size=num_keys, replace=False))
    values = [[str(v) for v in rng.integers(1_000_000, 10_000_000, size=num_values)] for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    q = int(rng.integers(num_keys))
    kind = "numbers" if num_values > 1 else "number"
    start = int(rng.integers(len(hay_words)))

    def build(n):
        hay = [hay_words[(start + i) % len(hay_words)] for i in range(n)]
        context = _insert(hay, needles, np.random.default_rng(int(start) + n))
        return (f"Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                f"I will quiz you about the numbers afterwards.\n{context}\nWhat are all the special magic {kind} "
                f"for {keys[q]} mentioned in the provided text? The special magic {kind} for {keys[q]} mentioned "
                f"in the provided text {'are' if num_values > 1 else 'is'}")

    return _fit(build, budget, tokenizer, "needle-in-a-haystack"), values[q]


def _variable_tracking(rng, tokenizer, budget, hops=4):
    letters = np.array(list(string.ascii_uppercase))
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(letters, size=5))
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10_000, 100_000)))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    noise = _tokens_of_text(_NOISE)

    def build(n):
        hay = [noise[i % len(noise)] for i in range(n)]
        context = _insert(hay, chain, np.random.default_rng(n + hops), keep_order=True)
        return (f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                f"Question: Find all variables that are assigned the value {value} in the text above. Answer: "
                f"According to the chain(s) of variable assignment in the text above, {hops + 1} variables are "
                f"assigned the value {value}, they are:")

    return _fit(build, budget, tokenizer, "variable-tracking"), names


def _common_words(rng, words, tokenizer, budget, length):
    freq_cw, freq_ucw = (6, 1) if length < 4096 else (30, 3)
    pool = list(rng.permutation(words))
    common, rare = pool[:10], pool[10:]

    def build(n):
        lst = common * freq_cw + rare[:n] * freq_ucw
        lst = [lst[i] for i in np.random.default_rng(n).permutation(len(lst))]
        numbered = " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))
        return (f"Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                f"the ones that appear most often.\n{numbered}\nQuestion: What are the 10 most common words in the "
                f"above list? Answer: The top 10 words that appear most often in the list are:")

    # a text with too few distinct words gives a shorter list (the sample records its input_tokens)
    return _fit(build, budget, tokenizer, "common-words", max_n=len(rare)), common


def ruler_samples(task: str, tokenizer: Tokenizer, length: int, num_samples: int, text: str, *, seed: int = 0,
                  max_new_tokens: int | None = None) -> list[RulerSample]:
    """``num_samples`` prompts of ``task`` whose tokens plus ``max_new_tokens`` (default: RULER's for the
    task) fit ``length``; ``text`` is the haystack (``ringsplash.evals.haystack.read_text``)."""
    if task not in RULER_TASKS:
        raise ValueError(f"task={task!r} must be one of {RULER_TASKS}")
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    # by name: length 1024.0 and max_new_tokens 0 / -3 were taken, a negative seed failed in NumPy
    length = check_positive_int("length", as_scalar(length))
    seed = check_int("seed", as_scalar(seed), minimum=0)
    new = TOKENS_TO_GENERATE[task] if max_new_tokens is None else check_positive_int("max_new_tokens",
                                                                                    as_scalar(max_new_tokens))
    budget = int(length) - int(new)
    if budget < 1:
        raise ValueError(f"length={length} does not fit: it must exceed max_new_tokens={new}")
    rng = np.random.default_rng([seed, int(length), RULER_TASKS.index(task)])
    hay_words = _tokens_of_text(text)
    words = None if task == "variable_tracking" else _words(text)
    out = []
    for i in range(num_samples):
        try:
            prompt, refs = _sample(task, rng, hay_words, words, tokenizer, budget, length)
        except ValueError as e:
            raise ValueError(f"{task} at length={length} (max_new_tokens={new}): {e}") from e
        out.append(RulerSample(i, task, prompt, tuple(refs), int(length), len(tokenizer.encode(prompt))))
    return out


def _sample(task, rng, hay_words, words, tokenizer, budget, length):
    if task.startswith("niah"):
        k, v = {"niah_single": (1, 1), "niah_multikey": (4, 1), "niah_multivalue": (1, 4)}[task]
        return _niah(rng, hay_words, words, k, v, tokenizer, budget)
    if task == "variable_tracking":
        return _variable_tracking(rng, tokenizer, budget)
    return _common_words(rng, words, tokenizer, budget, length)


# ----------------------------------------------------------------------------- running


def run_ruler(generate_fn: GenerateFn, tokenizer: Tokenizer, task: str, lengths: Sequence[int], num_samples: int,
              text: str, out_dir: str, *, seed: int = 0, max_new_tokens: int | None = None, batch_size: int = 4,
              pad_id: int = 0) -> list[dict]:
    """Generate each task sample's answer, write RULER prediction files ``{out_dir}/{task}-{length}.jsonl``
    (``index``, ``input``, ``outputs``, ``pred``) and return one summary row per length (``score``
    = ``string_match_all`` in %, as RULER reports it, and ``nulls`` = empty predictions)."""
    new = TOKENS_TO_GENERATE[task] if max_new_tokens is None else max_new_tokens
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for length in lengths:
        samples = ruler_samples(task, tokenizer, length, num_samples, text, seed=seed, max_new_tokens=new)
        preds = []
        for i in range(0, len(samples), batch_size):
            part = samples[i:i + batch_size]
            ids = [tokenizer.encode(s.input) for s in part]
            lens = np.array([len(x) for x in ids], np.int32)
            prompts = np.full((len(part), lens.max()), pad_id, np.int32)
            for j, x in enumerate(ids):
                prompts[j, :len(x)] = x
            out = np.asarray(generate_fn(prompts, lens, new))
            preds.extend(tokenizer.decode([int(t) for t in row]) for row in out)
        path = os.path.join(out_dir, f"{task}-{length}.jsonl")
        with open(path, "w") as f:
            for s, p in zip(samples, preds):
                f.write(json.dumps({"index": s.index, "input": s.input, "outputs": list(s.outputs), "pred": p,
                                    "length": s.length, "others": {"id": s.index}}) + "\n")
        cleaned = [postprocess_pred(p) for p in preds]
        rows.append({"task": task, "length": int(length), "samples": len(samples),
                     "score": string_match_all(cleaned, [s.outputs for s in samples]),
                     "nulls": f"{sum(len(p) == 0 for p in cleaned)}/{len(cleaned)}", "predictions": path})
    with open(os.path.join(out_dir, f"summary-{task}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


__all__ = ["METRIC_FNS", "RULER_TASKS", "TOKENS_TO_GENERATE", "RulerSample", "postprocess_pred", "ruler_samples",
           "run_ruler", "score_predictions_file", "string_match_all", "string_match_part"]
