"""How a Ulysses degree splits the attention heads: which degrees the q / kv heads allow, each
device's head counts (kv heads repeated where the degree exceeds them), the per-device mask of a
``MultiHeadMask``, and the (Ulysses, ring) factorisations of a 2-D mesh. Host-side arithmetic,
shared by the Ulysses and USP strategies and the model's configuration checks.
"""

import dataclasses

from ringsplash import masks as masks_lib

__all__ = ["UlyssesHeads", "local_head_mask", "ulysses_heads", "usp_factorisations", "valid_ulysses_degrees"]


@dataclasses.dataclass(frozen=True)
class UlyssesHeads:
    """How ``heads`` / ``kv_heads`` split over a Ulysses degree: each device gets
    ``heads // degree`` q heads and ``kv_local`` kv heads, after repeating every kv head
    ``kv_repeat`` times (1 when ``degree`` divides ``kv_heads``)."""

    degree: int
    heads: int
    kv_heads: int
    kv_repeat: int

    @property
    def q_local(self) -> int:
        return self.heads // self.degree

    @property
    def kv_local(self) -> int:
        return self.kv_heads * self.kv_repeat // self.degree


def valid_ulysses_degrees(heads: int, kv_heads: int) -> list[int]:
    """The Ulysses degrees (devices) that can split ``heads`` q heads and ``kv_heads`` kv heads."""
    return [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]


def ulysses_heads(heads: int, kv_heads: int, degree: int, axis_name) -> UlyssesHeads:
    """Check that ``degree`` devices can split the heads; the error lists the degrees that can.

    q heads must split evenly; kv heads either split evenly too, or (``degree`` a multiple of
    ``kv_heads``) each kv head goes to exactly the ``degree / kv_heads`` devices holding its
    q heads. Any other ratio would send some device a kv head it does not use.
    """
    ok = valid_ulysses_degrees(heads, kv_heads)
    if degree not in ok:
        why = (f"heads={heads} is not divisible by the Ulysses degree {degree}" if heads % degree
               else f"kv_heads={kv_heads} neither divides nor is divisible by the Ulysses degree {degree}")
        raise ValueError(
            f"{why} (mesh axis {axis_name!r} has {degree} devices); Ulysses degrees that work for "
            f"heads={heads}, kv_heads={kv_heads}: {ok} (use a smaller Ulysses axis, usp_attention with "
            f"the rest on a ring axis, or ring_attention / allgather_attention)"
        )
    return UlyssesHeads(degree, heads, kv_heads, 1 if kv_heads % degree == 0 else degree // kv_heads)


def local_head_mask(mask: masks_lib.AnyMask, split: UlyssesHeads) -> masks_lib.AnyMask:
    """The mask of one device's ``heads / degree`` heads, the same on every device.

    A MultiHeadMask must repeat with period ``heads / degree`` (every head group the same):
    the kernels' MaskInfo is static, and one per group would put collectives in branches.
    """
    if not isinstance(mask, masks_lib.MultiHeadMask):
        return mask
    n = split.q_local
    groups = [mask.masks[i * n:(i + 1) * n] for i in range(split.degree)]
    if any(g != groups[0] for g in groups):
        raise ValueError(
            f"a MultiHeadMask under Ulysses must give every device's head group (heads / degree = "
            f"{split.heads} / {split.degree} = {n} heads) the same masks; repeat the per-head masks with "
            f"period {n}, or use ring_attention / allgather_attention for arbitrary per-head masks"
        )
    return masks_lib.MultiHeadMask(groups[0])


def usp_factorisations(devices: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """Every (ulysses, ring) with ``ulysses * ring == devices`` that the heads allow."""
    return [(a, devices // a) for a in valid_ulysses_degrees(heads, kv_heads) if devices % a == 0]
