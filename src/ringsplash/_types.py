"""Array type aliases shared by signatures (jaxtyping; checked at runtime in tests only)."""

from jaxtyping import Array, Bool, Float, Int, Shaped

__all__ = ["Array", "Bool", "Float", "Int", "Shaped"]
