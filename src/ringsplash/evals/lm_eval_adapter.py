"""An lm-evaluation-harness (``lm-eval``) model backed by a ringsplash ``Transformer``.

    from ringsplash.evals.lm_eval_adapter import RingsplashLM
    lm = RingsplashLM(model, tokenizer, generate_fn=...)       # or RingsplashLM(pretrained="hf_dir")
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=lm_eval.tasks.TaskManager(include_path=dir))

or from lm-eval's command line, ``--model ringsplash --model_args pretrained=DIR,tokenizer=DIR/tokenizer.json``:
ringsplash declares the ``lm_eval.models`` entry point ``ringsplash`` (pyproject.toml), which lm-eval
versions with plugin discovery read; ``python -m ringsplash.evals.lm_eval_cli`` is lm-eval's own CLI
with the installed ``lm_eval.models`` entry points registered first, for versions without it (0.4.13
and older). Importing this module also registers the name. An unknown ``--model_args`` key is a
``ValueError`` naming it (and the accepted keys).

``loglikelihood`` and ``loglikelihood_rolling`` are teacher-forced (``Scorer``); ``generate_until``
calls ``generate_fn`` (default: ``rs.inference.generate``, greedy) and cuts at the first stop
string. lm-eval is an optional test / evals dependency (``pip install -e ".[evals]"``), never
needed by the rest of ringsplash.
"""

import difflib
import inspect

import numpy as np

from ringsplash._internal.optional import require
from ringsplash.evals.loading import inference_generate_fn, load_model
from ringsplash.evals.scoring import GenerateFn, Scorer
from ringsplash.evals.tokenizer import Tokenizer, load_tokenizer
from ringsplash.model import Transformer

# lm-eval (the evals extra): without it, importing this module is one line saying how to install it
_NEEDED_FOR = "ringsplash.evals.lm_eval_adapter (the lm-evaluation-harness model)"
LM = require("lm_eval.api.model", extra="evals", needed_for=_NEEDED_FOR).LM
register_model = require("lm_eval.api.registry", extra="evals", needed_for=_NEEDED_FOR).register_model
_lm_eval_utils = require("lm_eval.utils", extra="evals", needed_for=_NEEDED_FOR)
get_rolling_token_windows, make_disjoint_window = (_lm_eval_utils.get_rolling_token_windows,
                                                   _lm_eval_utils.make_disjoint_window)

#: what lm-eval passes every model besides ``--model_args`` (``simple_evaluate``'s ``additional_config``):
#: accepted and not used (JAX places the model; batches are ``batch_size`` rows)
LM_EVAL_EXTRA_ARGS = ("device", "max_batch_size")


@register_model("ringsplash")
class RingsplashLM(LM):
    def __init__(self, model: Transformer | None = None, tokenizer: Tokenizer | str | None = None, *,
                 pretrained: str | None = None, attention: str = "splash", generate_fn: GenerateFn | None = None,
                 batch_size: int | str = 8, max_length: int | None = None, max_gen_toks: int = 256,
                 prefix_token_id: int | None = None, pad_multiple: int = 64, **lm_eval_args):
        super().__init__()
        unknown = sorted(set(lm_eval_args) - set(LM_EVAL_EXTRA_ARGS))
        if unknown:
            raise ValueError(_unknown_args_message(unknown))
        if (model is None) == (pretrained is None):
            raise ValueError("pass exactly one of model (a Transformer) and pretrained (a model directory)")
        if model is None:
            model = load_model(pretrained, attention=attention)
            tokenizer = tokenizer or pretrained
        if tokenizer is None:
            raise ValueError("tokenizer is required with a model object: a Tokenizer, 'bytes' or a tokenizer.json path")
        self.model = model
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.scorer = Scorer(model)
        self.max_length = int(max_length or model.config.max_seq_len)
        if self.max_length > model.config.max_seq_len:
            raise ValueError(f"max_length={self.max_length} must be <= the model's max_seq_len="
                             f"{model.config.max_seq_len}")
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_gen_toks, self.pad_multiple = int(max_gen_toks), int(pad_multiple)
        self.prefix_token_id = 0 if prefix_token_id is None else int(prefix_token_id)
        self._generate_fn = generate_fn

    @classmethod
    def model_args(cls) -> tuple[str, ...]:
        """The ``--model_args`` keys this model accepts."""
        params = inspect.signature(cls.__init__).parameters
        return tuple(n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD)

    # ----------------------------------------------------------------------------- scoring

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-prob of the continuation, whether greedy decoding produces it) for (context, continuation)
        token pairs, keeping the last ``max_length`` tokens of each."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows = []
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
                continue
            full = (list(ctx) + list(cont))[-self.max_length:]
            k = min(len(cont), len(full) - 1)
            rows.append((i, full, k))
        rows.sort(key=lambda r: len(r[1]))  # similar lengths share a padded shape (fewer compiles)
        for b in range(0, len(rows), self.batch_size):
            part = rows[b:b + self.batch_size]
            n = max(len(r[1]) for r in part)
            n = min(self.max_length, -(-n // self.pad_multiple) * self.pad_multiple)
            batch = np.zeros((len(part), n), np.int32)  # right padding: causal, so it changes nothing before it
            for j, (_, full, _) in enumerate(part):
                batch[j, :len(full)] = full
            s = self.scorer.token_scores(batch)
            for j, (i, full, k) in enumerate(part):
                sl = slice(len(full) - 1 - k, len(full) - 1)  # predictions of the continuation's k tokens
                out[i] = (float(s.logprob[j, sl].sum()), bool(s.correct[j, sl].all()))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for ctx, cont in (r.args for r in requests):
            c = self.tokenizer.encode(ctx) if ctx else [self.prefix_token_id]
            pairs.append((c, self.tokenizer.encode(cont)))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for (text,) in (r.args for r in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tokenizer.encode(text), self.prefix_token_id, self.max_length - 1, 1)]  # rows of <= max_length
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    # ----------------------------------------------------------------------------- generation

    def generate_until(self, requests) -> list[str]:
        """Greedy continuations, ``batch_size`` requests with the same ``max_gen_toks`` per
        ``generate_fn`` call (right-padded prompts with their lengths), each cut at its first stop string."""
        if self._generate_fn is None:
            self._generate_fn = inference_generate_fn(self.model)
        jobs = []  # (index, prompt ids, new tokens, stop strings)
        for i, (ctx, kwargs) in enumerate(r.args for r in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            if not 0 < n < self.max_length:
                raise ValueError(f"max_gen_toks={n} must be in [1, max_length={self.max_length})")
            ids = self.tokenizer.encode(ctx)[-(self.max_length - n):] if ctx else [self.prefix_token_id]
            jobs.append((i, ids, n, until))
        out: list[str] = [""] * len(jobs)
        jobs.sort(key=lambda j: (j[2], len(j[1])))
        groups: dict[int, list] = {}
        for job in jobs:
            groups.setdefault(job[2], []).append(job)
        for n, group in groups.items():
            for b in range(0, len(group), self.batch_size):
                part = group[b:b + self.batch_size]
                lengths = np.array([len(j[1]) for j in part], np.int32)
                prompts = np.zeros((len(part), lengths.max()), np.int32)
                for row, job in enumerate(part):
                    prompts[row, :len(job[1])] = job[1]
                new = np.asarray(self._generate_fn(prompts, lengths, n))
                for (i, _, _, until), toks in zip(part, new):
                    text = self.tokenizer.decode([int(t) for t in toks])
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    out[i] = text
        return out


def _unknown_args_message(unknown: list[str]) -> str:
    known = RingsplashLM.model_args()
    hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, n=1)) else repr(k)
             for k in unknown]
    return (f"--model ringsplash got unknown model_args {', '.join(hints)}: the accepted keys are "
            f"{', '.join(known)} (and lm-eval's own {', '.join(LM_EVAL_EXTRA_ARGS)})")


__all__ = ["LM_EVAL_EXTRA_ARGS", "RingsplashLM"]
