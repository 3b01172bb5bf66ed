"""``python -m ringsplash.checkpoints verify RUN_DIR``: check every checkpoint of a run."""

import argparse
import os

from ringsplash.checkpoints.store import all_steps, verify

__all__ = ["main"]


def _checkpoint_root(path: str) -> str:
    """A run directory's ``checkpoints/``, or ``path`` itself when it is a checkpoint root."""
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) else path


def main(argv: list[str] | None = None) -> int:
    """``python -m ringsplash.checkpoints verify RUN_DIR``: check every checkpoint; exit status 1
    when one fails (or there is none)."""
    parser = argparse.ArgumentParser(prog="python -m ringsplash.checkpoints", allow_abbrev=False,
                                     description="Check checkpoints without resuming a run.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("verify", allow_abbrev=False,
                           help="read every checkpoint of a run and compare its arrays with their recorded checksums")
    check.add_argument("run_dir", help="a run directory (its checkpoints/ subdirectory) or a checkpoint root")
    args = parser.parse_args(argv)
    root = _checkpoint_root(args.run_dir)
    steps = all_steps(root)
    if not steps:
        print(f"no finalised checkpoint under {root}")
        return 1
    bad = 0
    for step in steps:
        problem = verify(root, step)
        bad += problem is not None and "records no checksums" not in problem
        print(f"step {step}: " + ("ok" if problem is None else problem))
    newest = next((s for s in reversed(steps) if verify(root, s) is None), None) if bad else steps[-1]
    print(f"{len(steps) - bad} of {len(steps)} checkpoints verify; a resumed run starts from "
          + (f"step {newest}" if newest is not None else "nothing (no checkpoint verifies)"))
    return 1 if bad else 0
