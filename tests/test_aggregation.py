"""The matching and merging functions against plain-Python float64 references written from the paper's text."""

import itertools
import math
from collections import Counter

import pytest
import torch

from modeling_testa.aggregation import (
    attention_received,
    capped_reduction,
    geometry_matching,
    importance_matching,
    merge_tokens,
    output_slot_of_inputs,
    shift_protected,
)


# ---------------------------------------------------------------------------------------------------------------------
# Loop-based references (one sample, Python lists, float64)
# ---------------------------------------------------------------------------------------------------------------------


def _cos(u, v):
    return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def _first_argmax(values):
    best = max(values)
    return values.index(best)


def reference_geometry(metric, r, protect_first=False):
    """metric: list of N vectors (or, for voting, a list of P such lists). Returns (kept, sources, targets)."""
    voting = isinstance(metric[0][0], list)
    rows = metric if voting else [metric]
    n = len(rows[0])
    a_pos, b_pos = list(range(0, n, 2)), list(range(1, n, 2))
    scores, partners = [], []
    for ai, a in enumerate(a_pos):
        if protect_first and a == 0:
            scores.append(-math.inf)
            partners.append(0)
            continue
        sims = [[_cos(row[a], row[b]) for b in b_pos] for row in rows]
        if voting:
            votes = [0] * len(b_pos)
            for s in sims:
                votes[_first_argmax(s)] += 1
            partner = _first_argmax(votes)
            scores.append(sum(s[partner] for s in sims) / len(sims))
        else:
            partner = _first_argmax(sims[0])
            scores.append(sims[0][partner])
        partners.append(partner)
    order = sorted(range(len(a_pos)), key=lambda k: -scores[k])  # stable: earlier A wins ties
    src, unmerged = order[:r], sorted(order[r:])
    kept = [a_pos[k] for k in unmerged] + b_pos
    return kept, [a_pos[k] for k in src], [len(unmerged) + partners[k] for k in src]


def reference_importance(metric, importance, r, protect_first=False, prune=False):
    voting = isinstance(metric[0][0], list)
    rows = metric if voting else [metric]
    importance = list(importance)
    if protect_first:
        importance[0] = math.inf
    order = sorted(range(len(importance)), key=lambda k: importance[k])
    src, kept = order[:r], sorted(order[r:])
    if prune:
        return kept, [], []
    targets = []
    for s in src:
        sims = [[-math.inf if protect_first and k == 0 else _cos(row[s], row[k]) for k in kept] for row in rows]
        if voting:
            votes = [0] * len(kept)
            for row_sims in sims:
                votes[_first_argmax(row_sims)] += 1
            targets.append(_first_argmax(votes))
        else:
            targets.append(_first_argmax(sims[0]))
    return kept, src, targets


def reference_merge(x, size, kept, sources, targets):
    """Size-weighted average of every output slot's members."""
    members = [[k] for k in kept]
    for s, t in zip(sources, targets):
        members[t].append(s)
    out, out_size = [], []
    for group in members:
        total = sum(size[i] for i in group)
        out.append([sum(x[i][d] * size[i] for i in group) / total for d in range(len(x[0]))])
        out_size.append(total)
    return out, out_size


# ---------------------------------------------------------------------------------------------------------------------
# Hand-worked cases
# ---------------------------------------------------------------------------------------------------------------------


def test_geometry_hand_worked_identical_pair_merges_first():
    # Six tokens; A = positions 0, 2, 4, B = 1, 3, 5. Token 2 is identical to token 5, token 4 is close to token 3.
    metric = torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.3, 1.0], [0.2, 0.9, 0.4], [0.0, 1.0, 0.5], [0.3, 0.3, 1.0]],
        dtype=torch.float64,
    )
    m = geometry_matching(metric, r=1)
    assert m.sources.tolist() == [2] and m.kept.tolist() == [0, 4, 1, 3, 5]
    assert m.targets.tolist() == [4]  # output slot of input 5: after the two unmerged A tokens, B index 2
    m2 = geometry_matching(metric, r=2)
    assert sorted(m2.sources.tolist()) == [2, 4] and m2.kept.tolist() == [0, 1, 3, 5]
    x = torch.arange(12, dtype=torch.float64).view(6, 2)
    size = torch.tensor([1.0, 1.0, 3.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    merged, new_size = merge_tokens(x, size, m)
    # token 5 (x=[10, 11], size 1) absorbs token 2 (x=[4, 5], size 3): (3*[4,5] + [10,11]) / 4
    assert merged[4].tolist() == [5.5, 6.5]
    assert new_size.tolist() == [1.0, 1.0, 1.0, 1.0, 4.0]


def test_protected_first_token_is_never_a_source():
    metric = torch.randn(4, 9, 8, dtype=torch.float64)
    metric[:, 0] = metric[:, 1]  # CLS identical to its best B partner: it would merge first if it were not protected
    m = geometry_matching(metric, r=4, protect_first=True)
    assert (m.sources != 0).all() and (m.kept[:, 0] == 0).all()
    importance = torch.rand(4, 9, dtype=torch.float64)
    importance[:, 0] = -1.0  # least attended, but protected
    m = importance_matching(metric, importance, r=4, protect_first=True)
    assert (m.sources != 0).all() and (m.kept[:, 0] == 0).all() and (m.targets != 0).all()
    shifted = shift_protected(m)
    assert shifted.kept.shape[-1] == 4 and (shifted.sources >= 0).all()


def test_prune_drops_the_least_attended_tokens():
    importance = torch.tensor([[0.5, 0.1, 0.9, 0.05, 0.7, 0.3]])
    m = importance_matching(torch.randn(1, 6, 4), importance, r=2, prune=True)
    assert m.kept.tolist() == [[0, 2, 4, 5]] and m.sources.numel() == 0
    x = torch.randn(1, 6, 3)
    out, size = merge_tokens(x, torch.ones(1, 6), m)
    torch.testing.assert_close(out, x[:, [0, 2, 4, 5]])
    assert size.sum() == 4  # the pruned tokens' sizes are gone


def test_attention_received_matches_float64_equation_1():
    q, k = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.randn(2, 3, 5, 4, dtype=torch.float64)
    scaling = 0.5
    got = attention_received(q, k, scaling)
    for b in range(2):
        probs = [[[0.0] * 5 for _ in range(5)] for _ in range(3)]
        for h in range(3):
            for j in range(5):
                logits = [scaling * float(q[b, h, j] @ k[b, h, i]) for i in range(5)]
                z = sum(math.exp(v) for v in logits)
                probs[h][j] = [math.exp(v) / z for v in logits]
        for i in range(5):
            expected = sum(probs[h][j][i] for h in range(3) for j in range(5) if j != i) / 3
            assert abs(got[b, i].item() - expected) < 1e-10


def test_caps_follow_tome_and_the_original_code():
    assert capped_reduction(12, 197, protected=1) == 12
    assert capped_reduction(200, 197, protected=1) == 98  # patches: at most L // 2
    assert capped_reduction(4, 7, protected=1) == 3  # frames: the original caps at (T - 1) // 2
    assert capped_reduction(1, 2, protected=1) == 0


def test_output_slots_follow_the_matching():
    metric = torch.randn(3, 7, 5, dtype=torch.float64)
    m = geometry_matching(metric, r=3)
    slots = output_slot_of_inputs(m, 7)
    for b in range(3):
        for position, slot in enumerate(m.kept[b].tolist()):
            assert slots[b, slot] == position
        for source, target in zip(m.sources[b].tolist(), m.targets[b].tolist()):
            assert slots[b, source] == target


# ---------------------------------------------------------------------------------------------------------------------
# Batched implementation == loop references, on random data, for every strategy
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protect_first", [False, True])
@pytest.mark.parametrize("num_tokens,r", [(9, 3), (10, 5), (7, 1)])
def test_geometry_matches_reference(num_tokens, r, protect_first):
    r = capped_reduction(r, num_tokens, protected=int(protect_first))
    metric = torch.randn(2, 3, num_tokens, 6, dtype=torch.float64)
    x = torch.randn(2, 3, num_tokens, 4, dtype=torch.float64)
    size = torch.randint(1, 5, (2, 3, num_tokens)).double()
    m = geometry_matching(metric, r, protect_first=protect_first)
    merged, new_size = merge_tokens(x, size, m)
    for b in range(2):
        for t in range(3):
            kept, src, tgt = reference_geometry(metric[b, t].tolist(), r, protect_first)
            assert m.kept[b, t].tolist() == kept and m.sources[b, t].tolist() == src
            assert m.targets[b, t].tolist() == tgt
            ref_x, ref_size = reference_merge(x[b, t].tolist(), size[b, t].tolist(), kept, src, tgt)
            torch.testing.assert_close(merged[b, t], torch.tensor(ref_x, dtype=torch.float64))
            assert new_size[b, t].tolist() == ref_size


def test_frame_vote_matches_reference():
    # (batch, positions, frames, channels): frames compared position by position, the majority picks the partner.
    metric = torch.randn(3, 5, 8, 4, dtype=torch.float64)
    m = geometry_matching(metric, 3, vote_dim=-3)
    for b in range(3):
        kept, src, tgt = reference_geometry(metric[b].tolist(), 3)
        assert (m.kept[b].tolist(), m.sources[b].tolist(), m.targets[b].tolist()) == (kept, src, tgt)


@pytest.mark.parametrize("prune", [False, True])
@pytest.mark.parametrize("protect_first", [False, True])
def test_importance_matches_reference(prune, protect_first):
    metric = torch.randn(4, 9, 6, dtype=torch.float64)
    importance = torch.rand(4, 9, dtype=torch.float64)
    m = importance_matching(metric, importance, 3, protect_first=protect_first, prune=prune)
    for b in range(4):
        kept, src, tgt = reference_importance(metric[b].tolist(), importance[b].tolist(), 3, protect_first, prune)
        assert (m.kept[b].tolist(), m.sources[b].tolist(), m.targets[b].tolist()) == (kept, src, tgt)


def test_importance_vote_matches_reference():
    metric = torch.randn(2, 4, 8, 5, dtype=torch.float64)
    importance = torch.rand(2, 8, dtype=torch.float64)
    m = importance_matching(metric, importance, 3, vote_dim=-3)
    for b in range(2):
        kept, src, tgt = reference_importance(metric[b].tolist(), importance[b].tolist(), 3)
        assert (m.kept[b].tolist(), m.sources[b].tolist(), m.targets[b].tolist()) == (kept, src, tgt)


def test_frame_merge_weights_every_position_by_its_own_size():
    # Frames (B, T, L, D) with sizes (B, T, L) and a (B, K) matching: position l of a merged frame averages the
    # frames' position-l tokens, each weighted by its own size.
    frames, positions, dim = 6, 3, 2
    x = torch.randn(1, frames, positions, dim, dtype=torch.float64)
    size = torch.randint(1, 4, (1, frames, positions)).double()
    m = geometry_matching(torch.randn(1, frames, 5, dtype=torch.float64), 2)
    merged, new_size = merge_tokens(x, size, m)
    assert merged.shape == (1, frames - 2, positions, dim)
    for p in range(positions):
        ref_x, ref_size = reference_merge(
            x[0, :, p].tolist(), size[0, :, p].tolist(), m.kept[0].tolist(), m.sources[0].tolist(),
            m.targets[0].tolist(),
        )
        torch.testing.assert_close(merged[0, :, p], torch.tensor(ref_x, dtype=torch.float64))
        assert new_size[0, :, p].tolist() == ref_size


def test_several_sources_into_one_target_and_gradients():
    """Three sources join token 0: the result is the size-weighted mean of all four, and the gradient of the
    in-place O(r) update equals the float64 finite-difference gradient."""
    from modeling_testa.aggregation import Matching

    matching = Matching(kept=torch.tensor([[0, 4]]), sources=torch.tensor([[1, 2, 3]]), targets=torch.tensor([[0, 0, 0]]))
    x = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    size = torch.tensor([[2.0, 1.0, 3.0, 1.0, 5.0]], dtype=torch.float64)
    merged, new_size = merge_tokens(x, size, matching)
    expected = (x[0, :4] * size[0, :4, None]).sum(0) / 7
    torch.testing.assert_close(merged[0, 0], expected)
    torch.testing.assert_close(merged[0, 1], x[0, 4])
    assert new_size.tolist() == [[7.0, 5.0]]
    assert torch.autograd.gradcheck(lambda t: merge_tokens(t, size, matching)[0], (x,))
    frame_matching = geometry_matching(torch.randn(2, 6, 4, dtype=torch.float64), 2)
    frames = torch.randn(2, 6, 3, 2, dtype=torch.float64, requires_grad=True)
    frame_size = torch.randint(1, 4, (2, 6, 3)).double()
    assert torch.autograd.gradcheck(lambda t: merge_tokens(t, frame_size, frame_matching)[0], (frames,))


# ---------------------------------------------------------------------------------------------------------------------
# The bipartite merge (geometry matchings are applied in the coordinates of their two sets)
# ---------------------------------------------------------------------------------------------------------------------


def _loop_merge(x, size, matching):
    """float64 loop reference of a whole batch (`reference_merge` per sample and, for frames, per patch position):
    every output slot is the size-weighted mean of its members."""
    batch_shape = matching.kept.shape[:-1]
    outs, sizes = [], []
    for pick in itertools.product(*map(range, batch_shape)):
        rows, weights = x[pick].double(), size[pick].double()
        per_position = weights.ndim > 1  # frames (T, L, D): every patch position has its own sizes
        if not per_position:
            rows, weights = rows.unsqueeze(1), weights.unsqueeze(1)
        kept, sources, targets = (t[pick].tolist() for t in (matching.kept, matching.sources, matching.targets))
        columns = [reference_merge(rows[:, p].tolist(), weights[:, p].tolist(), kept, sources, targets)
                   for p in range(rows.shape[1])]
        out = torch.tensor([c[0] for c in columns], dtype=torch.float64).transpose(0, 1)
        out_size = torch.tensor([c[1] for c in columns], dtype=torch.float64).transpose(0, 1)
        outs.append(out if per_position else out.squeeze(1))
        sizes.append(out_size if per_position else out_size.squeeze(1))
    return torch.stack(outs).view(*batch_shape, *outs[0].shape), torch.stack(sizes).view(*batch_shape, *sizes[0].shape)


def test_static_video_ties_merge_the_lowest_a_tokens_first_and_keep_exact_copies():
    """Eight identical frames (a static video, batch 1): every A frame ties at similarity 1 with every B frame, so the
    stable order merges A frames 0, 2, 4 (in that order) into B frame 0, three sources into one target."""
    frame = torch.randn(5, dtype=torch.float64)
    metric = frame.expand(1, 8, 5).clone()
    m = geometry_matching(metric, 3)
    assert m.sources.tolist() == [[0, 2, 4]] and m.kept.tolist() == [[6, 1, 3, 5, 7]]
    assert m.targets.tolist() == [[1, 1, 1]]
    x = torch.randn(1, 8, 3, 4, dtype=torch.float64)  # (batch, frames, positions, hidden)
    size = torch.randint(1, 6, (1, 8, 3)).double()
    merged, new_size = merge_tokens(x, size, m)
    ref_x, ref_size = _loop_merge(x, size, m)
    torch.testing.assert_close(merged, ref_x, rtol=1e-12, atol=1e-12)
    assert torch.equal(new_size, ref_size)
    for slot, frame_index in ((0, 6), (2, 3), (3, 5), (4, 7)):  # rows that receive nothing are exact copies
        assert torch.equal(merged[0, slot], x[0, frame_index])


@pytest.mark.parametrize("protect_first", [False, True])
def test_bipartite_merge_equals_the_loop_reference_with_several_targets_and_sources(protect_first):
    """Batch 1, patches of two frames: duplicated tokens make several targets receive several sources, with ties;
    the fast merge (and the same matching applied through explicit indices) equal the float64 loop."""
    from modeling_testa.aggregation import Matching

    generator = torch.Generator().manual_seed(3)
    base = torch.randn(1, 2, 4, 6, generator=generator, dtype=torch.float64)
    metric = base[:, :, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 0], :]  # 11 tokens, exact duplicates of 4 vectors
    r = capped_reduction(5, 11, protected=int(protect_first))
    m = geometry_matching(metric, r, protect_first=protect_first)
    for t in range(2):
        assert (m.kept[0, t].tolist(), m.sources[0, t].tolist(), m.targets[0, t].tolist()) == reference_geometry(
            metric[0, t].tolist(), r, protect_first)
    assert max(Counter(row.tolist()).most_common(1)[0][1] for row in m.targets[0]) >= 2  # fan-in > 1 somewhere
    x = torch.randn(1, 2, 11, 3, generator=generator, dtype=torch.float64)
    size = torch.randint(1, 9, (1, 2, 11), generator=generator).double()
    merged, new_size = merge_tokens(x, size, m)
    ref_x, ref_size = _loop_merge(x, size, m)
    torch.testing.assert_close(merged, ref_x, rtol=1e-12, atol=1e-12)
    assert torch.equal(new_size, ref_size)
    explicit = Matching(kept=m.kept, sources=m.sources, targets=m.targets)
    merged_explicit, size_explicit = merge_tokens(x, size, explicit)
    torch.testing.assert_close(merged_explicit, ref_x, rtol=1e-12, atol=1e-12)
    assert torch.equal(size_explicit, ref_size)
    if protect_first:  # the patch tensor without the CLS, as the block merges it
        shifted = shift_protected(m)
        merged_patches, patch_sizes = merge_tokens(x[:, :, 1:], size[:, :, 1:], shifted)
        torch.testing.assert_close(merged_patches, merged[:, :, 1:], rtol=0, atol=0)
        assert torch.equal(patch_sizes, new_size[:, :, 1:])
        explicit_shifted = shift_protected(explicit)
        assert torch.equal(shifted.kept, explicit_shifted.kept) and torch.equal(shifted.targets, explicit_shifted.targets)


def test_fp32_merge_is_within_rounding_of_the_float64_loop():
    generator = torch.Generator().manual_seed(4)
    metric = torch.randn(1, 3, 197, 8, generator=generator)
    x = torch.randn(1, 3, 196, 16, generator=generator)
    size = torch.randint(1, 20, (1, 3, 196), generator=generator).float()
    m = shift_protected(geometry_matching(metric, 12, protect_first=True))
    merged, new_size = merge_tokens(x, size, m)
    assert merged.dtype == torch.float32 and new_size.dtype == torch.float32
    ref_x, ref_size = _loop_merge(x, size, m)
    torch.testing.assert_close(merged.double(), ref_x, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_size.double(), ref_size)


def test_pruning_a_single_video_keeps_exact_rows_and_sizes():
    importance = torch.tensor([[0.4, 0.1, 0.9, 0.05, 0.7, 0.3, 0.2]], dtype=torch.float64)
    m = importance_matching(torch.randn(1, 7, 4, dtype=torch.float64), importance, r=3, prune=True)
    x, size = torch.randn(1, 7, 5, dtype=torch.float64), torch.tensor([[1.0, 2, 3, 4, 5, 6, 7]], dtype=torch.float64)
    out, new_size = merge_tokens(x, size, m)
    assert m.kept.tolist() == [[0, 2, 4, 5]]
    assert torch.equal(out, x[:, [0, 2, 4, 5]]) and new_size.tolist() == [[1.0, 3.0, 5.0, 6.0]]


def test_a_matching_applied_to_the_wrong_number_of_tokens_is_refused():
    m = geometry_matching(torch.randn(2, 9, 4), 3)
    with pytest.raises(ValueError, match="over 9 tokens"):
        merge_tokens(torch.randn(2, 8, 3), torch.ones(2, 8), m)


@pytest.mark.parametrize("protect_first", [False, True])
def test_bipartite_merge_backward_is_the_gradient_of_the_forward(protect_first):
    """The hand-written backward against float64 finite differences (gradcheck) and against autograd through the
    plain forward ops, for frames (per-position sizes) and for tokens with a protected CLS kept in the tensor."""
    from modeling_testa.aggregation import merge_bipartite

    generator = torch.Generator().manual_seed(5)
    if protect_first:  # joint mode: [CLS, tokens] merged as one tensor, CLS protected and kept first
        m = geometry_matching(torch.randn(2, 9, 4, generator=generator, dtype=torch.float64), 3, protect_first=True)
        x = torch.randn(2, 9, 3, generator=generator, dtype=torch.float64, requires_grad=True)
        size = torch.randint(1, 5, (2, 9), generator=generator).double()
    else:  # frames: (B, T, L, D) with a (B, K) matching
        frame_metric = torch.randn(1, 7, 4, generator=generator, dtype=torch.float64)
        frame_metric[:, 4] = frame_metric[:, 1]  # an exact tie
        m = geometry_matching(frame_metric, 3)
        x = torch.randn(1, 7, 2, 3, generator=generator, dtype=torch.float64, requires_grad=True)
        size = torch.randint(1, 5, (1, 7, 2), generator=generator).double()
    assert torch.autograd.gradcheck(lambda t: merge_tokens(t, size, m)[0], (x,))
    upstream = torch.randn_like(merge_tokens(x, size, m)[0])
    (custom,) = torch.autograd.grad(merge_tokens(x, size, m)[0], x, upstream)
    (plain,) = torch.autograd.grad(merge_bipartite(x, size, m.bipartite)[0], x, upstream)
    torch.testing.assert_close(custom, plain, rtol=1e-12, atol=1e-12)


def test_identical_tokens_stay_bitwise_identical_after_merging():
    """A target and its sources that are the same vector (duplicated frames) give that vector exactly, whatever their
    sizes, so ties between duplicates stay exact ties in the next block (fp32, odd sizes that round; the merge of
    d257ac3 changed such rows by rounding in 50 of 50 random draws)."""
    row = torch.randn(16)
    x = row.expand(1, 9, 16).clone()
    size = torch.tensor([[1.0, 3.0, 7.0, 2.0, 5.0, 1.0, 6.0, 3.0, 11.0]])
    m = geometry_matching(torch.randn(1, 1, 4).expand(1, 9, 4), 4)  # every pair ties: the first 4 A tokens merge
    assert m.sources.tolist() == [[0, 2, 4, 6]]
    merged, new_size = merge_tokens(x, size, m)
    assert torch.equal(merged, row.expand_as(merged)) and new_size.sum() == size.sum()
