"""The fused Triton kernels of `modeling_testa.fused_aggregation` (the GPU path of the geometry matching and its
merge), run on the CPU by Triton's interpreter: the same kernel code a GPU compiles.

References: the PyTorch path (`aggregation.geometry_matching`, `aggregation.merge_bipartite`) for the decisions, a
float64 re-computation of the size-weighted average for the merged rows, and hand-worked tie cases.
"""

import pytest
import torch

from modeling_testa import TestaVisionConfig, TestaVisionModel, aggregation, fused_aggregation
from testa_runtimes import optimize_for_inference


pytestmark = pytest.mark.skipif(not fused_aggregation.triton_available(), reason="Triton is not installed")
GRID = aggregation.DEFAULT_SCORE_GRID


def fused_pairs(metric: torch.Tensor, r: int, protect_first: bool, grid: float = GRID) -> aggregation.Bipartite:
    first = int(protect_first)
    return aggregation.Bipartite(
        *fused_aggregation.geometry_pairs(metric, r, first, 1.0 / grid if grid else 1.0, bool(grid)),
        2 * first, 1, first, metric.shape[-2],
    )


def pytorch_pairs(metric: torch.Tensor, r: int, protect_first: bool, grid: float = GRID) -> aggregation.Bipartite:
    return aggregation.geometry_matching(metric, r, protect_first=protect_first, score_grid=grid).bipartite


def assert_same_decisions(got: aggregation.Bipartite, expected: aggregation.Bipartite) -> None:
    for name in ("unmerged", "sources", "partners"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def static_keys(shape: tuple[int, ...], repeats: int = 3, seed: int = 0) -> torch.Tensor:
    """Keys as in static footage: every token is a scaled copy of one of ``repeats`` random directions, so many
    scores tie exactly (rounding decides nothing: any order of summation gives the same cosines up to an ulp)."""
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(repeats, shape[-1], generator=generator)
    pick = torch.randint(0, repeats, shape[:-1], generator=generator)
    return directions[pick] * torch.randint(1, 4, (*shape[:-1], 1), generator=generator).float()


def test_all_identical_tokens_merge_in_index_order_hand_worked():
    # 9 identical tokens, CLS protected: A = positions 0, 2, 4, 6, 8 (A index 0 is the CLS), B = 1, 3, 5, 7. Every
    # score ties at 1: every partner is B 0, and the r = 3 sources are the lowest A indices after the CLS.
    metric = torch.ones(1, 9, 4)
    pairs = fused_pairs(metric, 3, protect_first=True)
    assert pairs.sources.tolist() == [[0, 1, 2]]  # A indices counted after the CLS: positions 2, 4, 6
    assert pairs.partners.tolist() == [[0, 0, 0]]
    assert pairs.unmerged.tolist() == [[3]]  # position 8


@pytest.mark.parametrize("shape, r, protect_first", [
    ((2, 3, 33, 16), 12, True),   # patches of 3 frames, [CLS, 32 patches], keys of 16 channels
    ((2, 3, 197, 64), 12, True),  # ViT-B/16 at 224 px: 99 x 98 scores, the largest one program takes
    ((3, 32, 64), 1, False),      # frames (mean keys), R_T = 1
    ((2, 9, 8), 4, False),        # frames, the largest r: (9 - 1) // 2
])
@pytest.mark.parametrize("keys", ["static", "random"])
def test_decisions_equal_the_pytorch_path(shape, r, protect_first, keys):
    metric = static_keys(shape) if keys == "static" else torch.randn(shape)
    assert_same_decisions(fused_pairs(metric, r, protect_first), pytorch_pairs(metric, r, protect_first))


def test_rounding_ties_go_to_even_as_torch_round():
    # +-1 vectors of 64 channels: every cosine is exactly 1 - k / 32, so on a grid of 2^-4 the scaled scores are
    # 16 - k / 2: half of them sit exactly between two grid steps, where the kernel must round as torch.round does
    generator = torch.Generator().manual_seed(3)
    base = torch.randint(0, 2, (4, 1, 1, 64), generator=generator).float() * 2 - 1
    flips = torch.rand(4, 6, 41, 64, generator=generator) < 0.05  # a few channels flipped: cosines near 1
    metric = torch.where(flips, -base, base)
    scaled = metric[..., ::2, :] @ metric[..., 1::2, :].transpose(-1, -2) / 64 * 16
    assert (scaled.frac().abs() == 0.5).any()  # the case is there
    assert_same_decisions(fused_pairs(metric, 10, True, 2.0**-4), pytorch_pairs(metric, 10, True, 2.0**-4))


def test_raw_scores_without_a_grid():
    metric = torch.randn(2, 4, 33, 16)
    assert_same_decisions(fused_pairs(metric, 8, True, 0.0), pytorch_pairs(metric, 8, True, 0.0))


def weighted_average_float64(x: torch.Tensor, size: torch.Tensor, pairs: aggregation.Bipartite):
    """The merge re-computed in float64 from its definition: ``[protected, unmerged A, B]``, every B token the
    size-weighted mean of itself and the A tokens merged into it."""
    axis = pairs.sources.ndim - 1
    x, size = x.double().movedim(axis, 0), size.double().movedim(axis, 0)
    batch = pairs.sources.shape[:-1]
    a_positions = list(range(pairs.a_start, x.shape[0], 2))
    b_positions = list(range(pairs.b_start, x.shape[0], 2))
    out_x, out_size = [], []
    for index in torch.cartesian_prod(*(torch.arange(n) for n in batch)).view(-1, len(batch)).tolist():
        sums = {b: (x[b][tuple(index)] * size[b][tuple(index)].unsqueeze(-1), size[b][tuple(index)].clone())
                for b in b_positions}
        for source, partner in zip(pairs.sources[tuple(index)].tolist(), pairs.partners[tuple(index)].tolist()):
            a, b = a_positions[source], b_positions[partner]
            weighted, total = sums[b]
            sums[b] = (weighted + x[a][tuple(index)] * size[a][tuple(index)].unsqueeze(-1),
                       total + size[a][tuple(index)])
        kept = [*range(pairs.protected), *(a_positions[u] for u in pairs.unmerged[tuple(index)].tolist())]
        rows = [x[k][tuple(index)] for k in kept] + [sums[b][0] / sums[b][1].unsqueeze(-1) for b in b_positions]
        sizes = [size[k][tuple(index)] for k in kept] + [sums[b][1] for b in b_positions]
        out_x.append(torch.stack(rows))
        out_size.append(torch.stack(sizes))
    out_x = torch.stack(out_x).view(*batch, *out_x[0].shape)
    out_size = torch.stack(out_size).view(*batch, *out_size[0].shape)
    return out_x, out_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["patches", "frames", "frames-transposed"])
def test_merge_equals_the_weighted_average(dtype, layout):
    generator = torch.Generator().manual_seed(5)
    if layout == "patches":  # (B, T, L, D), one size per patch; CLS-protected matching shifted off the patches
        metric = static_keys((2, 3, 25, 8), seed=1)
        pairs = aggregation.shift_protected(aggregation.Matching(bipartite=fused_pairs(metric, 9, True))).bipartite
        x = torch.randn(2, 3, 24, 16, generator=generator)
        size = torch.randint(1, 5, (2, 3, 24), generator=generator).float()
    else:  # (B, T, L, D): whole frames merge, every patch position with its own size
        metric = static_keys((2, 9, 8), seed=2)
        pairs = fused_pairs(metric, 4, False)
        x = torch.randn(2, 9, 5, 16, generator=generator)
        size = torch.randint(1, 5, (2, 9, 5), generator=generator).float()
        if layout == "frames-transposed":  # as the block's residual add leaves it: frames and positions swapped
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
    rows = pairs.partners.reshape(-1, pairs.partners.shape[-1]).tolist()
    assert any(len(set(row)) < len(row) for row in rows)  # several sources share a target
    x = x.to(dtype)
    merged, new_size = fused_aggregation.merge_pairs(x, size, pairs)
    expected_x, expected_size = weighted_average_float64(x, size, pairs)
    assert torch.equal(new_size, expected_size.float())
    assert merged.is_contiguous() and merged.dtype == dtype
    # computed in fp32 and rounded once: within half a step of the dtype of the exact value (and an fp32 margin)
    step = torch.finfo(dtype).eps * expected_x.abs().clamp_min(1e-3)
    assert ((merged.double() - expected_x).abs() <= step * 0.5 + 1e-6).all()
    pytorch_x, pytorch_size = aggregation.merge_bipartite(x, size, pairs)[:2]
    assert torch.equal(new_size, pytorch_size)
    untouched = (new_size == pytorch_size) & (merged == pytorch_x).all(-1)
    assert untouched.float().mean() > 0.5  # unmerged rows and targets without sources: exact copies
    if dtype == torch.float32:
        torch.testing.assert_close(merged, pytorch_x, rtol=1e-6, atol=1e-6)
    else:  # the PyTorch path rounds every step to bf16: within one bf16 step at the features' largest magnitude
        assert ((merged.double() - pytorch_x.double()).abs() <= 2.0**-7 * x.abs().max().double()).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf, in the interpreter
def test_inf_and_nan_keys_rank_first_as_in_torch():
    # an inf key normalises to NaN cosines: torch's argmax and descending sort put NaN first; so does the kernel, and
    # every index slot is still written (a permutation of set A)
    metric = static_keys((2, 3, 33, 16))
    metric[0, 1, 6, 3] = torch.inf
    metric[1, 2, 9] = torch.nan
    got, expected = fused_pairs(metric, 8, True), pytorch_pairs(metric, 8, True)
    assert_same_decisions(got, expected)
    a_indices = torch.cat([got.unmerged, got.sources], dim=-1).sort(dim=-1).values
    assert torch.equal(a_indices, torch.arange(16).expand_as(a_indices))


def test_nan_features_stay_nan_in_bf16():
    metric = static_keys((1, 9, 8), seed=2)
    pairs = fused_pairs(metric, 4, False)
    x = torch.randn(1, 9, 2, 4).bfloat16()
    x[0, :] = torch.nan  # every token of the video
    merged, _ = fused_aggregation.merge_pairs(x, torch.ones(1, 9, 2), pairs)
    assert merged.isnan().all()


def test_merge_checks_its_inputs_and_takes_empty_batches():
    metric = static_keys((2, 3, 25, 8))
    pairs = aggregation.shift_protected(aggregation.Matching(bipartite=fused_pairs(metric, 4, True))).bipartite
    with pytest.raises(ValueError, match="over N = 24 tokens"):
        fused_aggregation.merge_pairs(torch.randn(2, 3, 20, 16), torch.ones(2, 3, 20), pairs)
    empty = aggregation.shift_protected(aggregation.Matching(bipartite=fused_pairs(metric[:0], 4, True))).bipartite
    merged, sizes = fused_aggregation.merge_pairs(torch.randn(0, 3, 24, 16), torch.ones(0, 3, 24), empty)
    assert merged.shape == (0, 3, 20, 16) and sizes.shape == (0, 3, 20)


def tiny_encoder(dtype: torch.dtype = torch.float32, **settings) -> TestaVisionModel:
    config = TestaVisionConfig(num_frames=8, image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3,
                               num_attention_heads=2, intermediate_size=64, temporal_reduction=1,
                               spatial_reduction=4, **settings)
    return TestaVisionModel(config).to(dtype).eval()


def static_video(batch: int) -> torch.Tensor:
    video = torch.randn(batch, 8, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    video[:, 3:] = video[:, 2:3]  # a static shot: six identical frames
    return video


@pytest.mark.parametrize("batch, dtype, score_grid", [(1, torch.float32, GRID), (2, torch.float32, GRID),
                                                     (1, torch.bfloat16, GRID), (2, torch.bfloat16, GRID),
                                                     (1, torch.float32, 0.0)])
def test_encoder_takes_the_same_merges(batch, dtype, score_grid):
    """The fused kernels are the runtime's option (`optimize_for_inference(fused_kernels=...)`), and decide on the
    model's own score grid."""
    model, video = tiny_encoder(dtype, score_grid=score_grid), static_video(batch).to(dtype)
    with torch.no_grad():
        expected = model(pixel_values=video, trace_source=True)
        launches = fused_aggregation.launches
        optimize_for_inference(model, "fp32", fused_kernels="interpret")  # "fp32": the model as it is
        got = model(pixel_values=video, trace_source=True)
    assert fused_aggregation.launches - launches == 2 * 6  # 3 blocks x (frames, patches) x (decide, merge)
    assert torch.equal(got.source_map, expected.source_map) and torch.equal(got.token_sizes, expected.token_sizes)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=tolerance, atol=tolerance)


class LastHiddenState(torch.nn.Module):
    def __init__(self, model: TestaVisionModel):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


def test_training_tracing_and_off_take_the_pytorch_path():
    model, video = tiny_encoder(), static_video(1)
    launches = fused_aggregation.launches
    interpreted = optimize_for_inference(tiny_encoder(), fused_kernels="interpret")
    interpreted.load_state_dict(model.state_dict())
    interpreted.train()  # autograd: the merge with its backward
    interpreted(pixel_values=video).last_hidden_state.sum().backward()
    assert fused_aggregation.launches - launches == 6  # the decisions only (no gradient flows through them)
    interpreted.eval()
    with torch.no_grad():
        traced = torch.jit.trace(LastHiddenState(interpreted), video, check_trace=False)
    assert fused_aggregation.launches - launches == 6  # a tracer records the plain ATen ops
    with torch.no_grad():
        torch.testing.assert_close(traced(video), model(pixel_values=video).last_hidden_state)
        optimize_for_inference(model, fused_kernels="off")(pixel_values=video)
    assert fused_aggregation.launches - launches == 6
    assert not fused_aggregation.uses_fused_kernels(video)  # "auto" (the default) on a CPU tensor


def test_the_option_is_checked_naming_the_allowed_values():
    message = "fused_kernels='always' is not allowed; use one of 'auto', 'off', 'interpret'"
    with pytest.raises(ValueError, match=message):
        optimize_for_inference(tiny_encoder(), fused_kernels="always")
    with pytest.raises(ValueError, match=message):
        tiny_encoder().eager_forward(static_video(1), fused_kernels="always")
    with pytest.raises(ValueError, match=message):
        fused_aggregation.uses_fused_kernels(torch.zeros(1), "always")


def test_self_check_passes_and_reports_a_disagreement(monkeypatch):
    assert fused_aggregation.check_fused_kernels("cpu")
    real = fused_aggregation.merge_pairs
    monkeypatch.setattr(fused_aggregation, "merge_pairs", lambda *a: (real(*a)[0] * 1.01, real(*a)[1]))
    with pytest.warns(UserWarning, match="not used on cpu: they disagree with the PyTorch path in torch.float32, "
                                         "score grid 0.0009765625"):
        assert not fused_aggregation.check_fused_kernels("cpu")


def test_matchings_too_large_for_one_program_take_the_pytorch_path():
    assert fused_aggregation.fits(197) and not fused_aggregation.fits(785)  # 224 px fits, 448 px does not
    metric = torch.randn(1, 1, 785, 8)
    assert not fused_aggregation.matches(metric, 12, 1, "interpret")
    assert fused_aggregation.matches(metric[..., :197, :], 12, 1, "interpret")
    with pytest.raises(ValueError, match="do not fit one program"):
        fused_aggregation.geometry_pairs(metric, 12, 1, 1024.0, True)


@pytest.mark.parametrize("capability", [80, 90])  # A100, H100/H200
def test_kernels_compile_for_nvidia_gpus(capability, tmp_path, monkeypatch):
    # What the interpreter cannot show: that Triton's compiler takes the kernels at the sizes ViT-B/16 uses. Compiled
    # ahead of time, no GPU or driver needed.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compile, not a cached one
    ptx = fused_aggregation.compile_for_gpu(capability)
    assert set(ptx) == {"geometry_pairs", "merge_pairs"}
    assert all(".entry" in code and f".target sm_{capability}" in code for code in ptx.values())
