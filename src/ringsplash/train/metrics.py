"""Step metrics: an append-only JSONL log written by process 0 (``MetricsLog``), its PNG plot
(``plot_metrics``; matplotlib imported only there), and the per-layer max-logit summary."""

import json
import math
import os

import jax
import numpy as np

from ringsplash.distributed import is_main_process


class MetricsLog:
    """Append-only JSONL of step metrics plus a PNG plot (loss, accuracy, tokens/s, and the
    max attention logit per layer when the records have ``max_logit/layer<i>``)."""

    def __init__(self, run_dir: str, name: str = "metrics"):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, f"{name}.jsonl")
        self.plot_path = os.path.join(run_dir, f"{name}.png")

    def write(self, record: dict) -> None:
        """Append ``record`` (process 0 only: every process computes the same metrics)."""
        if not is_main_process():
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def truncate(self, after_step: int) -> None:
        """Drop every record past ``after_step`` (those of an interrupted run beyond its last
        checkpoint, which the resumed run writes again). Atomic: temp file, then rename."""
        if not os.path.exists(self.path):
            return
        keep = [r for r in self.read() if r.get("step", 0) <= after_step]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def plot(self, title: str = "") -> str:
        """Write the PNG (process 0 only) and return its path."""
        if is_main_process():
            plot_metrics(self.read(), self.plot_path, title)
        return self.plot_path


def plot_metrics(records: list[dict], path: str, title: str = "") -> None:
    """Plot train (and held-out, ``split="eval"``) loss, accuracy and tokens/s, plus the max
    attention logit per layer when present, to the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("split", "train") == "train"]
    held = [r for r in records if r.get("split") == "eval"]
    layer_keys = sorted({k for r in train for k in r if k.startswith("max_logit/")},
                        key=lambda k: int(k.rsplit("layer", 1)[-1]))
    fig, axes = plt.subplots(1, 4 if layer_keys else 3, figsize=(20 if layer_keys else 15, 4))
    if layer_keys:  # max attention logit per layer (QK-clip statistics)
        for k in layer_keys:
            axes[3].plot([r["step"] for r in train if k in r], [float(r[k]) for r in train if k in r],
                         label=k.split("/", 1)[1])
        axes[3].set_xlabel("step")
        axes[3].set_title("max attention logit")
        axes[3].grid(alpha=0.3)
        axes[3].legend()
    for ax, key, label in zip(axes, ("loss", "accuracy", "tokens_per_s"), ("loss", "accuracy", "tokens / s")):
        xs = [r["step"] for r in train if key in r]
        ax.plot(xs, [r[key] for r in train if key in r], label="train")
        ev = [r for r in held if key in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", label="held-out")
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if ev:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def max_logit_metrics(metrics: dict) -> dict:
    """``max_logit/layer<i>`` (max over heads) and ``qk_clipped_heads`` from step metrics."""
    if "max_logits" not in metrics:
        return {}
    per_layer = np.max(np.asarray(metrics["max_logits"]), axis=-1)
    out = {f"max_logit/layer{i}": float(x) for i, x in enumerate(per_layer)}
    if "qk_clipped_heads" in metrics:
        out["qk_clipped_heads"] = int(metrics["qk_clipped_heads"])
    return out


def _plain(v):
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
