"""``python -m ringsplash.evals.lm_eval_cli ARGS``: lm-eval's own command line (what ``lm_eval ARGS``
runs: the same subcommands and flags) with the installed ``lm_eval.models`` entry points registered
first, so that ``--model ringsplash`` resolves:

    python -m ringsplash.evals.lm_eval_cli run --model ringsplash \\
        --model_args pretrained=DIR,tokenizer=bytes --tasks my_task --include_path my_tasks/

ringsplash declares the entry point ``ringsplash = "ringsplash.evals.lm_eval_adapter:RingsplashLM"``
in the group ``lm_eval.models`` (pyproject.toml). lm-eval versions with plugin discovery read that
group themselves, and there plain ``lm_eval --model ringsplash`` works; released lm-eval up to
0.4.13 only knows its built-in names and the classes already imported, and this module does the
discovery for them. Entry points are registered lazily (imported when the model is asked for) and
never replace a built-in name, as lm-eval's own discovery does.
"""

import importlib.metadata as md
import sys

#: the entry-point group lm-eval's plugin discovery reads for model backends
ENTRY_POINT_GROUP = "lm_eval.models"


def register_entry_points() -> list[str]:
    """Register every installed ``lm_eval.models`` entry point with lm-eval's model registry (lazily:
    the module is imported when the name is resolved); the names registered."""
    import lm_eval.models  # noqa: F401  built-in names first (lm-eval registers them only into an empty registry)
    from lm_eval.api.registry import model_registry

    added = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in model_registry:
            continue
        # "module:Class" (not the EntryPoint): the class's own @register_model then upgrades it in place
        target = ep.value if ep.attr and "." not in ep.attr and "[" not in ep.value else ep
        model_registry.register(ep.name, target=target)
        added.append(ep.name)
    return added


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (default: ``sys.argv[1:]``) after ``register_entry_points``."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise SystemExit("lm-eval is not installed: pip install -e .[evals] (or pip install lm-eval)") from e
    register_entry_points()
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()


__all__ = ["ENTRY_POINT_GROUP", "main", "register_entry_points"]
