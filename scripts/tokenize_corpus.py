"""Tokenize text files, directories of text, or JSONL into a corpus directory for ``data.Loader``.

    python scripts/tokenize_corpus.py books/ extra.jsonl runs/corpora/books                 # bytes
    python scripts/tokenize_corpus.py data.jsonl runs/corpora/mine --tokenizer tokenizer.json --text-field content

A text file is one document; each line of a ``.jsonl`` file is one (its ``--text-field``);
directories are walked (sorted, hidden entries skipped). Re-running on the same inputs with the
same options does nothing. See ``ringsplash.data.tokenize`` for the format and the bad-input rules.
"""

import argparse
import json
import os
import sys

from ringsplash import data
from ringsplash._internal.optional import MissingDependency
from ringsplash.cli import PATH_ERRORS, output_dir_problem


def _count(s: str) -> int:
    """``--shard-tokens`` / ``--batch-documents``: an integer >= 1."""
    try:
        value = int(s)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    d = data.TokenizeOptions()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("paths", nargs="+", help="input files and directories, then the output corpus directory last")
    p.add_argument("--tokenizer", default=d.tokenizer, help="'bytes' or a Hugging Face tokenizer.json (default %(default)s)")
    p.add_argument("--text-field", default=d.text_field, help="JSONL field holding the text (default %(default)s)")
    p.add_argument("--empty-documents", choices=("skip", "error"), default=d.empty_documents,
                   help="an empty document is skipped (counted in the manifest) or an error (default %(default)s)")
    p.add_argument("--errors", choices=("error", "replace"), default=d.errors,
                   help="non-UTF-8 bytes: an error naming the file, or replaced by U+FFFD (default %(default)s)")
    p.add_argument("--shard-tokens", type=_count, default=d.shard_tokens,
                   help="tokens per shard file (default %(default)s)")
    p.add_argument("--batch-documents", type=_count, default=d.batch_documents,
                   help="documents per tokenizer call (default %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an output corpus made from other inputs or options")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        parser.error("give at least one input and the output directory")
    *inputs, output = args.paths
    if args.tokenizer != "bytes" and not os.path.isfile(args.tokenizer):
        parser.error(f"argument --tokenizer: expected 'bytes' or a tokenizer.json file, got {args.tokenizer!r}")
    problem = output_dir_problem(output)
    if problem:
        parser.error(f"the output corpus directory (the last path) cannot be made: {problem}")
    try:
        options = data.TokenizeOptions(tokenizer=args.tokenizer, text_field=args.text_field,
                                       empty_documents=args.empty_documents, errors=args.errors,
                                       shard_tokens=args.shard_tokens, batch_documents=args.batch_documents)
        manifest = data.tokenize_corpus(inputs, output, options, overwrite=args.overwrite,
                                        progress=not args.no_progress)
    except (ValueError, *PATH_ERRORS) as e:
        print(f"tokenize_corpus.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except MissingDependency as e:  # e.g. a tokenizer.json without tokenizers: what to install
        print(f"tokenize_corpus.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    summary = {k: manifest[k] for k in ("num_documents", "num_tokens", "num_bytes", "vocab_size",
                                        "skipped_empty_documents", "replaced_documents", "fingerprint")}
    print(f"{output}: " + json.dumps(summary))
    return manifest


if __name__ == "__main__":
    main()
