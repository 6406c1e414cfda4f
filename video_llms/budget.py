"""Budgets users can say: "keep 25% of the video tokens" -> a per-block TESTA schedule for a tower.

TESTA's schedule is absolute (R_T slices and R_S units merged per block), so a schedule is planned for one video
grid: ``slices`` tubelets (frames) of ``units`` merge units. Other grids get what the same schedule leaves them
(`common.token_grid`; the processor always emits that count exactly).

The plan splits the reduction between time and space (``temporal_share`` of the factor, in log terms, goes to time:
0.5 takes the square root of the kept fraction from each), then spreads each axis's removals as evenly as the caps
allow over the blocks from ``first_block`` on (TESTA merges at every block; an even spread is ToMe's constant r):
per block at most ``(slices - 1) // 2`` slices and half the units, the caps of `common.merge_slices` / `merge_units`.
"""

import math


def spread(total: int, blocks: int, start: int, initial: int, cap, cap_text: str) -> list[int]:
    """``total`` removals from ``initial`` items over ``blocks`` blocks, none before ``start``: at every block the
    even share of what is left (rounded up), at most ``cap(count)`` where ``count`` is what the block starts with.
    Raises ValueError (naming ``cap_text``) when the caps cannot reach ``total``."""
    reductions, left, count = [0] * blocks, total, initial
    for index in range(start, blocks):
        r = min(math.ceil(left / (blocks - index)), cap(count))
        reductions[index], left, count = r, left - r, count - r
    if left:
        raise ValueError(
            f"at most {cap_text} merge per block: {blocks - start} blocks cannot remove {total} of {initial}; keep "
            f"more, or start merging earlier (first_block={start})."
        )
    return reductions


def plan_kept_fraction(num_blocks: int, slices: int, units: int, keep: float, *, temporal_share: float = 0.5,
                       first_block: int = 0) -> dict[str, list[int]]:
    """``{"temporal_reduction": [...], "spatial_reduction": [...]}`` (one int per block, for `apply_testa`) that
    leaves at most ``keep`` of a ``slices x units`` video's tokens, as close to it as whole slices and units allow.

    Args:
        num_blocks: the tower's blocks (Qwen2.5-VL-7B: 32).
        slices, units: the video's tubelets and merge units per tubelet (Qwen: ``t`` and ``h * w / 4`` of its
            ``video_grid_thw``).
        keep: the fraction of tokens to keep, in (0, 1].
        temporal_share: how much of the reduction (in log terms) comes from merging tubelets, in [0, 1].
        first_block: no merge before this block.
    """
    if not 0 < keep <= 1:
        raise ValueError(f"keep={keep!r} must be a fraction in (0, 1].")
    if not 0 <= temporal_share <= 1:
        raise ValueError(f"temporal_share={temporal_share!r} must be in [0, 1].")
    if not 0 <= first_block < num_blocks:
        raise ValueError(f"first_block={first_block!r} must be a block of the tower (0 .. {num_blocks - 1}).")
    target = keep * slices * units
    fewest_slices = min(slices, 2)  # the slice cap, (T - 1) // 2, never takes 2 slices to 1
    kept_slices = min(slices, max(fewest_slices, round(slices * keep ** temporal_share)))
    kept_units = min(units, max(1, math.floor(target / kept_slices + 1e-9)))
    if kept_slices * kept_units > target:
        raise ValueError(
            f"keep={keep!r} of {slices} x {units} tokens is {target:g} tokens, fewer than the {fewest_slices} x 1 "
            "that TESTA's caps can leave; keep more."
        )
    temporal = spread(slices - kept_slices, num_blocks, first_block, slices, lambda count: (count - 1) // 2,
                      "(slices - 1) // 2 slices")
    spatial = spread(units - kept_units, num_blocks, first_block, units, lambda count: count // 2, "half the units")
    return {"temporal_reduction": temporal, "spatial_reduction": spatial}


__all__ = ["plan_kept_fraction", "spread"]
