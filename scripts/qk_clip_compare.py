"""QK-clip on vs off: the main job (experiments/train_long_context.py) twice with the same seed
and data, once logging max logits only, once with ``--qk-clip-threshold``; prints the max
attention logit of every layer over the steps (from each run's ``metrics.jsonl``).

Without ``--threshold`` the "off" run goes first and the threshold is ``--fraction`` (default
0.5) of the largest max logit it reached, so clipping is sure to trigger in the "on" run.

    python scripts/qk_clip_compare.py                            # tiny settings, ring over 2 devices
    python scripts/qk_clip_compare.py --steps 200 --threshold 8

Any other flag is passed to the main job (e.g. ``--seq-len 512 --context-parallel 4``). CPU
timings here are meaningless; the table is about the statistics.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--seq-len", "256", "--num-pairs", "8", "--num-queries", "8", "--context-parallel", "2",
        "--curriculum", "16:0.2,32:0.1,64:0.1,128:0.2", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
        "--learning-rate", "1e-2"]


def run_job(run_dir: str, steps: int, log_every: int, extra: list[str], reuse: bool = False) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train_long_context.py"), *TINY, "--steps", str(steps),
           "--log-every", str(log_every), "--run-dir", run_dir, "--log-max-logits", *extra]
    if not (reuse and os.path.exists(os.path.join(run_dir, "metrics.jsonl"))):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("split", "train") == "train"]


def layer_keys(records: list[dict]) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith("max_logit/")}, key=lambda k: int(k[15:]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=80, help="training steps of each run (default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between logged max logits (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="QK-clip threshold of the \"on\" run; none = auto: --fraction x the \"off\" run's largest max logit")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="the auto threshold's fraction of that max logit (default: %(default)s)")
    parser.add_argument("--out", default="", help="directory for the two run directories (default: a temp dir)")
    parser.add_argument("--reuse", action="store_true", help="only print the table of runs already under --out")
    return parser


def main(argv=None) -> None:
    args, extra = build_parser().parse_known_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="qk_clip_")
    off = run_job(os.path.join(out, "off"), args.steps, args.log_every, extra, args.reuse)
    keys = layer_keys(off)
    threshold = args.threshold or args.fraction * max(r[k] for r in off for k in keys)
    on = run_job(os.path.join(out, "on"), args.steps, args.log_every,
                 [*extra, "--qk-clip-threshold", repr(threshold)], args.reuse)
    print(f"max attention logit per layer (max over heads) of each logged step's forward pass (before that step's "
          f"clip), QK-clip off vs on (threshold {threshold:.4g}); clipped heads: heads above it at that step")
    header = ["step"] + [f"{k[10:]} off" for k in keys] + [f"{k[10:]} on" for k in keys] + ["clipped heads"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    on_by_step = {r["step"]: r for r in on}
    for r in off:
        o = on_by_step.get(r["step"], {})
        cells = [str(r["step"])] + [f"{r[k]:.3f}" for k in keys] + [f"{o.get(k, float('nan')):.3f}" for k in keys]
        print("| " + " | ".join(cells + [str(o.get("qk_clipped_heads", ""))]) + " |")
    last_off, last_on = off[-1], on[-1]
    print(f"final loss off {last_off['loss']:.4f}, on {last_on['loss']:.4f}; run directories under {out}")


if __name__ == "__main__":
    main()
