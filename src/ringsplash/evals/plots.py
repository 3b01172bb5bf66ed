"""PNG figures of the evaluations (matplotlib, headless). Each returns False when matplotlib is
missing, so the numbers (JSONL / JSON / tables) are written either way."""

from collections.abc import Sequence

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return None
    return plt


def heatmap(grid: np.ndarray, lengths: Sequence[int], depths: Sequence[float], path: str, *, title: str = "",
            value_range: tuple[float, float] | None = (0.0, 1.0)) -> bool:
    """``grid[depth, length]`` as the needle-in-a-haystack heatmap (depth down, length across)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.45 * len(depths)))
    lo, hi = value_range or (np.nanmin(grid), np.nanmax(grid))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=lo, vmax=hi, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def line_plot(x: np.ndarray | Sequence[float], ys: dict[str, np.ndarray | Sequence[float]], path: str, *,
              xlabel: str, ylabel: str, title: str = "", logx: bool = False) -> bool:
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, y in ys.items():
        ax.plot(x, y, marker="o", ms=3, label=label)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(ys) > 1:
        ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


__all__ = ["heatmap", "line_plot"]
