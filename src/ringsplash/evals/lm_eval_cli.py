"""``python -m ringsplash.evals.lm_eval_cli ARGS``: lm-eval's own command line (what ``lm_eval ARGS``
runs: the same subcommands and flags) with the installed ``lm_eval.models`` entry points registered
first, so that ``--model ringsplash`` resolves:

    lm_eval run --model ringsplash --model_args pretrained=DIR,tokenizer=bytes --tasks my_task --include_path my_tasks/

works by itself once ringsplash is installed (``pip install``: ``ringsplash-lm-eval.pth`` registers
the group whenever lm-eval fills its registry, see ``_ringsplash_lm_eval``). This module is the same
command for a checkout used without installing it (``PYTHONPATH=src``), where no start-up file runs.
Entry points are registered lazily (imported when the model is asked for) and never replace a
built-in name.
"""

import sys

from _ringsplash_lm_eval import ENTRY_POINT_GROUP
from _ringsplash_lm_eval import register_entry_points as _register
from ringsplash._internal.optional import MissingDependency, require

_NEEDED_FOR = "python -m ringsplash.evals.lm_eval_cli (lm-eval's command line)"


def register_entry_points() -> list[str]:
    """Register every installed ``lm_eval.models`` entry point with lm-eval's model registry (lazily:
    the module is imported when the name is resolved); the names registered."""
    # built-in names first (lm-eval registers them only into an empty registry)
    require("lm_eval.models", extra="evals", needed_for=_NEEDED_FOR)
    return _register(require("lm_eval.api.registry", extra="evals", needed_for=_NEEDED_FOR).model_registry)


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (default: ``sys.argv[1:]``) after ``register_entry_points``."""
    try:
        cli_evaluate = require("lm_eval.__main__", extra="evals", needed_for=_NEEDED_FOR).cli_evaluate
    except MissingDependency as e:
        raise SystemExit(str(e)) from None
    register_entry_points()
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()


__all__ = ["ENTRY_POINT_GROUP", "main", "register_entry_points"]
