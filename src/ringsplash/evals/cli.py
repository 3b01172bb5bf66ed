"""``python -m ringsplash.evals TASK --model DIR ...``: run one evaluation, write its results under
``--out`` and print its table. TASK: ``loss`` (loss / perplexity by position), ``passkey``,
``niah`` (depth × length grids, teacher-forced and generative), ``ruler`` (RULER-style tasks,
generative). ``--model``: a Hugging Face checkpoint directory or a ringsplash run directory."""

import argparse
import json
import math
import os
import sys
import time

from ringsplash.cli import output_dir_problem

DTYPES = ("float32", "bfloat16", "float16")  # ringsplash.model.config.DTYPES (not imported: it starts JAX)


def _ints(s: str) -> list[int]:
    """``--lengths``: comma-separated positive token counts (``K`` = 1024), at least one; argparse reports a
    bad value as ``argument --lengths: ...``."""
    out = []
    for x in filter(None, s.split(",")):
        x = x.strip().upper()
        try:
            value = float(x[:-1]) * 1024 if x.endswith("K") else float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r} is not a token count (e.g. 1K,2K,4096)") from None
        if not (math.isfinite(value) and value >= 1 and value == int(value)):
            raise argparse.ArgumentTypeError(f"{x!r} is not a whole number of tokens >= 1")
        out.append(int(value))
    if not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths in tokens, got {s!r}")
    return out


def _floats(s: str) -> list[float]:
    """``--depths``: comma-separated fractions in ``[0, 1]``, at least one."""
    try:
        out = [float(x) for x in filter(None, s.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {s!r}") from None
    bad = [x for x in out if not 0 <= x <= 1]  # NaN too
    if bad or not out:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {s!r}")
    return out


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum`` (``--seed -1`` was accepted and failed once the model had loaded)."""
    def parse(s: str) -> int:
        try:
            value = int(s)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {s!r}")
        return value

    return parse


_count = _int_at_least(1)  # a count flag
_seed = _int_at_least(0)  # a NumPy seed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringsplash.evals", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=("loss", "passkey", "niah", "ruler"))
    p.add_argument("--model", required=True, help="Hugging Face checkpoint dir or ringsplash run dir")
    p.add_argument("--tokenizer", default=None,
                   help="'bytes', a tokenizer.json or a dir holding one (default: the model dir's tokenizer.json; "
                        "a model dir without one needs --tokenizer)")
    p.add_argument("--haystack", default=None, help="a local text file (default: text shipped with Python)")
    p.add_argument("--out", default=None, help="output dir (default: evals/<task>-<time>)")
    p.add_argument("--lengths", type=_ints, default="1K,2K,4K", help="comma-separated lengths in tokens (K = 1024)")
    p.add_argument("--depths", type=_floats, default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    p.add_argument("--samples", type=_count, default=4, help="prompts per cell (passkey / niah) or per length (ruler)")
    p.add_argument("--digits", type=_count, default=None, help="key digits (default: passkey 5, niah 7)")
    p.add_argument("--ruler-tasks", default="niah_single,niah_multikey,niah_multivalue,variable_tracking,common_words")
    p.add_argument("--max-new-tokens", type=_count, default=None, help="ruler: new tokens (default: RULER's per task)")
    p.add_argument("--seq-len", type=_count, default=None, help="loss: tokens per document (default: max of --lengths)")
    p.add_argument("--documents", type=_count, default=4, help="loss: documents")
    p.add_argument("--bucket-size", type=_count, default=None, help="loss: positions per bucket (default: 16 buckets)")
    p.add_argument("--log-buckets", action="store_true", help="loss: buckets at 0, 1, 2, 4, 8, ... instead")
    p.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                   help="also score generations (rs.inference.generate, greedy); --no-generate: teacher-forced only")
    p.add_argument("--attention", default="splash", choices=("splash", "reference"))
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="parameter dtype (compute dtype: --compute-dtype)")
    p.add_argument("--compute-dtype", default=None, choices=DTYPES)
    p.add_argument("--batch-size", type=_count, default=4)
    p.add_argument("--seed", type=_seed, default=0)
    return p


def main(argv=None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    # paths checked before anything loads: one line naming the flag, never a traceback later
    if not os.path.isdir(args.model):
        p.error(f"argument --model: {args.model!r} is not a directory (a Hugging Face checkpoint or a ringsplash "
                f"run directory)")
    if args.haystack is not None and not os.path.isfile(args.haystack):
        p.error(f"argument --haystack: {args.haystack!r} is not a file (a local text file)")
    problem = output_dir_problem(args.out) if args.out else None
    if problem:
        p.error(f"argument --out: no output directory can be made there: {problem}")
    tok_spec = args.tokenizer
    if tok_spec is None:
        if not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
            p.error(f"--model {args.model} has no tokenizer.json, so --tokenizer is required: --tokenizer bytes for "
                    f"a byte-level model (token ids = UTF-8 bytes), or --tokenizer PATH (a tokenizer.json or a "
                    f"directory holding one)")
        tok_spec = args.model
    from ringsplash import distributed

    distributed.choose_platform()  # the TPU when present, else the CPU; before anything starts JAX
    print(distributed.device_line(), flush=True)
    from ringsplash import evals

    names = [x.strip() for x in args.ruler_tasks.split(",") if x.strip()]
    if args.task == "ruler" and (not names or not set(names) <= set(evals.RULER_TASKS)):  # '' ran no task at all
        p.error(f"argument --ruler-tasks: expected a comma-separated subset of {','.join(evals.RULER_TASKS)}, got "
                f"{args.ruler_tasks!r}")
    tokenizer = evals.load_tokenizer(tok_spec)
    out = args.out or os.path.join("evals", f"{args.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    text = evals.read_text(args.haystack)
    lengths = args.lengths
    model = evals.load_model(args.model, attention=args.attention, param_dtype=args.dtype,
                             compute_dtype=args.compute_dtype)
    generate_fn = evals.inference_generate_fn(model) if (args.generate or args.task == "ruler") else None
    print(f"model {args.model}: {model.config.num_layers} layers, d_model {model.config.d_model}, max_seq_len "
          f"{model.config.max_seq_len}; tokenizer {tok_spec}; results -> {out}", flush=True)
    result: dict = {"task": args.task, "model": args.model, "out": out}
    if args.task == "loss":
        seq_len = args.seq_len or max(lengths)
        tokens = tokenizer.encode(text)
        rows = evals.document_rows(tokens, seq_len, args.documents)
        lbp = evals.loss_by_position(evals.Scorer(model), rows, bucket_size=args.bucket_size,
                                     log_buckets=args.log_buckets, batch_size=args.batch_size)
        result["files"] = evals.write_loss_by_position(lbp, out)
        table = lbp.table()
    elif args.task in ("passkey", "niah"):
        make = evals.passkey_task if args.task == "passkey" else evals.niah_task
        task = make(tokenizer) if args.digits is None else make(tokenizer, args.digits)
        records = evals.run_grid(evals.Scorer(model), task, evals.Haystack.from_text(text, tokenizer), lengths,
                                 args.depths, args.samples, generate_fn=generate_fn,
                                 batch_size=args.batch_size, seed=args.seed, progress=True)
        written = evals.write_grid(records, out, title=args.task)
        result.update(summary=written["summary"], files=written["files"])
        table = written["table"]
    else:
        rows = []
        for name in names:  # every task and length fits (else an error) before anything is generated
            for length in lengths:
                evals.ruler_samples(name, tokenizer, length, 1, text, max_new_tokens=args.max_new_tokens)
        for name in names:
            rows += evals.run_ruler(generate_fn, tokenizer, name, lengths, args.samples, text, out, seed=args.seed,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
        result["summary"] = rows
        table = "\n".join(["| task | length | score (%) | nulls |", "|---|---|---|---|"]
                          + [f"| {r['task']} | {r['length']} | {r['score']:.2f} | {r['nulls']} |" for r in rows])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({k: v for k, v in result.items() if k != "summary"} | {"summary": result.get("summary")}, f,
                  indent=1)
    print(table)
    print(f"results: {out}", file=sys.stderr)
    return result


__all__ = ["main", "parser"]
