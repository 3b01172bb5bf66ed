"""The TPU's native tile: 8 sublanes x 128 lanes of 32-bit values (a leaf module: the config,
the block table and the VMEM estimate all size blocks in these units)."""

NUM_LANES = 128
NUM_SUBLANES = 8


def lanes(n: int) -> int:
    """``n`` rounded up to whole 128-lane tiles: the width a minor dimension takes in VMEM (64 takes 128)."""
    return -(-n // NUM_LANES) * NUM_LANES


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a ``(rows, cols)`` VMEM buffer at its tiled shape: rows padded to the dtype's sublane
    tile (8 x 32-bit values: 8 float32, 16 bfloat16, 32 int8 rows), columns to 128 lanes."""
    sublanes = NUM_SUBLANES * max(1, 4 // itemsize)
    return -(-rows // sublanes) * sublanes * lanes(cols) * itemsize
