"""Token aggregation for TESTA: bipartite soft matching, size-weighted merging and pruning.

Everything here is a small pure tensor function, batched over arbitrary leading dimensions, with no Python loops
over batch, frames or patches. One matcher serves both of TESTA's aggregation axes:

* **patch aggregation** runs the matcher on the per-frame patch keys, shape ``(B, T, 1 + L, C)``, with the frame's
  CLS copy at index 0 protected; its result is applied to the patch tensor ``(B, T, L, D)``.
* **frame aggregation** runs the matcher on frame tokens, ``(B, T, C)``: the mean of each frame's patch keys (the
  paper's definition) or, with ``frame_matching="vote"`` / ``"original"``, per-position scores ``(B, L, T, C)``
  reduced over the L positions (see :data:`FRAME_VOTES`). The result is applied to the frame tensor viewed as
  ``(B, T, L * D)``, so all L patch positions of a frame move together.

The cost per block is O(T^2 + L^2) similarity scores, not the O((T L)^2) of global (ToMe-style) matching.

**Token order after merging.** With the geometry strategy the output is ``[unmerged tokens of set A (ascending
input order), all tokens of set B (input order)]`` where A holds the even and B the odd input positions, exactly as
in ToMe and the original TESTA code. The next block's even/odd split is taken on this order, so keeping it is what
makes results match original checkpoints. The importance strategy and pruning keep the surviving tokens in input
order. A protected first token (CLS) always stays first. Use ``trace_source`` (:func:`follow_frame_merge`,
:func:`follow_patch_merge`) to map outputs back to input positions.
"""


import math
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Bipartite(NamedTuple):
    """A geometry matching in the coordinates of its two sets, which is how it is computed and applied.

    A token ``i`` of set A sits at input position ``a_start + 2 i``, token ``j`` of set B at ``b_start + 2 j``; the
    first ``protected`` input positions (the CLS) are in neither set and stay first. Output order:
    ``[protected, unmerged A (ascending), all of B]``.

    Attributes:
        unmerged: ``(*batch, nA - r)`` A indices that stay, ascending.
        sources: ``(*batch, r)`` A indices merged away, most similar first.
        partners: ``(*batch, r)`` the B index every source joins.
    """

    unmerged: torch.Tensor
    sources: torch.Tensor
    partners: torch.Tensor
    a_start: int
    b_start: int
    protected: int
    num_tokens: int


class Matching:
    """How N input tokens become N - r output tokens. All tensors share the leading (batch) dimensions.

    Attributes:
        kept: ``(*batch, N - r)`` input positions that survive, in output order.
        sources: ``(*batch, r_merge)`` input positions that are merged away (empty when pruning).
        targets: ``(*batch, r_merge)`` output slots (``0 .. N - r - 1``) that the sources are averaged into.
        bipartite: the :class:`Bipartite` form of a geometry matching, else None. `merge_tokens` applies that form
            directly (views of the two sets, indices over the r merged pairs only), and ``kept``, ``sources`` and
            ``targets`` are then computed on first use (source tracing, the public API), not on every block.
    """

    def __init__(
        self,
        kept: torch.Tensor | None = None,
        sources: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        bipartite: Bipartite | None = None,
    ):
        if bipartite is None and kept is None:
            raise ValueError("A Matching needs `kept`, `sources` and `targets`, or `bipartite`.")
        self.bipartite = bipartite
        self._kept, self._sources, self._targets = kept, sources, targets

    def _positions(self) -> None:
        pairs = self.bipartite
        batch, device = pairs.partners.shape[:-1], pairs.partners.device
        num_b = len(range(pairs.b_start, pairs.num_tokens, 2))
        leading = torch.arange(pairs.protected, device=device).expand(*batch, pairs.protected)
        b_positions = (torch.arange(num_b, device=device) * 2 + pairs.b_start).expand(*batch, num_b)
        self._kept = torch.cat([leading, pairs.unmerged * 2 + pairs.a_start, b_positions], dim=-1)
        self._sources = pairs.sources * 2 + pairs.a_start
        self._targets = pairs.partners + (pairs.protected + pairs.unmerged.shape[-1])

    @property
    def kept(self) -> torch.Tensor:
        if self._kept is None:
            self._positions()
        return self._kept

    @property
    def sources(self) -> torch.Tensor:
        if self._sources is None:
            self._positions()
        return self._sources

    @property
    def targets(self) -> torch.Tensor:
        if self._targets is None:
            self._positions()
        return self._targets

    def __repr__(self) -> str:
        return f"Matching(kept={self.kept!r}, sources={self.sources!r}, targets={self.targets!r})"


def capped_reduction(requested: int, num_tokens: int, protected: int) -> int:
    """Removes at most half of the unprotected tokens per step, as ToMe does.

    The original TESTA code subtracts one protected token for frames as well (``(T - 1) // 2``), which is why frame
    aggregation passes ``protected=1`` even though frames have no CLS.
    """
    return max(0, min(requested, (num_tokens - protected) // 2))


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Matching decisions are made in fp32 (or fp64) even when the model runs in half precision."""
    if x.dtype in (torch.float32, torch.float64):
        return x  # no `to` call at all: on a GPU every call costs a launch
    return x.float()


def _unit_vectors(x: torch.Tensor) -> torch.Tensor:
    """``x / max(|x|, 1e-12)`` along the last axis, at least fp32: `F.normalize` in three kernels."""
    x = _at_least_fp32(x)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


def _cosine_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _unit_vectors(a) @ _unit_vectors(b).transpose(-1, -2)


def _scaled_products(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * (a @ b^T)`` over any leading dimensions, the scale applied by the matrix multiply itself (one
    kernel). A power-of-two scale is exact: the result is the product's own rounding, scaled."""
    if scale == 1.0:
        return a @ b.transpose(-1, -2)
    if exporting():
        # The same values (the scaling is exact), without baddbmm's ignored first argument: an exporter writes it as
        # ``0 * input + scale * product``, an edge from the keys into the scores, through which the engines'
        # selection of the matching's products (`graph_surgery.matching_matmuls`, walking up from the sorts) reached the
        # key projections and kept 24 linear layers of ViT-B out of int8 (docs/inference.md).
        return (a @ b.transpose(-1, -2)) * scale
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    # beta=0: the first argument (any broadcastable view, so that nothing is allocated for it) is ignored
    out = torch.baddbmm(a3[:1, :1, :1], a3, b3.transpose(-1, -2), beta=0.0, alpha=scale)
    return out.view(*a.shape[:-1], b.shape[-2])


DEFAULT_SCORE_GRID = 2.0**-10
"""The score grid a new model decides its merges on (`AggregationSettings.score_grid`, saved in its config); a
constant, bound as the default where it is used (changing it after import changes nothing).

Runtimes round differently (PyTorch eager or compiled, OpenVINO, ONNX Runtime, CUDA), so the scores of near-identical
tokens (repeated frames, static backgrounds), which differ only by that rounding, would otherwise pick their partner
and their rank by rounding noise: a different merge on every runtime. At 2^-10 the fp32 exports took PyTorch's
decisions on all 512 videos of the demo's trained model, where raw scores gave other merges on 508 (docs/inference.md,
"Agreement between runtimes", which also gives the effect on recall); only pairs whose cosines differ by less than
about 0.001 are equated. 0 decides on raw scores: what models saved before the setting existed were trained with."""


def check_score_grid(grid: float) -> float:
    """``grid`` as a float; raises a ValueError naming ``score_grid`` and the allowed values unless it is 0 (raw
    scores) or a power of two (2^-k), the grids whose scaling is exact, so that the matcher's scaled scores are the
    snapped cosines exactly."""
    if isinstance(grid, bool) or not isinstance(grid, (int, float)) or (
            grid != 0 and not (0 < grid <= 1 and math.frexp(grid)[0] == 0.5)):
        raise ValueError(f"score_grid={grid!r} is not allowed; use 0 (raw scores) or a power of two up to 1, such as "
                         "2**-10 (the default), 2**-8 or 2**-12.")
    return float(grid)


def snap_scores(scores: torch.Tensor, grid: float) -> torch.Tensor:
    """Rounds similarity scores to the nearest multiple of ``grid`` (a power of two, so the scaling is exact), so that
    scores that differ only by rounding become equal and their ties go to the lowest index, on every runtime. A grid
    of 0 returns the scores unchanged (raw scores).

    Cosines of identical tokens (1.0) and of orthogonal ones (0.0) sit at the centre of a grid cell, not on a boundary
    between cells. ``torch.round`` (ties to even) exports as ``Round`` to OpenVINO and ONNX, which round the same way.
    ``-inf`` (a protected token) stays ``-inf``.
    """
    if check_score_grid(grid) == 0:
        return scores
    scale = 1.0 / grid
    return torch.round(scores * scale) / scale


# How per-position frame scores become one decision per frame (``vote_dim`` given):
#   "vote":     destination = majority vote over positions; pair score = mean similarity to the voted frame.
#   "original": the released TESTA code's rule as it runs on CPU: destination = ``mode`` of the positions' best
#               partners, pair score = ``mode`` of the positions' best similarities. Those are distinct floats, so
#               their mode is their minimum: a frame scores as its worst position's best similarity.
# Every rule but "original" decides on snapped scores (:func:`snap_scores`), so that near-ties break the same way on
# every runtime. "original" keeps the raw scores, patches included (`match_tokens` passes it for them): it must
# reproduce the released code on the CPU, which decides near-ties by its own rounding.
FRAME_VOTES = ("vote", "original")


def mode(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The most frequent value along ``dim``, ties to the smallest value: ``torch.mode(x, dim).values`` as on CPU.

    ``torch.mode`` itself breaks ties differently on CUDA (pytorch #90261), so it is re-stated here with a sort and
    two ``searchsorted`` calls: deterministic and identical on every device. For distinct values it is the minimum.
    """
    values = x.movedim(dim, -1).sort(dim=-1).values.contiguous()
    counts = torch.searchsorted(values, values, right=True) - torch.searchsorted(values, values)
    first_most_frequent = counts.argmax(dim=-1, keepdim=True)  # first maximum: the smallest of the tied values
    return values.gather(-1, first_most_frequent).squeeze(-1)


def first_max(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the maximum along ``dim``, with ties going to the lowest index on every device.

    `torch.max(dim)` does not promise which index of a tie it returns, and on CUDA it returns another one than on the
    CPU (measured on an H200 with duplicated frames: docs/gpu.md); `argmax` promises the first.
    """
    indices = x.argmax(dim=dim, keepdim=True)
    return x.gather(dim, indices).squeeze(dim), indices.squeeze(dim)


def round_to_grid(scaled_scores: torch.Tensor) -> torch.Tensor:
    """Scores already divided by the grid (``cosine / grid``) rounded to whole grid steps: the snapping of
    :func:`snap_scores` without its two scalings (the matcher folds the first into its matrix multiply and never
    needs the second: it only compares scores). One kernel."""
    return torch.round(scaled_scores)


def _decide(
    scores: torch.Tensor, vote_dim: int | None, vote: str, snapped: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`best_partner` on scores in grid steps (``snapped``: rounded here) or raw (``snapped=False``)."""
    if vote_dim is None:
        return first_max(round_to_grid(scores) if snapped else scores, dim=-1)
    if vote not in FRAME_VOTES:
        raise ValueError(f"Unknown frame vote {vote!r}; use one of {FRAME_VOTES}.")
    if vote == "original":
        best_scores, best_partners = first_max(scores, dim=-1)  # per position; the position axis is now vote_dim + 1
        position_dim = vote_dim + 1 if vote_dim < 0 else vote_dim
        return mode(best_scores, position_dim), mode(best_partners, position_dim)
    per_position = round_to_grid(scores) if snapped else scores
    votes = F.one_hot(per_position.argmax(dim=-1), scores.shape[-1]).sum(dim=vote_dim)
    partner = votes.argmax(dim=-1)  # first maximum: lowest index wins ties
    mean_scores = scores.mean(dim=vote_dim)  # a mean's rounding depends on the runtime's summation order: snapped
    if snapped:
        mean_scores = round_to_grid(mean_scores)
    return mean_scores.gather(-1, partner.unsqueeze(-1)).squeeze(-1), partner


def best_partner(
    scores: torch.Tensor, vote_dim: int | None, vote: str = "vote", score_grid: float = DEFAULT_SCORE_GRID
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best B partner of every A token: ``(score, index)``, each ``(*batch, nA)``.

    With ``vote_dim`` the scores carry an extra position axis (frames compared patch position by patch position):
    every position picks its best partner and ``vote`` (one of :data:`FRAME_VOTES`) turns those picks into one
    partner and one score per frame. Ties go to the lowest frame index in both rules, so the result is deterministic
    and the same on every device.

    Scores are snapped to ``score_grid`` (:func:`snap_scores`; 0: raw scores), and the returned scores are snapped
    too, so the caller's ranking of the pairs (a stable sort) also sends near-ties to the lowest index.
    ``vote="original"`` (the released code's rule, for frames and, passed by `match_tokens`, for patches) decides on
    the raw scores whatever the grid. (`geometry_matching` takes the same decisions on scores it computes in grid
    steps.)
    """
    grid = 0.0 if vote == "original" else check_score_grid(score_grid)
    if not grid:
        return _decide(scores, vote_dim, vote, snapped=False)
    values, partner = _decide(scores * (1.0 / grid), vote_dim, vote, snapped=True)
    return values * grid, partner


def geometry_matching(
    metric: torch.Tensor,
    r: int,
    protect_first: bool = False,
    vote_dim: int | None = None,
    vote: str = "vote",
    score_grid: float = DEFAULT_SCORE_GRID,
) -> Matching:
    """The paper's geometry-based aggregation (ToMe's bipartite soft matching). Adapted from TESTA `testa/merge.py`
    L15-L103 (`bipartite_soft_matching`, RenShuhuai-Andy/TESTA at 41b9486).

    Tokens are split alternately into A (even positions) and B (odd positions); every A token finds its most similar B
    token (cosine of ``metric``), and the ``r`` best pairs are merged.

    The decisions are those of :func:`best_partner` followed by a stable ranking, computed in about ten kernels: the
    keys are normalised once, the cosines come out of one matrix multiply already divided by the grid (a power of
    two, so exactly), and are rounded to whole grid steps, which are only ever compared. (On CUDA the blocks take the
    same decisions in one fused kernel instead: `aggregation_block.match_tokens`, :mod:`.fused_aggregation`.)

    Args:
        metric: ``(*batch, N, C)`` similarity features (attention keys averaged over heads). With ``vote_dim``,
            ``(*batch, P, N, C)`` with one row per patch position P, and ``vote_dim`` = -3.
        r: pairs to merge; the caller applies :func:`capped_reduction`.
        protect_first: keep token 0 (CLS) out of the sources. It is always in A, so it is simply never chosen.
        vote_dim: the position axis to vote over (frame matching with ``frame_matching="vote"`` or ``"original"``).
            Callers skip the matcher when ``r == 0``: with ``r = 0`` it would still reorder the tokens.
        vote: how the positions decide, one of :data:`FRAME_VOTES` (used only with ``vote_dim``).
        score_grid: the grid the scores are snapped to (:func:`snap_scores`; 0: raw scores), the model's
            `AggregationSettings.score_grid`. ``vote="original"`` decides on raw scores whatever it is.
    """
    grid = 0.0 if vote == "original" else check_score_grid(score_grid)
    return Matching(bipartite=_bipartite(metric, r, int(protect_first), grid, vote_dim, vote))


def _bipartite(metric: torch.Tensor, r: int, first: int, grid: float, vote_dim: int | None, vote: str) -> Bipartite:
    """`geometry_matching`'s decisions in PyTorch ops (about ten kernels)."""
    unit = _unit_vectors(metric)
    scores = _scaled_products(unit[..., ::2, :], unit[..., 1::2, :], 1.0 / grid if grid else 1.0)
    node_max, node_idx = _decide(scores, vote_dim, vote, snapped=bool(grid))
    # The protected token (A token 0) is never a source: its row is left out of the order, and set A starts after it.
    # Stable: among equal scores the lower A index merges first, on every device (ties are common: static frames).
    order = node_max[..., first:].argsort(dim=-1, descending=True, stable=True)
    sources = order[..., :r]
    return Bipartite(
        unmerged=order[..., r:].sort(dim=-1).values,
        sources=sources,
        partners=node_idx[..., first:].gather(-1, sources),
        a_start=2 * first,
        b_start=1,
        protected=first,
        num_tokens=metric.shape[-2],
    )


def importance_matching(
    metric: torch.Tensor,
    importance: torch.Tensor,
    r: int,
    protect_first: bool = False,
    vote_dim: int | None = None,
    prune: bool = False,
    vote: str = "vote",
    score_grid: float = DEFAULT_SCORE_GRID,
) -> Matching:
    """The paper's importance-based aggregation (and the pruning baseline).

    The ``r`` tokens that receive the least attention (Eq. 1) form set A; each is merged into its most similar token
    of B (all other tokens), or simply dropped when ``prune``. Survivors keep their input order. A protected first
    token is neither a source nor a target.

    Args:
        metric: as in :func:`geometry_matching`.
        importance: ``(*batch, N)`` attention received by every token.
        score_grid: as in :func:`geometry_matching` (the partners are picked on snapped scores).
    """
    if protect_first:
        importance = importance.clone()
        importance[..., 0] = torch.inf
    order = importance.argsort(dim=-1, stable=True)
    src = order[..., :r]
    kept = order[..., r:].sort(dim=-1).values
    if prune:
        empty = kept[..., :0]
        return Matching(kept=kept, sources=empty, targets=empty)
    if vote_dim is None:
        gather = lambda idx: metric.gather(-2, idx.unsqueeze(-1).expand(*idx.shape, metric.shape[-1]))  # noqa: E731
    else:  # one row of keys per patch position: gather the same frames at every position
        positions = metric.shape[-3]
        gather = lambda idx: metric.gather(  # noqa: E731
            -2, idx.unsqueeze(-2).unsqueeze(-1).expand(*idx.shape[:-1], positions, idx.shape[-1], metric.shape[-1])
        )
    scores = _cosine_scores(gather(src), gather(kept))
    if protect_first:  # the protected token is the first kept one: nothing merges into it either
        scores[..., 0] = -torch.inf
    _, partner = best_partner(scores, vote_dim, vote, score_grid)
    return Matching(kept=kept, sources=src, targets=partner)


def _expand_index(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcasts a ``(*batch, K)`` token index over the trailing dimensions of ``like``: a stride-0 view, never a
    materialised index the size of the hidden states."""
    trailing = like.shape[index.ndim :]
    return index.view(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[..., index, ...]`` along the token axis ``index.ndim - 1`` for a batched index ``(*batch, K)``."""
    return t.gather(index.ndim - 1, _expand_index(index, t))


def _every_other(t: torch.Tensor, start: int, axis: int) -> torch.Tensor:
    """The view ``t[..., start::2, ...]`` along ``axis``: one set of the bipartite split, without a copy."""
    return t[(slice(None),) * axis + (slice(start, None, 2),)]


def _leading(t: torch.Tensor, count: int, axis: int) -> torch.Tensor:
    return t[(slice(None),) * axis + (slice(0, count),)]


def _as(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` as a factor of ``x``: one trailing axis for the hidden dimension, ``x``'s dtype."""
    weight = weight.unsqueeze(-1)
    return weight if weight.dtype == x.dtype else weight.to(x.dtype)


def _add_at(t: torch.Tensor, index: torch.Tensor, values: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``t`` with ``values`` added at the token positions ``index`` (``(*batch, K)``, the token axis
    ``index.ndim - 1``), in place or into a copy."""
    axis, expanded = index.ndim - 1, _expand_index(index, values)
    return t.scatter_add_(axis, expanded, values) if in_place else t.scatter_add(axis, expanded, values)


def merge_bipartite(
    x: torch.Tensor, size: torch.Tensor, pairs: Bipartite
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`merge_tokens` for a geometry matching, in the coordinates of its two sets: twelve kernels whatever the
    shapes, indices only over tokens (r pairs and the A set), never over the hidden dimension, and only the r merged
    rows computed beyond the one copy of the output.

    Set B is copied into the output as it is and every target row gets ``sum_j (x_j - x_t) * s_j / S_t`` over the
    sources j that join it (``S_t``: the target's new size), which is the size-weighted average of the target and
    its sources; rows that receive nothing are exact copies of the input, and identical tokens stay identical.

    Why not ``[x * s, s]`` in one tensor, merged by one gather and one scatter and divided by the summed size (ToMe's
    ``merge_wavg``)? It takes fewer kernels but writes every row about three more times, in fp32 even for a bf16
    model: `python -m benchmarks.merge_kernels --merge-variants` measures both (docs/gpu.md).

    Returns the merged tokens and sizes, and for the backward the sources' weights and the A-set order.
    """
    axis = pairs.sources.ndim - 1
    if x.shape[axis] != pairs.num_tokens or size.shape[axis] != pairs.num_tokens:
        raise ValueError(
            f"The matching is over {pairs.num_tokens} tokens; got x {tuple(x.shape)} and size {tuple(size.shape)} "
            f"with the token axis {axis}."
        )
    kept_a, num_sources = pairs.unmerged.shape[-1], pairs.sources.shape[-1]
    a_index = torch.cat([pairs.unmerged, pairs.sources], dim=-1)
    a_rows = _take(_every_other(x, pairs.a_start, axis), a_index)  # [unmerged A, sources], one gather
    a_sizes = _take(_every_other(size, pairs.a_start, axis), a_index)
    x_b, size_b = _every_other(x, pairs.b_start, axis), _every_other(size, pairs.b_start, axis)
    kept_rows, source_rows = a_rows.split([kept_a, num_sources], dim=axis)
    kept_sizes, source_sizes = a_sizes.split([kept_a, num_sources], dim=axis)

    def assembled(a_part: torch.Tensor, b_part: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return torch.cat([_leading(source, pairs.protected, axis), a_part, b_part], dim=axis)

    # Eager: the output is assembled first (cat) and its B part updated in place: fresh tensors, so that costs no copy
    # and autograd saves nothing of them. Through views of the B part, not at offset indices into the whole output:
    # TorchInductor (torch 2.14, CPU) compiled the offset form wrongly in an encoder with bf16 linears
    # (tests/test_inference.py, compiled bf16). Exported: the B part is updated out of place and the output assembled
    # after, the same values; an exporter writes an in-place update of a view as a copy of the whole output
    # (``slice_scatter``), which cost OpenVINO a tenth of the int8 encoder's time.
    functional = exporting()
    if functional:
        merged_b, new_size_b = x_b, size_b
    else:
        merged, new_size = assembled(kept_rows, x_b, x), assembled(kept_sizes, size_b, size)
        merged_b = merged.narrow(axis, pairs.protected + kept_a, x_b.shape[axis])
        new_size_b = new_size.narrow(axis, pairs.protected + kept_a, x_b.shape[axis])
    new_size_b = _add_at(new_size_b, pairs.partners, source_sizes, in_place=not functional)
    weight = source_sizes / _take(new_size_b, pairs.partners)
    update = (source_rows - _take(x_b, pairs.partners)) * _as(weight, x)
    merged_b = _add_at(merged_b, pairs.partners, update, in_place=not functional)
    if functional:
        merged, new_size = assembled(kept_rows, merged_b, x), assembled(kept_sizes, new_size_b, size)
    return merged, new_size, weight, a_index


class _BipartiteMerge(torch.autograd.Function):
    """`merge_bipartite` with a hand-written backward of seven kernels, where autograd would run about a dozen
    (a slice backward per view of the two sets, a gather backward per gather, the accumulations between them).

    The merge is linear in ``x``: an output row of set A is its input row; an output row of set B is
    ``f_t x_t + sum_j w_j x_j`` with ``f_t = s_t / S_t`` and ``w_j = s_j / S_t``. So the gradient of a B token is its
    output gradient times ``f_t`` (exactly 1 for tokens that receive nothing), of an unmerged A token its output
    gradient, and of a source ``w_j`` times its target's output gradient. Sizes carry no gradient.
    """

    @staticmethod
    def forward(ctx, x, size, unmerged, sources, partners, a_start, b_start, protected, num_tokens):
        pairs = Bipartite(unmerged, sources, partners, a_start, b_start, protected, num_tokens)
        merged, new_size, weight, a_index = merge_bipartite(x, size, pairs)
        ctx.pairs, ctx.x_shape = pairs, x.shape
        ctx.save_for_backward(weight, a_index, size, new_size)
        ctx.mark_non_differentiable(new_size)
        ctx.set_materialize_grads(False)  # no zero tensor for the sizes' (absent) gradient
        return merged, new_size

    @staticmethod
    def backward(ctx, grad_merged, grad_size):
        if grad_merged is None:
            return (None,) * 9
        weight, a_index, size, new_size = ctx.saved_tensors
        pairs = ctx.pairs
        axis, kept_a = pairs.sources.ndim - 1, pairs.unmerged.shape[-1]
        num_b = grad_merged.shape[axis] - pairs.protected - kept_a
        grad_protected, grad_kept, grad_b = grad_merged.split([pairs.protected, kept_a, num_b], dim=axis)
        grad_sources = _take(grad_b, pairs.partners) * _as(weight, grad_merged)
        b_factor = _every_other(size, pairs.b_start, axis) / new_size.narrow(axis, pairs.protected + kept_a, num_b)
        grad_x = grad_merged.new_empty(ctx.x_shape)  # every position is written below: B, A (a permutation), CLS
        _every_other(grad_x, pairs.b_start, axis).copy_(grad_b * _as(b_factor, grad_merged))
        grad_a = torch.cat([grad_kept, grad_sources], dim=axis)
        _every_other(grad_x, pairs.a_start, axis).scatter_(axis, _expand_index(a_index, grad_a), grad_a)
        if pairs.protected:
            _leading(grad_x, pairs.protected, axis).copy_(grad_protected)
        return grad_x, None, None, None, None, None, None, None, None


def exporting() -> bool:
    """Whether an exporter or tracer records the ops (`torch.export`, the ONNX exporter, `torch.jit.trace`): they get
    the functional forms that engines run well (`_scaled_products`, `merge_bipartite`) and never fused kernels."""
    onnx = sys.modules.get("torch.onnx")  # not imported means not exporting (importing it takes a while)
    return (torch.compiler.is_exporting() or (onnx is not None and onnx.is_in_onnx_export())
            or torch.jit.is_tracing())


def differentiable(x: torch.Tensor) -> bool:
    """Whether the merge of ``x`` runs under autograd (not when exporting or tracing: exporters record the plain
    ops)."""
    return x.requires_grad and torch.is_grad_enabled() and not exporting()


def merge_tokens(x: torch.Tensor, size: torch.Tensor, matching: Matching) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies a matching with a size-weighted average (ToMe's ``merge_wavg``; adapted from TESTA `testa/merge.py`
    L106-L120).

    The token axis is the last axis of the matching's indices: for ``(*batch, K)`` indices it is axis
    ``len(batch)``. Patches use ``x (B, T, L, D)`` with ``(B, T, K)`` indices; frames use the same ``x`` with
    ``(B, K)`` indices, so a frame moves with all its L patch positions.

    Args:
        x: ``(*batch, N, *rest, D)`` token features.
        size: ``x.shape[:-1]``: how many input patches every token (and, for frames, every patch position of the
            frame) stands for. Each position is averaged with its own weight.

    Returns:
        The merged features ``(*batch, N - r, *rest, D)`` and sizes. Sizes are summed, so they keep adding up to the
        number of input patches; with pruning the dropped tokens' sizes are lost.

    Rows that receive no source are exact copies of the input; only the merged rows are computed (work O(r) beyond
    the copy of the kept tokens). Every target row becomes ``x_t + sum_j (x_j - x_t) s_j / S_t``, the size-weighted
    mean of the target and its sources j (``S_t``: their summed size), with the sizes merged by the same indices. A
    geometry matching is applied in the coordinates of its two sets (:func:`merge_bipartite`), an explicit one
    (importance, pruning) through its ``kept``/``sources``/``targets``. (On CUDA at inference the blocks apply a
    geometry matching with one fused kernel instead: `aggregation_block.merge`, :mod:`.fused_aggregation`.)
    """
    pairs = matching.bipartite
    if pairs is not None:
        if differentiable(x):
            return _BipartiteMerge.apply(x, size, *pairs)
        return merge_bipartite(x, size, pairs)[:2]
    kept, sources, targets = matching.kept, matching.sources, matching.targets
    merged = _take(x, kept)
    new_size = _take(size, kept)
    if sources.shape[-1] == 0:
        return merged, new_size
    axis = kept.ndim - 1
    source_size = _take(size, sources)
    new_size.scatter_add_(axis, _expand_index(targets, source_size), source_size)
    weight = source_size / _take(new_size, targets)
    # read the targets from x: `merged` is updated in place below
    update = (_take(x, sources) - _take(x, kept.gather(-1, targets))) * _as(weight, x)
    merged.scatter_add_(axis, _expand_index(targets, update), update)
    return merged, new_size


def output_slot_of_inputs(matching: Matching, num_inputs: int) -> torch.Tensor:
    """``(*batch, N)``: the output slot every input token ends up in (-1 for pruned tokens)."""
    kept = matching.kept
    slots = torch.full((*kept.shape[:-1], num_inputs), -1, dtype=torch.long, device=kept.device)
    slots.scatter_(-1, kept, torch.arange(kept.shape[-1], device=kept.device).expand_as(kept))
    if matching.sources.shape[-1]:
        slots.scatter_(-1, matching.sources, matching.targets)
    return slots


def shift_protected(matching: Matching) -> Matching:
    """Drops the protected first token from a matching, so it indexes a tensor without that token.

    Patch matching runs on ``[CLS, patches]`` keys (CLS takes part in the alternating split, as in the original
    code) but merges the patch tensor alone. CLS is never a source and always the first kept token.
    """
    pairs = matching.bipartite
    if pairs is not None:
        if pairs.protected != 1:
            raise ValueError(f"shift_protected needs a matching with one protected token; got {pairs.protected}.")
        return Matching(bipartite=pairs._replace(
            a_start=pairs.a_start - 1, b_start=pairs.b_start - 1, protected=0, num_tokens=pairs.num_tokens - 1
        ))
    return Matching(kept=matching.kept[..., 1:] - 1, sources=matching.sources - 1, targets=matching.targets - 1)


def follow_frame_merge(source_map: torch.Tensor, frame_slots: torch.Tensor, patches: int) -> torch.Tensor:
    """Source tracking across a frame merge.

    Args:
        source_map: ``(B, T0, L0)``: for every input patch, its current token as a flat frame-major index
            ``t * patches + l`` (-1 = pruned).
        frame_slots: ``(B, T)``: the output frame of every current frame (:func:`output_slot_of_inputs`).
        patches: patches per frame (unchanged by a frame merge).

    Returns:
        The updated ``(B, T0, L0)`` map.
    """
    batch = source_map.shape[0]
    valid = source_map >= 0
    flat = source_map.clamp(min=0)
    frame, patch = flat // patches, flat % patches
    new_frame = frame_slots.gather(1, frame.view(batch, -1)).view_as(frame)
    new = new_frame * patches + patch
    return torch.where(valid & (new_frame >= 0), new, -1)


def follow_patch_merge(
    source_map: torch.Tensor, patch_slots: torch.Tensor, patches_in: int, patches_out: int
) -> torch.Tensor:
    """Source tracking across a per-frame patch merge: ``patch_slots`` ``(B, T, patches_in)`` gives the output patch
    of every current patch (-1 = pruned); the map's flat indices go from ``t * patches_in + l`` to
    ``t * patches_out + l'``."""
    batch = source_map.shape[0]
    valid = source_map >= 0
    flat = source_map.clamp(min=0)
    frame = flat // patches_in
    new_patch = patch_slots.view(batch, -1).gather(1, flat.view(batch, -1)).view_as(flat)
    new = frame * patches_out + new_patch
    return torch.where(valid & (new_patch >= 0), new, -1)


def attention_received(
    query: torch.Tensor, key: torch.Tensor, scaling: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 1 of the paper: the attention every token receives from the other tokens, averaged over heads.

    Args:
        query, key: ``(batch, heads, N, head_dim)``.
        bias: optional additive logits bias broadcastable to ``(batch, heads, N, N)``.

    Returns:
        ``(batch, N)`` importance scores ``S_i = sum_{j != i} A_ji``.
    """
    logits = (_at_least_fp32(query) @ _at_least_fp32(key).transpose(-1, -2)) * scaling
    if bias is not None:
        logits = logits + bias
    probs = logits.softmax(dim=-1).mean(dim=1)
    tokens = probs.shape[-1]
    diagonal = probs.flatten(-2)[..., :: tokens + 1]  # = probs.diagonal(dim1=-2, dim2=-1); exports to OpenVINO
    return probs.sum(dim=-2) - diagonal


__all__ = [
    "Bipartite",
    "DEFAULT_SCORE_GRID",
    "best_partner",
    "check_score_grid",
    "differentiable",
    "exporting",
    "first_max",
    "FRAME_VOTES",
    "Matching",
    "attention_received",
    "capped_reduction",
    "follow_frame_merge",
    "follow_patch_merge",
    "geometry_matching",
    "importance_matching",
    "merge_tokens",
    "mode",
    "output_slot_of_inputs",
    "shift_protected",
    "merge_bipartite",
    "round_to_grid",
    "snap_scores",
]
