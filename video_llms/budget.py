"""Budgets users can say: "keep 25% of the video tokens" (`plan_kept_fraction`) or "fit N frames in the tower
compute of M frames" (`plan_for_tower_budget`) -> a per-block TESTA schedule for a Qwen vision tower, a dict to pass
to `apply_testa` (``apply_testa(model, processor=processor, **schedule)``).

TESTA's schedule is absolute (R_T slices and R_S units merged per block), so a schedule is planned for one video
grid: ``slices`` tubelets (frames) of ``units`` merge units. Other grids get what the same schedule leaves them
(`common.token_grid`; the processor always emits that count exactly).

The plan splits the reduction between time and space (``temporal_share`` of the factor, in log terms, goes to time:
0.5 takes the square root of the kept fraction from each), then spreads each axis's removals as evenly as the caps
allow over the blocks from ``first_block`` on (TESTA merges at every block; an even spread is ToMe's constant r):
per block at most ``(slices - 1) // 2`` slices and half the units, the caps of `common.merge_slices` / `merge_units`.
"""

import math
from dataclasses import dataclass


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
                       first_block: int = 0, merge_blocks: int | None = None) -> dict[str, list[int]]:
    """``{"temporal_reduction": [...], "spatial_reduction": [...]}`` (one int per block, for `apply_testa`) that
    leaves at most ``keep`` of a ``slices x units`` video's tokens, as close to it as whole slices and units allow.

    Args:
        num_blocks: the tower's blocks (Qwen2.5-VL-7B: 32).
        slices, units: the video's tubelets and merge units per tubelet (Qwen: ``t`` and ``h * w / 4`` of its
            ``video_grid_thw``).
        keep: the fraction of tokens to keep, in (0, 1].
        temporal_share: how much of the reduction (in log terms) comes from merging tubelets, in [0, 1].
        first_block: no merge before this block.
        merge_blocks: spread the merges over this many blocks from ``first_block`` (None: all blocks from there).
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
    return plan_grid(num_blocks, slices, units, kept_slices, kept_units, first_block=first_block,
                     merge_blocks=merge_blocks)


def plan_grid(num_blocks: int, slices: int, units: int, kept_slices: int, kept_units: int, *,
              first_block: int = 0, merge_blocks: int | None = None) -> dict[str, list[int]]:
    """The schedule that takes a ``slices x units`` video to ``kept_slices x kept_units``: each axis's removals
    spread as evenly as TESTA's caps allow over the ``merge_blocks`` blocks from ``first_block`` on (None: all the
    blocks from there; `spread`); ValueError where the caps cannot reach it."""
    end = num_blocks if merge_blocks is None else first_block + merge_blocks
    if not first_block < end <= num_blocks:
        raise ValueError(f"merge_blocks={merge_blocks!r} from first_block={first_block} must stay within the "
                         f"tower's {num_blocks} blocks.")
    pad = [0] * (num_blocks - end)
    temporal = spread(slices - kept_slices, end, first_block, slices, lambda count: (count - 1) // 2,
                      "(slices - 1) // 2 slices")
    spatial = spread(units - kept_units, end, first_block, units, lambda count: count // 2, "half the units")
    return {"temporal_reduction": temporal + pad, "spatial_reduction": spatial + pad}


# ----------------------------------------------------------------------------------------------------------------------
# The tower's compute and the frames budget
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenTowerShape:
    """What the compute of a Qwen2.5-VL / Qwen3-VL vision tower depends on (from its vision config).

    Attributes:
        family: ``"qwen2_5_vl"`` (gated MLP, window attention except in ``full_attention_blocks``) or ``"qwen3_vl"``
            (plain MLP, full attention within a tubelet, DeepStack mergers after ``deepstack_blocks``).
        window: Qwen2.5-VL's attention window in merge units per side (``window_size // 2 // patch_size``).
    """

    family: str
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    window: int | None = None
    full_attention_blocks: tuple[int, ...] = ()
    deepstack_blocks: tuple[int, ...] = ()

    @classmethod
    def of(cls, config) -> "QwenTowerShape":
        """The shape of a model's tower: ``config`` a Qwen2.5-VL / Qwen3-VL model, its config or its vision config
        (``Qwen2_5_VLVisionConfig``, ``Qwen3VLVisionConfig``); anything else raises TypeError."""
        if isinstance(config, QwenTowerShape):
            return config
        config = getattr(config, "config", config)  # a model -> its config
        config = getattr(config, "vision_config", config)
        kind = getattr(config, "model_type", None)
        if kind not in ("qwen2_5_vl_vision", "qwen3_vl_vision"):
            raise TypeError(f"config must be a Qwen2.5-VL or Qwen3-VL model or (vision) config; got "
                            f"{type(config).__name__} (model_type={kind!r}).")
        common = dict(depth=config.depth, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                      num_heads=config.num_heads, out_hidden_size=config.out_hidden_size,
                      patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size)
        if config.spatial_merge_size != 2:
            raise ValueError(f"TESTA merges Qwen's 2x2 merger units; this tower has "
                             f"spatial_merge_size={config.spatial_merge_size}.")
        if kind == "qwen2_5_vl_vision":
            return cls("qwen2_5_vl", in_channels=getattr(config, "in_channels", None) or config.in_chans,
                       window=config.window_size // config.spatial_merge_size // config.patch_size,
                       full_attention_blocks=tuple(config.fullatt_block_indexes), **common)
        return cls("qwen3_vl", in_channels=config.in_channels,
                   deepstack_blocks=tuple(config.deepstack_visual_indexes), **common)


def _window_sizes(shape: QwenTowerShape, llm_h: int, llm_w: int) -> list[int]:
    """Units in every attention window of an ``llm_h x llm_w`` unit grid, largest first (Qwen2.5-VL's windows:
    ``window x window`` units from the top left, the last row and column of windows cut by the grid)."""
    w = shape.window
    rows = [min(w, llm_h - start) for start in range(0, llm_h, w)]
    cols = [min(w, llm_w - start) for start in range(0, llm_w, w)]
    return sorted((r * c for r in rows for c in cols), reverse=True)


def _attention_squares(sizes: list[int], units: int) -> int:
    """The most ``sum(n_k^2)`` over windows holding ``units`` units in all, window ``k`` at most ``sizes[k]``
    (``sizes`` largest first): the largest windows full. A unit merge leaves a unit in the window of the unit it
    joined, so windows only lose units; which ones lose them depends on the video, so this is the bound (exact at
    ``units == sum(sizes)``)."""
    total, left = 0, units
    for size in sizes:
        taken = min(size, left)
        total, left = total + taken * taken, left - taken
    return total


def tower_macs(config, grid: tuple[int, int, int], schedule: dict | None = None) -> int:
    """Multiply-accumulates of the matrix products of a Qwen vision tower (with TESTA's schedule, or stock) on one
    video of ``grid = (t, h, w)`` (a ``video_grid_thw`` row: tubelets, patch rows, patch columns): what
    ``torch.utils.flop_counter`` counts (half its FLOPs), deterministic, for any machine.

    Counted: the patch embedding; in every block ``qkv`` and ``proj`` on the tokens entering it, attention
    (``Q K^T`` and ``A V``) within each tubelet (Qwen2.5-VL's window blocks: within each window, at most the sum
    over full windows, see `_attention_squares`), TESTA's matching products (the bipartite scores of the even
    against the odd tubelets / units, on keys averaged over heads), the MLP on the tokens the block keeps;
    Qwen3-VL's DeepStack mergers after their blocks; the patch merger on the units that leave. Not counted: norms,
    the rotary, activations, the merges' averages, learned position embeddings (no matrix products; a small part).

    Args:
        config: the model, its config, its vision config or a `QwenTowerShape`.
        grid: ``(t, h, w)``; ``h`` and ``w`` even.
        schedule: ``{"temporal_reduction": ..., "spatial_reduction": ...}`` as `apply_testa` takes them (an int or
            one int per block; missing: 0); None: the stock tower.
    """
    shape = QwenTowerShape.of(config)
    t, h, w = grid
    if min(t, h, w) < 1 or h % 2 or w % 2:
        raise ValueError(f"grid={grid!r} must be (t, h, w) positive, h and w even (2x2 merge units).")
    slices, units = t, h * w // 4
    counts = _block_grids(shape.depth, slices, units, schedule)
    d, heads = shape.hidden_size, shape.num_heads
    head_dim = d // heads
    mlp = (3 if shape.family == "qwen2_5_vl" else 2) * d * shape.intermediate_size
    merger = 4 * d * 4 * d + 4 * d * shape.out_hidden_size
    windows = _window_sizes(shape, h // 2, w // 2) if shape.window is not None else None
    macs = slices * units * 4 * shape.in_channels * shape.temporal_patch_size * shape.patch_size ** 2 * d
    for index, ((s_in, u_in), (s_mid, _), (s_out, u_out)) in enumerate(counts):
        tokens_in = s_in * u_in * 4
        macs += 4 * d * d * tokens_in
        if windows is None or index in shape.full_attention_blocks:
            squares = (4 * u_in) ** 2
        else:
            squares = 16 * _attention_squares(windows, u_in)
        macs += 2 * s_in * squares * d
        if s_mid < s_in:  # tubelets matched: one key per tubelet
            macs += math.ceil(s_in / 2) * (s_in // 2) * head_dim
        if u_out < u_in:  # units matched within each remaining tubelet
            macs += s_mid * math.ceil(u_in / 2) * (u_in // 2) * head_dim
        macs += s_out * u_out * 4 * mlp
        if index in shape.deepstack_blocks:
            macs += s_out * u_out * merger
    s_last, u_last = counts[-1][2]
    return macs + s_last * u_last * merger


def _block_grids(depth: int, slices: int, units: int, schedule: dict | None):
    """Per block: ``(slices, units)`` entering, after its tubelet merge, after its unit merge (TESTA's caps)."""
    from .common import video_settings

    schedule = schedule or {}
    settings = video_settings(depth, schedule.get("temporal_reduction", 0), schedule.get("spatial_reduction", 0))
    grids, s, u = [], slices, units
    for index in range(depth):
        r_t, r_s = settings.reductions(index)
        s_mid = s - min(r_t, (s - 1) // 2)
        u_out = u - min(r_s, u // 2)
        grids.append(((s, u), (s_mid, u), (s_mid, u_out)))
        s, u = s_mid, u_out
    return grids


def plan_for_tower_budget(config, frames: int, budget_frames: int, *, height: int, width: int,
                          temporal_share: float = 0.5, first_block: int = 0, merge_blocks: int | None = None
                          ) -> dict[str, list[int]]:
    """"Fit ``frames`` frames in the tower compute of ``budget_frames`` frames": the `plan_kept_fraction` schedule
    (for `apply_testa`) that gives the LLM the most video tokens while the tower's multiply-accumulates on
    ``frames`` frames of ``height x width`` px (`tower_macs`) stay at most the stock tower's on ``budget_frames``
    frames of the same size. Deterministic: compute is counted, never timed (tower time follows it where the matrix
    products dominate, as in these towers; not measured here).

    **Rule.** Candidates: `plan_kept_fraction` at every kept token count ``k`` (the largest within the budget, by
    bisection on ``k``: more tokens kept cost more), the merges spread over ``merge_blocks`` blocks from
    ``first_block`` on; with ``merge_blocks=None`` over every spread from 1 block to all of them. The one with the
    most tokens left wins; ties go to the longer spread (gentler merging), then fewer MACs. Merges spread over all
    blocks keep about half the compute of the frames at best (a block's tokens fall evenly from all to the kept
    ones), so budgets under about half the frames are met by spreads over fewer, earlier blocks; and the most tokens
    come from merging early, which the default therefore does: give ``merge_blocks`` for a gentler schedule with
    fewer tokens. ``frames <= budget_frames``: R = 0 (the stock tower fits).

    Args:
        config: the model, its config or its vision config (Qwen2.5-VL, Qwen3-VL), or a `QwenTowerShape`.
        frames: the video's frames (a multiple of the tower's ``temporal_patch_size``).
        budget_frames: the frames whose stock tower compute is the budget (the same multiple).
        height, width: the frames' size after the processor's resize, px (multiples of ``2 * patch_size``).
        temporal_share: how much of the reduction comes from merging tubelets, in [0, 1] (`plan_kept_fraction`).
        first_block: no merge before this block.
        merge_blocks: spread the merges over this many blocks (None: the spread that keeps the most tokens).

    Raises:
        ValueError: bad arguments (naming them), or a budget that no schedule within TESTA's caps meets.
    """
    shape = QwenTowerShape.of(config)
    for name, value in (("frames", frames), ("budget_frames", budget_frames), ("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}.")
    step = shape.temporal_patch_size
    for name, value in (("frames", frames), ("budget_frames", budget_frames)):
        if value % step:
            raise ValueError(f"{name}={value} must be a multiple of the tower's temporal_patch_size ({step}).")
    for name, value in (("height", height), ("width", width)):
        if value % (2 * shape.patch_size):
            raise ValueError(f"{name}={value} px must be a multiple of {2 * shape.patch_size} (2x2 units of "
                             f"{shape.patch_size} px patches).")
    if not 0 <= temporal_share <= 1:
        raise ValueError(f"temporal_share={temporal_share!r} must be in [0, 1].")
    if not 0 <= first_block < shape.depth:
        raise ValueError(f"first_block={first_block!r} must be a block of the tower (0 .. {shape.depth - 1}).")
    most = shape.depth - first_block
    if merge_blocks is not None and (isinstance(merge_blocks, bool) or not isinstance(merge_blocks, int)
                                     or not 1 <= merge_blocks <= most):
        raise ValueError(f"merge_blocks={merge_blocks!r} must be None or an int in 1 .. {most} (the blocks from "
                         f"first_block={first_block}).")
    h, w = height // shape.patch_size, width // shape.patch_size
    slices, units = frames // step, h * w // 4
    if frames <= budget_frames:
        return {"temporal_reduction": [0] * shape.depth, "spatial_reduction": [0] * shape.depth}
    budget = tower_macs(shape, (budget_frames // step, h, w))
    total = slices * units

    def plan_at(kept: int, blocks: int):
        """``(plan, tokens left, MACs)`` of the kept-fraction plan at ``kept`` tokens; None beyond TESTA's caps."""
        try:
            plan = plan_kept_fraction(shape.depth, slices, units, kept / total, temporal_share=temporal_share,
                                      first_block=first_block, merge_blocks=blocks)
        except ValueError:
            return None
        left = [s * u for s, u in [_block_grids(shape.depth, slices, units, plan)[-1][2]]][0]
        return plan, left, tower_macs(shape, (slices, h, w), plan)

    best = None  # (tokens left, blocks, -MACs, plan)
    for blocks in [merge_blocks] if merge_blocks is not None else range(1, most + 1):
        low, high = 1, total  # the largest kept count that is not over the budget (beyond the caps: too few kept)
        while low < high:
            middle = (low + high + 1) // 2
            found = plan_at(middle, blocks)
            if found is None or found[2] <= budget:
                low = middle
            else:
                high = middle - 1
        found = plan_at(low, blocks)
        if found is None or found[2] > budget:
            continue
        plan, left, macs = found
        key = (left, blocks, -macs)
        if best is None or key > best[:3]:
            best = (*key, plan)
    if best is None:
        raise ValueError(
            f"{frames} frames cannot fit in the tower compute of {budget_frames} frames (merges from "
            f"first_block={first_block}, merge_blocks={merge_blocks!r}): TESTA's caps (at most half the units and "
            "(T - 1) // 2 tubelets per block) cannot remove enough; give a larger budget_frames, fewer frames, an "
            "earlier first_block or more merge_blocks."
        )
    return best[3]


__all__ = ["QwenTowerShape", "plan_for_tower_budget", "plan_grid", "plan_kept_fraction", "spread", "tower_macs"]
