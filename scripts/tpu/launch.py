"""Run an experiment on an existing TPU VM or pod slice (every worker at once).

    python scripts/tpu/launch.py --tpu my-v5e-16 --zone us-west4-a --project my-proj \\
        experiments/train_long_context.py -- --context-parallel 16 --backend auto --seq-len 65536

Steps (``--dry-run`` prints exactly these commands and runs nothing):

1. pack the repository (tracked files, without ``.git``, ``runs/``) into a tarball;
2. ``gcloud compute tpus tpu-vm scp`` it to every worker;
3. ``gcloud compute tpus tpu-vm ssh --worker=all``: unpack, ``pip install -e .[tpu]``;
4. ``gcloud compute tpus tpu-vm ssh --worker=all``: start the experiment on every worker
   through ``python -m ringsplash.distributed`` — the same entry point ``scripts/launch_local.py``
   uses for local multi-process runs — which calls ``jax.distributed.initialize()``
   (coordinator, process count and id come from the TPU metadata) before running the script
   as ``__main__`` with ``JAX_PLATFORMS=tpu``.

Every process builds the same global batches (data streams are deterministic) and feeds only
its own shards; process 0 writes metrics under the run directory on worker 0.
"""

import argparse
import os
import shlex
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
REMOTE_DIR = "~/ringsplash"
TARBALL = "/tmp/ringsplash-src.tar.gz"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--tpu", help="TPU VM / pod slice name (required)")
    parser.add_argument("--zone", help="its zone, e.g. us-west4-a (required)")
    parser.add_argument("--project", default=None, help="GCP project (default: gcloud's)")
    parser.add_argument("--remote-dir", default=REMOTE_DIR, help=f"checkout on the workers (default {REMOTE_DIR})")
    parser.add_argument("--skip-install", action="store_true", help="reuse the installed environment")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("script", help="experiment to run, e.g. experiments/train_long_context.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.script_args and args.script_args[0] == "--":
        args.script_args = args.script_args[1:]
    if not (args.tpu and args.zone):
        parser.error("--tpu and --zone are required")
    return args


def _gcloud(args, verb: str, *rest: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *rest, f"--zone={args.zone}"]
    if args.project:
        cmd.append(f"--project={args.project}")
    return cmd


def commands(args) -> list[list[str]]:
    """The exact commands the launcher runs, in order."""
    pack = ["tar", "czf", TARBALL, "-C", REPO, "--exclude=.git", "--exclude=runs", "--exclude=*.egg-info",
            "--exclude=__pycache__", "--exclude=.venv", "."]
    copy = _gcloud(args, "scp", TARBALL, f"{args.tpu}:{TARBALL}", "--worker=all")
    d = args.remote_dir
    setup = f"mkdir -p {d} && tar xzf {TARBALL} -C {d}"
    if not args.skip_install:
        setup += f" && cd {d} && python3 -m pip install -q -e '.[tpu]'"
    install = _gcloud(args, "ssh", args.tpu, "--worker=all", f"--command={setup}")
    run_cmd = " ".join(
        ["cd", d, "&&", "JAX_PLATFORMS=tpu", "RINGSPLASH_TPU_MULTIHOST=1", "python3", "-m", "ringsplash.distributed",
         shlex.quote(args.script), "--", *map(shlex.quote, args.script_args)]
    )
    run = _gcloud(args, "ssh", args.tpu, "--worker=all", f"--command={run_cmd}")
    return [pack, copy, install, run]


def main(argv=None) -> int:
    args = parse_args(argv)
    for cmd in commands(args):
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
