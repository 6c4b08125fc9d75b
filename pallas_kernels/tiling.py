"""Tile-size helper shared by the kernel families (Triton needs power-of-two block dims)."""

__all__ = ["pow2_divisor"]


def pow2_divisor(n: int, limit: int) -> int:
    """Largest power of two that divides ``n`` and is at most ``limit`` (at least 1)."""
    b = 1
    while b * 2 <= limit and n % (b * 2) == 0:
        b *= 2
    return b


def block_shape(
    rows: int, cols: int, group: int, max_rows: int, max_cols: int
) -> tuple[int, int] | None:
    """``(block_rows, block_cols)`` tiling a ``(rows, cols)`` view in whole groups of ``group``
    columns, or ``None`` when the shape cannot be tiled so (ragged last axis, group size not a
    power of two)."""
    if group & (group - 1) or cols % group:
        return None
    block_cols = pow2_divisor(cols, max(max_cols, group))
    if block_cols < group:
        return None
    return pow2_divisor(rows, max_rows), block_cols
