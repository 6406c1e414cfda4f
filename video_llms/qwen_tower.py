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

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.generic import is_flash_attention_requested

from modeling_testa.aggregation import capped_reduction
from modeling_testa.aggregation_block import match_frames

from .common import TokenGroups, aggregate, check_chunk_offload, chronological_order, merge_units

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
    last_hidden: torch.Tensor | None = None
    """``(tokens * 4, C)``: the last block's output that the merger read, its 4 rows per output token in the output
    order; None from a chunked run, which never holds a whole video's hidden states."""


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


def _store(videos: list[TokenGroups], sequence_now: torch.Tensor) -> None:
    """Every video's ``tokens`` as views of the sequence."""
    for groups, tokens in zip(videos, split_sequence(sequence_now, videos)):
        groups.tokens = tokens


def _release(videos: list[TokenGroups]) -> None:
    """Drops the videos' own references to their tokens once the sequence holds them (a shape-only stand-in on the
    meta device keeps ``grid``): otherwise the previous block's hidden states would stay alive beside the new ones
    until the next write-back (`_store`)."""
    for groups in videos:
        groups.tokens = torch.empty(groups.tokens.shape, dtype=groups.tokens.dtype, device="meta")


def advance(visual, videos: list[TokenGroups], settings, family, first: int = 0, *, resume: bool = False,
            stop_at_temporal: bool = False, window: int | None = None, full_attention_blocks=(), deepstack_blocks=(),
            deepstack_mergers=None) -> tuple[int | None, list[torch.Tensor] | None]:
    """Runs the tower's blocks from ``first`` on ``videos``: their ``tokens`` updated in place, a merged video's
    groups replaced in the list.

    Memory: one sequence of hidden states is alive between blocks (the videos' ``tokens`` are written back only
    where a merge or the caller reads them), and a block's attention keys are dropped (or reduced to one key per
    unit for its merges) before its MLP, so a block holds what the stock block holds.

    Args:
        resume: start with block ``first``'s MLP (its attention and merges already done: after the caller's
            temporal merge, `run_tower_chunked`).
        stop_at_temporal: stop in the first block (after ``first``'s attention when not resuming) whose R_T is not 0,
            after its attention and residual and before its merges, so that the caller can match slices across
            videos' parts (`run_tower_chunked`).
        (the rest as `run_tower`)

    Returns:
        ``(block, unit keys per video)`` where it stopped, or ``(None, None)`` after the last block.
    """
    hidden_size = videos[0].tokens.shape[-1] // UNIT
    sequence_now = sequence(videos, hidden_size)
    _release(videos)
    rotary = seqlens = windows = None
    for index in range(first, len(visual.blocks)):
        block = visual.blocks[index]
        if not (resume and index == first):
            if rotary is None:  # at the start or after a merge: positions and segments of the tokens that remain
                rotary = visual.rotary_pos_emb(sequence_now, torch.cat([rotary_positions(g) for g in videos]))
                seqlens = slice_seqlens(videos).to(sequence_now.device)
                windows = window_seqlens(videos).to(sequence_now.device) if window is not None else None
            cu_seqlens = seqlens if window is None or index in full_attention_blocks else windows
            output, keys = attention(block.attn, block.norm1(sequence_now), cu_seqlens, rotary, family)
            sequence_now = sequence_now + output
            del output
            r_t, r_s = settings.reductions(index)
            if not (r_t or r_s):
                del keys  # (a view of the block's qkv: three times the hidden states, not needed in the MLP)
            else:
                key_parts = [unit_keys(key, g.grid) for key, g in
                             zip(keys.split([g.grid[0] * g.grid[1] * UNIT for g in videos]), videos)]
                del keys
                _store(videos, sequence_now)
                del sequence_now
                if r_t and stop_at_temporal:
                    return index, key_parts
                for i, (groups, key) in enumerate(zip(videos, key_parts)):
                    videos[i] = aggregate(groups, key, settings, index)
                del groups, key_parts
                sequence_now = sequence(videos, hidden_size)
                _release(videos)
                rotary = None
        sequence_now = sequence_now + block.mlp(block.norm2(sequence_now))
        if index in deepstack_blocks:
            tapped = deepstack_mergers[list(deepstack_blocks).index(index)](sequence_now)
            start = 0
            for groups in videos:
                count = groups.grid[0] * groups.grid[1]
                groups.carried.append(tapped[start:start + count].view(*groups.grid, -1))
                start += count
    _store(videos, sequence_now)
    return None, None


def output_order(groups: TokenGroups, by_slice: bool) -> torch.Tensor:
    """The layout row of a video's every output token, in output order: slice by slice (`slice_order`, Qwen3-VL's
    one prompt group per tubelet), else token by token by centroid (`common.chronological_order`). Reads only the
    groups' positions, sizes and grid."""
    if by_slice:
        return slice_order(groups)
    return chronological_order(groups.positions.reshape(groups.grid[0] * groups.grid[1], 3))


def video_features(groups: TokenGroups, merger_input: torch.Tensor, merger, by_slice: bool) -> VideoFeatures:
    """One video's `VideoFeatures` from its final groups and the merger's ``(slices * units * 4, C)`` input rows
    (layout order): the rows are put in output order once, and the merger runs on them there, so that
    ``last_hidden`` is the very tensor the merger read and no reordering copy of its outputs is made."""
    count = groups.grid[0] * groups.grid[1]
    positions = groups.positions.reshape(count, 3)
    order = output_order(groups, by_slice)
    last_hidden = merger_input.reshape(count, UNIT, -1)[order].reshape(count * UNIT, -1)
    return VideoFeatures(
        features=merger(last_hidden),
        positions=positions[order],
        sizes=groups.sizes.reshape(count)[order],
        deepstack=[t.reshape(count, -1)[order] for t in groups.carried],
        grid=groups.grid,
        last_hidden=last_hidden,
    )


def run_tower(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor, settings, family,
              window: int | None = None, full_attention_blocks=(), deepstack_blocks=(), deepstack_mergers=None,
              position_embedding=None, by_slice: bool = False, chunk_slices: int | None = None,
              chunk_offload: str | None = None) -> list[VideoFeatures]:
    """Runs a Qwen vision tower over ``pixel_values`` of the videos of ``grid_thw`` with TESTA's aggregation.

    Args:
        visual: the tower (`Qwen2_5_VisionTransformerPretrainedModel` / `Qwen3VLVisionModel`).
        settings: `AggregationSettings` for its blocks.
        family: the transformers modeling module of the model.
        window: Qwen2.5-VL's window in units (``window_size // 2 // patch_size``), None for full attention only;
            then ``full_attention_blocks`` are the blocks that attend over the whole slice.
        deepstack_blocks, deepstack_mergers: Qwen3-VL's tapped blocks and their mergers.
        position_embedding: Qwen3-VL's learned positions: a function of a ``(videos, 3)`` grid giving ``(tokens, C)``
            in the input order, added to the patches.
        by_slice: order the output slice by slice (`slice_order`: Qwen3-VL's prompt has one group of tokens per
            tubelet), else token by token (`common.chronological_order`).
        chunk_slices: run every video through the tower that many slices (tubelets) at a time
            (`run_tower_chunked`); None: all videos at once.
        chunk_offload: with ``chunk_slices``, where the whole video waits at a temporal merge (`SliceShelf`).
    """
    options = dict(window=window, full_attention_blocks=full_attention_blocks, deepstack_blocks=deepstack_blocks,
                   deepstack_mergers=deepstack_mergers)
    if chunk_slices is not None:
        return run_tower_chunked(visual, pixel_values, grid_thw, settings, family, chunk_slices,
                                 position_embedding=position_embedding, by_slice=by_slice, offload=chunk_offload,
                                 **options)
    hidden = embed(visual, pixel_values, grid_thw, position_embedding)
    hidden_size = hidden.shape[-1]
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    videos = [initial_groups(part, grid, window) for part, grid in
              zip(hidden.split([t * h * w for t, h, w in grids]), grids)]
    del hidden  # (the groups hold it, until the first block's residual replaces it)
    advance(visual, videos, settings, family, **options)
    return [video_features(groups, groups.tokens.reshape(-1, hidden_size), visual.merger, by_slice)
            for groups in videos]


def embed(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor, position_embedding=None) -> torch.Tensor:
    """The patch embedding of ``pixel_values`` (plus Qwen3-VL's learned positions for ``grid_thw``)."""
    hidden = visual.patch_embed(pixel_values.type(visual.dtype))
    if position_embedding is not None:
        hidden = hidden + position_embedding(grid_thw).to(hidden.dtype)
    return hidden


# ----------------------------------------------------------------------------------------------------------------------
# Chunks of frames
# ----------------------------------------------------------------------------------------------------------------------


def chunked_video_features(parts: list[TokenGroups], by_slice: bool) -> VideoFeatures:
    """`video_features` of one video whose finished parts (its slices in order, each holding the merger's outputs
    as ``tokens (slices, units, out)``) are ``parts``, emptied as it goes: the output tensors are made once and
    every part is copied to its rows and dropped, so the video's outputs exist once (a concatenation followed by
    the reordering copy would hold them two or three times over: at 256 frames that is Qwen3-VL's largest
    allocation, with its DeepStack features)."""
    units = parts[0].grid[1]
    slices = sum(part.grid[0] for part in parts)
    count = slices * units
    sizes, positions = torch.cat([p.sizes for p in parts]), torch.cat([p.positions for p in parts])
    # the whole video's layout without its features (a shape-only stand-in): all `output_order` reads
    order = output_order(TokenGroups(torch.empty((slices, units, 0), device="meta"), sizes, positions), by_slice)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(count, device=order.device)  # layout row -> output row
    first = parts[0]
    features = first.tokens.new_empty((count, first.tokens.shape[-1]))
    deepstack = [t.new_empty((count, t.shape[-1])) for t in first.carried]
    start = 0
    for part in taken(parts):
        n = part.grid[0] * units
        rows = row_of[start:start + n]
        features[rows] = part.tokens.reshape(n, -1)
        for out, tapped in zip(deepstack, part.carried):
            out[rows] = tapped.reshape(n, -1)
        start += n
        del part
    return VideoFeatures(features=features, positions=positions.reshape(count, 3)[order],
                         sizes=sizes.reshape(count)[order], deepstack=deepstack, grid=(slices, units))


@dataclass
class SliceRecord:
    """One slice of a video held apart from the others (its own tensors, so that it is freed on its own):
    ``tokens (units, D)``, ``sizes (units,)``, ``positions (units, 3)``, ``labels (units,)`` or None, ``carried``
    ``(units, E)`` each, ``keys (units, C)`` (one key per unit at the block where the video stopped)."""

    tokens: torch.Tensor
    sizes: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor | None
    carried: list
    keys: torch.Tensor


def slice_records(groups: TokenGroups, keys: torch.Tensor) -> list[SliceRecord]:
    """A part of a video as one `SliceRecord` per slice (copies: the part's own tensors can be freed)."""
    return [SliceRecord(groups.tokens[i].clone(), groups.sizes[i].clone(), groups.positions[i].clone(),
                        None if groups.labels is None else groups.labels[i].clone(),
                        [t[i].clone() for t in groups.carried], keys[i].clone())
            for i in range(groups.grid[0])]


class SliceShelf:
    """Where a video's slices wait, one `SliceRecord` each, while every chunk reaches a temporal merge: the only
    place where a chunked tower holds the whole video. ``where``: None keeps them as they are (on the tower's
    device); ``"cpu"`` moves their hidden states and carried features to host memory (a GPU then holds one chunk);
    ``"disk"`` writes them to a temporary directory (`tempfile`'s; removed by `close`) and reads each back, and
    deletes its file, when it merges (host memory then holds one chunk too). Sizes, positions, labels and keys (a
    few numbers per unit, which the matching needs for all slices at once) stay. The tensors come back as they
    were written, so the outputs are the same with every ``where``."""

    def __init__(self, where: str | None):
        self.where, self.count = check_chunk_offload(where), 0
        # A failed clean-up (a file still open elsewhere) must not hide the error the tower may be raising.
        self.directory = (tempfile.TemporaryDirectory(prefix="testa-tower-", ignore_cleanup_errors=True)
                          if where == "disk" else None)

    def put(self, record: SliceRecord) -> SliceRecord:
        if self.where == "cpu":
            return replace(record, tokens=record.tokens.cpu(), carried=[t.cpu() for t in record.carried])
        if self.where == "disk":
            path = os.path.join(self.directory.name, f"{self.count}.pt")
            self.count += 1
            torch.save({"tokens": record.tokens, "carried": record.carried}, path)
            return replace(record, tokens=path, carried=None)
        return record

    def get(self, record: SliceRecord) -> SliceRecord:
        """The record with its tensors back where its keys are (they never left the device its block ran on)."""
        device = record.keys.device
        if self.where == "cpu":
            return replace(record, tokens=record.tokens.to(device), carried=[t.to(device) for t in record.carried])
        if self.where == "disk":
            saved = torch.load(record.tokens, map_location=device, weights_only=True)
            os.remove(record.tokens)
            return replace(record, tokens=saved["tokens"], carried=saved["carried"])
        return record

    def close(self) -> None:
        if self.directory is not None:
            self.directory.cleanup()


def stack_records(records: list[SliceRecord]) -> tuple[TokenGroups, torch.Tensor]:
    """Slices as one `TokenGroups` (in order) and their keys."""
    labels = None if records[0].labels is None else torch.stack([r.labels for r in records])
    groups = TokenGroups(torch.stack([r.tokens for r in records]), torch.stack([r.sizes for r in records]),
                         torch.stack([r.positions for r in records]), labels,
                         [torch.stack(tensors) for tensors in zip(*(r.carried for r in records))])
    return groups, torch.stack([r.keys for r in records])


def size_weighted_mean(x_t: torch.Tensor, xs: list[torch.Tensor], shares: list[torch.Tensor]) -> torch.Tensor:
    """The size-weighted mean of a kept slice's ``x_t`` and the slices merged into it (``xs``, each with its
    ``(units,)`` share of the merged size), as ``x_t + sum(share * (x - x_t))``."""
    out = x_t.clone()
    for x, share in zip(xs, shares):
        out += (x - x_t) * share.to(x.dtype).unsqueeze(-1)
    return out


def merge_slice_records(records: list, settings, block: int, chunk_slices: int,
                        shelf: SliceShelf | None = None) -> Iterator[TokenGroups]:
    """Block ``block``'s aggregation (`common.aggregate`) of a whole video held as one `SliceRecord` per slice,
    yielded as parts of ``chunk_slices`` slices. The slices are matched on all their keys (`common.merge_slices`'
    matching: the one-pass merge, chunk edges included); every output slice is then made from its kept slice and the
    slices merged into it as `aggregation.merge_tokens` makes it (``x_t + sum_j (x_j - x_t) s_j / S_t``, per unit,
    with its own size weight; the kept slice's window labels), and the records it used are dropped (``records``
    entries become None). So the video's hidden states exist about once while they merge, not twice (a
    concatenation, the merged copy, the parts). The unit merges of the block run on every part (they stay within a
    slice). The parts are made as they are asked for, each record taken off ``shelf`` (`SliceShelf.get`) when its
    output slice is made: until then it waits where the shelf keeps it."""
    r_t, r_s = settings.reductions(block)
    count = len(records)
    r = capped_reduction(r_t, count, protected=1)
    if r:
        matching = match_frames(settings, torch.stack([rec.keys for rec in records], dim=1).unsqueeze(0), None, r)
        kept, sources, targets = (m[0].tolist() for m in (matching.kept, matching.sources, matching.targets))
    else:
        kept, sources, targets = list(range(count)), [], []
    into = [[] for _ in kept]
    for source, target in zip(sources, targets):
        into[target].append(source)
    shelf = shelf or SliceShelf(None)
    pending = []
    for slot, index in enumerate(kept):
        target, merged_in = shelf.get(records[index]), [shelf.get(records[i]) for i in into[slot]]
        records[index] = None
        for i in into[slot]:
            records[i] = None
        if merged_in:
            sizes = target.sizes + sum(rec.sizes for rec in merged_in)
            shares = [rec.sizes / sizes for rec in merged_in]
            target = SliceRecord(
                size_weighted_mean(target.tokens, [rec.tokens for rec in merged_in], shares), sizes,
                size_weighted_mean(target.positions, [rec.positions for rec in merged_in], shares), target.labels,
                [size_weighted_mean(t, [rec.carried[i] for rec in merged_in], shares)
                 for i, t in enumerate(target.carried)],
                size_weighted_mean(target.keys, [rec.keys for rec in merged_in], shares))
        del merged_in
        pending.append(target)
        if len(pending) == chunk_slices or slot == len(kept) - 1:
            groups, keys = stack_records(pending)
            pending.clear()
            groups, _ = merge_units(groups, keys, r_s, settings)
            del keys
            yield groups
            del groups


def taken(items: list):
    """Yields the items of ``items``, removing each from the list first (the list no longer holds it)."""
    while items:
        yield items.pop(0)


def run_tower_chunked(visual, pixel_values: torch.Tensor, grid_thw: torch.Tensor, settings, family,
                      chunk_slices: int, *, position_embedding=None, by_slice: bool = False, window=None,
                      full_attention_blocks=(), deepstack_blocks=(), deepstack_mergers=None,
                      offload: str | None = None) -> list[VideoFeatures]:
    """`run_tower`, video by video, ``chunk_slices`` slices (tubelets) at a time, with the same outputs.

    Every block attends within a slice (or a window of it), merges units within a slice, and applies its MLP, the
    DeepStack mergers and the patch merger token by token, so a chunk of slices runs through the tower on its own,
    from the patch embedding to the merger; only what it leaves (one feature per unit) is kept. A temporal merge
    compares slices across the whole video, chunk edges included: at a block with R_T > 0 every chunk stops after
    the block's attention (`advance` with ``stop_at_temporal``), the video's slices are matched and merged as in one
    pass (`merge_slice_records` on all of them), and the merged video goes on in chunks again. So the outputs are the
    one-pass outputs (up to rounding of the matrix products).

    Memory: one chunk's activations; each chunk is embedded when it starts (nothing but the outputs grows with the
    video while no temporal merge runs); at a block with R_T > 0, also the hidden states of the whole video at that
    block (its remaining tokens x hidden size, held once: one record per slice, each freed as it is merged), where
    ``offload`` says (`SliceShelf`: None where the tower runs, ``"cpu"``, ``"disk"``).
    """
    if chunk_slices < 1:
        raise ValueError(f"chunk_slices must be a positive int; got {chunk_slices!r}.")
    options = dict(window=window, full_attention_blocks=full_attention_blocks, deepstack_blocks=deepstack_blocks,
                   deepstack_mergers=deepstack_mergers)
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    pixel_parts = pixel_values.split([t * h * w for t, h, w in grids])
    results = []
    for pixels, (t, h, w) in zip(pixel_parts, grids):
        per_slice = h * w

        def embedded(start: int, count: int) -> TokenGroups:
            """Slices ``start .. start + count`` from the patch embedding on (learned positions, windows): made when
            the chunk starts, so that only one chunk's embedding exists at a time."""
            grid = torch.tensor([[count, h, w]], device=grid_thw.device, dtype=grid_thw.dtype)
            hidden = embed(visual, pixels[start * per_slice:(start + count) * per_slice], grid, position_embedding)
            groups = initial_groups(hidden, (count, h, w), window)
            groups.positions[..., 0] += start
            return groups

        # The first pass: every chunk embedded when it starts (a generator), then run up to the first temporal merge
        # (or through the merger). After a temporal merge: the merged video's parts, made one at a time as the loop
        # asks for them (a generator), so that nothing but `advance` holds a part that has run on.
        chunks = (embedded(start, min(chunk_slices, t - start)) for start in range(0, t, chunk_slices))
        block, resume, finished = 0, False, []
        shelf = SliceShelf(offload)
        try:
            while chunks is not None:
                stopped = []
                for chunk in chunks:
                    state = [chunk]  # advance replaces the groups it merges
                    del chunk
                    index, chunk_keys = advance(visual, state, settings, family, block, resume=resume,
                                                stop_at_temporal=True, **options)
                    groups = state.pop()
                    if index is None:  # through the last block: keep what the merger gives, drop the hidden states
                        hidden_size = groups.tokens.shape[-1] // UNIT
                        merged = visual.merger(groups.tokens.reshape(-1, hidden_size))
                        finished.append(TokenGroups(merged.view(*groups.grid, -1), groups.sizes, groups.positions,
                                                    None, groups.carried))
                        del merged
                    else:  # the video's slices, each on its own, for the merge over the whole video
                        stopped.extend(shelf.put(r) for r in slice_records(groups, chunk_keys[0]))
                        stop = index  # the same for every chunk: the next block whose R_T is not 0
                    del groups, chunk_keys  # no chunk's hidden states outlive its turn, beside what `stopped` keeps
                chunks = None
                if stopped:  # the temporal merge over the whole video, then on in chunks from the block's MLP
                    chunks = merge_slice_records(stopped, settings, stop, chunk_slices, shelf)
                    del stopped
                    block, resume = stop, True
        finally:
            shelf.close()
        results.append(chunked_video_features(finished, by_slice))  # empties `finished`
    return results


__all__ = ["UNIT", "VideoFeatures", "advance", "attention", "initial_groups", "run_tower", "run_tower_chunked",
           "window_labels"]
