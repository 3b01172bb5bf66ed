"""Demo: build a mask, lay it out for context parallelism, show its block structure.

Prints a per-block ASCII map ('.' empty, 'P' partial, 'F' full) of the mask in the laid-out
frame (rows and columns in the order shards hold them), with shard boundaries marked, and
saves the same map as a PNG plus a JSONL summary under a run directory.

    python experiments/mask_demo.py                                   # causal & local, zigzag over 4 shards
    python experiments/mask_demo.py --layout striped --window 0       # plain causal, striped
    python experiments/mask_demo.py --seq-len 4096 --block 128 --run-dir runs/demo
"""

import dataclasses
import json
import os
import time

import numpy as np

import ringsplash as rs
from ringsplash import masks
from ringsplash.cli import parse_config
from ringsplash.masks import EMPTY, FULL, PARTIAL

SYMBOLS = {EMPTY: ".", PARTIAL: "P", FULL: "F"}


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    seq_len: int = 1024  # tokens (queries = keys)
    block: int = 64  # block size of the map (tokens per row / column of blocks)
    num_shards: int = 4  # context-parallel shards the layout spreads the tokens over
    layout: str = "zigzag"  # contiguous | zigzag | striped
    mask: str = "causal"  # causal | chunked | prefix | full
    window: int = 256  # left window of a LocalMask combined with the mask with `&`; 0 = none
    chunk_size: int = 256  # chunk length of mask=chunked
    prefix_len: int = 128  # bidirectional prefix length of mask=prefix
    run_dir: str = "runs/mask_demo"  # where the PNG and the JSONL summary go

    def __post_init__(self):
        if self.mask not in ("causal", "chunked", "prefix", "full"):
            raise ValueError(f"mask must be causal|chunked|prefix|full, got mask={self.mask!r}")
        if self.layout not in rs.layouts.LAYOUTS:
            raise ValueError(f"layout must be one of {rs.layouts.LAYOUTS}, got layout={self.layout!r}")
        for name in ("seq_len", "block", "num_shards"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {name}={getattr(self, name)}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got window={self.window}")


def build_mask(config: DemoConfig) -> masks.Mask:
    shape = (config.seq_len, config.seq_len)
    base = {
        "causal": lambda: masks.CausalMask(shape),
        "chunked": lambda: masks.ChunkedCausalMask(shape, config.chunk_size),
        "prefix": lambda: masks.PrefixLMMask(shape, config.prefix_len),
        "full": lambda: masks.FullMask(shape),
    }[config.mask]()
    return base & masks.LocalMask(shape, window=(config.window, None)) if config.window else base


def block_grid(info: rs.MaskInfo) -> np.ndarray:
    """Kinds of every (global q block, global kv block) pair in the laid-out frame."""
    nq, nk = info.q_blocks_per_shard, info.kv_blocks_per_shard
    grid = np.zeros((info.q_shards * nq, info.kv_shards * nk), np.int8)
    for a in range(info.q_shards):
        for b in range(info.kv_shards):
            active = info.kind[0, a, b] > 0
            qb = a * nq + info.q_block[0, a, b][active].astype(np.int64)
            kb = b * nk + info.kv_block[0, a, b][active].astype(np.int64)
            grid[qb, kb] = info.kind[0, a, b][active]
    return grid


def ascii_map(grid: np.ndarray, per_shard_q: int, per_shard_kv: int) -> str:
    lines = []
    for i, row in enumerate(grid):
        if i and i % per_shard_q == 0:
            lines.append("-" * (grid.shape[1] + grid.shape[1] // per_shard_kv - 1))
        chunks = ["".join(SYMBOLS[int(k)] for k in row[j : j + per_shard_kv]) for j in range(0, row.size, per_shard_kv)]
        lines.append("|".join(chunks))
    return "\n".join(lines)


def save_png(grid: np.ndarray, config: DemoConfig, per_shard_q: int, per_shard_kv: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    fig, ax = plt.subplots(figsize=(6, 6))
    ax.imshow(grid, cmap=ListedColormap(["white", "tab:orange", "tab:blue"]), vmin=0, vmax=2, interpolation="nearest")
    for s in range(1, config.num_shards):
        ax.axhline(s * per_shard_q - 0.5, color="black", lw=1)
        ax.axvline(s * per_shard_kv - 0.5, color="black", lw=1)
    ax.set_xlabel(f"kv block ({config.layout} layout, {config.num_shards} shards)")
    ax.set_ylabel("q block")
    ax.set_title(f"{config.mask}{' & local' if config.window else ''}, S={config.seq_len}, block={config.block}\n"
                 "white: empty, orange: partial, blue: full")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(config: DemoConfig) -> dict:
    mask = build_mask(config)
    pos = rs.layouts.permutation(config.layout, config.seq_len, config.num_shards)
    t0 = time.perf_counter()
    info = rs.build_mask_info(mask, (config.block, config.block), q_shards=config.num_shards,
                              kv_shards=config.num_shards, q_positions=pos, kv_positions=pos)
    seconds = time.perf_counter() - t0
    grid = block_grid(info)
    nq, nk = info.q_blocks_per_shard, info.kv_blocks_per_shard
    print(f"{mask!r}\nlayout={config.layout}, shards={config.num_shards}, blocks={config.block}: "
          f"'.' empty, 'P' partial, 'F' full; '|' and '-' mark shard boundaries\n")
    print(ascii_map(grid, nq, nk))

    per_pair = info.num_active[0]  # [q_shards, kv_shards] blocks computed by each shard pair
    summary = {
        "config": dataclasses.asdict(config),
        "mask": repr(mask),
        "build_seconds": seconds,
        "blocks": {"empty": int((grid == EMPTY).sum()), "partial": int((grid == PARTIAL).sum()),
                   "full": int((grid == FULL).sum())},
        "unique_partial_blocks": int(info.partial_mask_blocks.shape[0]),
        "max_steps": int(info.max_steps),
        "work_per_q_shard": per_pair.sum(axis=1).tolist(),
    }
    print(f"\nblocks: {summary['blocks']}, unique stored partial blocks: {summary['unique_partial_blocks']}")
    print(f"work (non-empty blocks) per q shard: {summary['work_per_q_shard']}")

    os.makedirs(config.run_dir, exist_ok=True)
    png = os.path.join(config.run_dir, "block_map.png")
    save_png(grid, config, nq, nk, png)
    with open(os.path.join(config.run_dir, "results.jsonl"), "a") as f:
        f.write(json.dumps(summary) + "\n")
    print(f"saved {png} and results.jsonl")
    return summary


def parse_args(argv=None) -> DemoConfig:
    return parse_config(DemoConfig, argv, description=__doc__)


if __name__ == "__main__":
    main(parse_args())
