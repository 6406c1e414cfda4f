"""TESTA inside the vision tower of Qwen2.5-VL and Qwen3-VL (transformers 5.x), for videos.

The tower runs the model's own modules (patch embedding, blocks' norms, ``qkv``, ``proj``, MLPs, mergers) on a
layout that can shrink:

* **Units and slices.** A video of grid ``(t, h, w)`` (tubelets of 2 frames, 14 / 16 px patches) enters as ``t``
  slices (tubelets) of ``h * w / 4`` units; a unit is the 2x2 group of tokens that the patch merger concatenates
  (4 consecutive tokens, block order), so every merge moves whole units and the merger stays valid.
* **Where merges happen.** In a block whose R_T / R_S is not 0, after attention and its residual and before the MLP
  (TESTA's placement): first R_T slices merge into their most similar slices (all units of a slice together, a
  slice's metric the mean of its units' keys), then R_S units within every slice (`video_llms.common`), by bipartite
  matching on the attention keys *before* the 2D rotary (rotated keys would compare positions, not content), averaged
  over heads and over a unit's 4 tokens. Features are size-weighted means.
* **Positions kept.** Every unit carries its centroid ``(tubelet index, unit row, unit column)``, the size-weighted
  mean of the units merged into it. The tower's 2D rotary of a unit's 4 tokens is taken at that centroid (``2 * row
  + i, 2 * col + j``; the rotary accepts fractional positions), and the LLM's M-RoPE of the unit's token at
  ``(floor(tubelet * interval), round(row), round(column))`` (see `video_llms.qwen2_5_vl`).
* **Attention segments rebuilt.** Full-attention blocks attend within every slice (``cu_seqlens`` from the slices'
  current sizes). Qwen2.5-VL's window blocks attend within windows: every unit keeps the window of its position
  (a merged unit the window of the unit it joined), units are kept sorted by window within their slice, and
  ``cu_window_seqlens`` are the runs of equal windows. At R = 0 this is exactly transformers' window permutation.
* **Output order.** The merger's tokens leave sorted by centroid: time, then row, then column (at R = 0 the stock
  order). Qwen3-VL's DeepStack features are tapped where the stock tower taps them (after the block, through its
  DeepStack merger), one per unit, and merged alike by every later merge, so they stay aligned with the tokens.

At R = 0 every block computes what the stock tower computes (the tests check 1e-5 in fp32 and equal greedy tokens).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from .common import TokenGroups, aggregate, chronological_order

UNIT = 4
"""Tokens per unit: the 2x2 group that Qwen's patch merger concatenates (``spatial_merge_size = 2``)."""


@dataclass
class VideoFeatures:
    """What the tower gives one video: ``features (tokens, out)`` for the LLM, in order; ``positions (tokens, 3)``
    float centroids ``(tubelet, unit row, unit column)``; ``sizes (tokens,)``: how many input units every token
    stands for; ``deepstack`` (Qwen3-VL): ``(tokens, out)`` per tapped block; ``grid``: ``(slices, units per slice)``
    left."""

    features: torch.Tensor
    positions: torch.Tensor
    sizes: torch.Tensor
    deepstack: list = field(default_factory=list)
    grid: tuple[int, int] = (0, 0)


def window_labels(llm_h: int, llm_w: int, window: int, device) -> torch.Tensor:
    """The window of every unit of an ``llm_h x llm_w`` unit grid (raster order), numbered as
    `transformers.vision_utils.get_vision_window_index` lays them out: windows of ``window x window`` units in raster
    order over the grid padded to whole windows."""
    windows_w = (llm_w + window - llm_w % window) // window
    rows = torch.arange(llm_h, device=device).view(-1, 1) // window
    cols = torch.arange(llm_w, device=device).view(1, -1) // window
    return (rows * windows_w + cols).flatten()


def initial_groups(hidden: torch.Tensor, grid: tuple[int, int, int], window: int | None) -> TokenGroups:
    """One video's embedded patches ``(t * h * w, C)`` (transformers' block order) as :class:`TokenGroups` of
    ``t`` slices of ``h * w / 4`` units, positions ``(tubelet, row, column)``; with a ``window`` (Qwen2.5-VL, in
    units) every slice's units sorted by window, as the stock tower permutes them."""
    t, h, w = grid
    llm_h, llm_w = h // 2, w // 2
    units = llm_h * llm_w
    device = hidden.device
    tokens = hidden.view(t, units, UNIT * hidden.shape[-1])
    rows = torch.arange(llm_h, device=device).repeat_interleave(llm_w)
    cols = torch.arange(llm_w, device=device).repeat(llm_h)
    times = torch.arange(t, device=device)
    positions = torch.stack(
        [times.view(t, 1).expand(t, units), rows.expand(t, units), cols.expand(t, units)], dim=-1
    ).float()
    sizes = torch.ones(t, units, device=device)
    labels = None
    if window is not None:
        labels = window_labels(llm_h, llm_w, window, device)
        order = labels.argsort(stable=True)
        tokens, positions, labels = tokens[:, order], positions[:, order], labels[order].expand(t, units)
    return TokenGroups(tokens, sizes, positions, labels)


def rotary_positions(groups: TokenGroups) -> torch.Tensor:
    """``(tokens, 2)`` float (h, w) patch positions of every token, in layout order: the unit centroid's 2x2 patches
    (block order within the unit, as transformers' `get_vision_position_ids`)."""
    rows, cols = groups.positions[..., 1], groups.positions[..., 2]
    offsets = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]], dtype=rows.dtype, device=rows.device)
    h = 2 * rows.unsqueeze(-1) + offsets[:, 0]
    w = 2 * cols.unsqueeze(-1) + offsets[:, 1]
    return torch.stack([h, w], dim=-1).reshape(-1, 2)


def slice_seqlens(videos: list[TokenGroups]) -> torch.Tensor:
    """``cu_seqlens`` of attention within every slice of every video."""
    lengths = [torch.full((g.grid[0],), g.grid[1] * UNIT, dtype=torch.int32) for g in videos]
    return F.pad(torch.cat(lengths).cumsum(0, dtype=torch.int32), (1, 0))


def window_seqlens(videos: list[TokenGroups]) -> torch.Tensor:
    """``cu_seqlens`` of attention within every window of every slice: the runs of equal window labels (units are
    kept sorted by window within a slice)."""
    counts = []
    for groups in videos:
        slices, units = groups.grid
        windows = int(groups.labels.max()) + 1
        key = (torch.arange(slices, device=groups.labels.device).view(-1, 1) * windows + groups.labels).flatten()
        counts.append(torch.unique_consecutive(key.cpu(), return_counts=True)[1] * UNIT)
    return F.pad(torch.cat(counts).cumsum(0, dtype=torch.int32), (1, 0))


def attention(attn, hidden: torch.Tensor, cu_seqlens: torch.Tensor, rotary, family) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's attention as `Qwen2_5_VLVisionAttention.forward` / `Qwen3VLVisionAttention.forward` compute it
    (the same modules and attention interface: SDPA, eager or FlashAttention), plus the keys before the rotary
    ``(tokens, heads, head_dim)``. ``family`` is the transformers modeling module (its rotary and eager helpers)."""
    seq_length = hidden.shape[0]
    query, key, value = attn.qkv(hidden).reshape(seq_length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    keys = key
    cos, sin = rotary
    query, key = family.apply_rotary_pos_emb_vision(query, key, cos, sin)
    query, key, value = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, family.eager_attention_forward)
    dropout = 0.0 if not attn.training else attn.attention_dropout
    if is_flash_attention_requested(attn.config):
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        output, _ = interface(
            attn, query, key, value, attention_mask=None, scaling=attn.scaling, dropout=dropout,
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen,
            is_causal=False,
        )
    else:  # as the stock tower: one call per segment
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        splits = [torch.split(x, lengths, dim=2) for x in (query, key, value)]
        output = torch.cat([
            interface(attn, q, k, v, attention_mask=None, scaling=attn.scaling, dropout=dropout, is_causal=False)[0]
            for q, k, v in zip(*splits)
        ], dim=1)
    return attn.proj(output.reshape(seq_length, -1).contiguous()), keys


def unit_keys(keys: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``(tokens, heads, head_dim)`` keys of one video -> one key per unit ``(slices, units, head_dim)``: the mean
    over heads (as TESTA's blocks) and over the unit's 4 tokens."""
    slices, units = grid
    return keys.mean(dim=1).view(slices, units, UNIT, -1).mean(dim=2)


def sequence(videos: list[TokenGroups], hidden_size: int) -> torch.Tensor:
    parts = [g.tokens.reshape(-1, hidden_size) for g in videos]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def split_sequence(hidden: torch.Tensor, videos: list[TokenGroups]) -> list[torch.Tensor]:
    """Views of the sequence, one ``(slices, units, 4 * C)`` per video."""
    sizes = [g.grid[0] * g.grid[1] * UNIT for g in videos]
    return [part.view(*g.grid, -1) for part, g in zip(hidden.split(sizes), videos)]


def slice_order(groups: TokenGroups) -> torch.Tensor:
    """The output order slice by slice: slices by their size-weighted mean time, then every slice's units by
    (row, column) centroid. At R = 0 the stock order."""
    slices, units = groups.grid
    times = (groups.positions[..., 0] * groups.sizes).sum(1) / groups.sizes.sum(1)
    slice_rank = chronological_order(times.unsqueeze(-1))
    within = torch.stack([chronological_order(groups.positions[s, :, 1:]) for s in range(slices)])
    return (slice_rank.view(-1, 1) * units + within[slice_rank]).flatten()


def run_tower(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor, settings, family,
              window: int | None = None, full_attention_blocks=(), deepstack_blocks=(), deepstack_mergers=None,
              position_embedding=None, by_slice: bool = False) -> list[VideoFeatures]:
    """Runs a Qwen vision tower over ``pixel_values`` of the videos of ``grid_thw`` with TESTA's aggregation.

    Args:
        visual: the tower (`Qwen2_5_VisionTransformerPretrainedModel` / `Qwen3VLVisionModel`).
        settings: `AggregationSettings` for its blocks.
        family: the transformers modeling module of the model.
        window: Qwen2.5-VL's window in units (``window_size // 2 // patch_size``), None for full attention only;
            then ``full_attention_blocks`` are the blocks that attend over the whole slice.
        deepstack_blocks, deepstack_mergers: Qwen3-VL's tapped blocks and their mergers.
        position_embedding: Qwen3-VL's learned positions, ``(tokens, C)`` in the input order, added to the patches.
        by_slice: order the output slice by slice (`slice_order`: Qwen3-VL's prompt has one group of tokens per
            tubelet), else token by token (`common.chronological_order`).
    """
    hidden = visual.patch_embed(pixel_values.type(visual.dtype))
    if position_embedding is not None:
        hidden = hidden + position_embedding.to(hidden.dtype)
    hidden_size = hidden.shape[-1]
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    parts = hidden.split([t * h * w for t, h, w in grids])
    videos = [initial_groups(part, grid, window) for part, grid in zip(parts, grids)]
    rotary = seqlens = windows = None
    sequence_now = sequence(videos, hidden_size)
    for index, block in enumerate(visual.blocks):
        if rotary is None:  # after a merge: positions and segments of the tokens that remain
            rotary = visual.rotary_pos_emb(sequence_now, torch.cat([rotary_positions(g) for g in videos]))
            seqlens = slice_seqlens(videos).to(hidden.device)
            windows = window_seqlens(videos).to(hidden.device) if window is not None else None
        cu_seqlens = seqlens if window is None or index in full_attention_blocks else windows
        output, keys = attention(block.attn, block.norm1(sequence_now), cu_seqlens, rotary, family)
        sequence_now = sequence_now + output
        r_t, r_s = settings.reductions(index)
        if r_t or r_s:
            key_parts = keys.split([g.grid[0] * g.grid[1] * UNIT for g in videos])
            for i, (groups, tokens, key) in enumerate(zip(videos, split_sequence(sequence_now, videos), key_parts)):
                groups.tokens = tokens
                videos[i] = aggregate(groups, unit_keys(key, groups.grid), settings, index)
            sequence_now = sequence(videos, hidden_size)
            rotary = None
        sequence_now = sequence_now + block.mlp(block.norm2(sequence_now))
        for groups, tokens in zip(videos, split_sequence(sequence_now, videos)):
            groups.tokens = tokens
        if index in deepstack_blocks:
            tapped = deepstack_mergers[list(deepstack_blocks).index(index)](sequence_now)
            start = 0
            for groups in videos:
                count = groups.grid[0] * groups.grid[1]
                groups.carried.append(tapped[start:start + count].view(*groups.grid, -1))
                start += count
    merged = visual.merger(sequence_now)
    results, start = [], 0
    for groups in videos:
        count = groups.grid[0] * groups.grid[1]
        positions = groups.positions.reshape(count, 3)
        order = slice_order(groups) if by_slice else chronological_order(positions)
        results.append(VideoFeatures(
            features=merged[start:start + count][order],
            positions=positions[order],
            sizes=groups.sizes.reshape(count)[order],
            deepstack=[t.reshape(count, -1)[order] for t in groups.carried],
            grid=groups.grid,
        ))
        start += count
    return results


__all__ = ["UNIT", "VideoFeatures", "attention", "initial_groups", "run_tower", "window_labels"]
