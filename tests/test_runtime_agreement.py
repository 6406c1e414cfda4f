"""Merge decisions that survive rounding, on inputs shaped like real video.

Repeated frames and flat backgrounds give the matcher scores that differ only by rounding, so, before scores were
snapped to a grid (`aggregation.snap_scores`), each runtime merged other tokens. Here: the snapping itself against
hand-worked and float64 references; the realistic clips (`processing/realistic_videos.py`) have the properties they
promise and survive an mp4 round trip; and on those clips PyTorch eager, the OpenVINO and ONNX Runtime fp32 exports
and TorchInductor (issue 36: `torch.compile` on the CPU) take the same merge decisions. The models are tiny and
random, with their time embeddings zeroed as in an encoder converted from BLIP (`convert_blip_to_testa`): repeated
frames are then identical tokens, the hardest case. The engine tests run in the engines' own pytest process
(`make test`, tests/conftest.py)."""

import copy
import importlib.util
import math

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.models import randomize, tiny_vision_config
from helpers.requirements import skip_or_fail

from modeling_testa import TestaVisionModel
from testa_runtimes import optimize_for_inference
from modeling_testa.aggregation import DEFAULT_SCORE_GRID, best_partner, first_max, geometry_matching, snap_scores
from processing.realistic_videos import (
    KINDS,
    normalise,
    realistic_clip,
    realistic_pixel_values,
    write_realistic_set,
    write_realistic_video,
)


REPEATING = ("static", "frozen", "slides", "colour_cuts")
"""The kinds whose frames repeat (exactly, or to a grey level): where runtimes used to disagree."""


def _needs(backend: str) -> None:
    if importlib.util.find_spec(backend) is None:
        skip_or_fail(f"the {backend} extra is not installed", f'pip install -e ".[{backend}]"')


def _converted_like_model(seed: int = 0, **overrides) -> TestaVisionModel:
    """A tiny random encoder whose time embeddings are zero, as `convert_blip_to_testa` leaves them."""
    torch.manual_seed(seed)
    model = TestaVisionModel(tiny_vision_config(**overrides)).eval()
    randomize(model, seed=seed)
    with torch.no_grad():
        model.embeddings.temporal_embedding.zero_()
    return model


def _clips(kinds=REPEATING, seeds=(0, 1)) -> torch.Tensor:
    return torch.stack([realistic_pixel_values(kind, frames=8, size=32, seed=s) for s in seeds for kind in kinds])


# --------------------------------------------------------------------------------------------------- the snapping


def test_snapping_rounds_to_the_grid_as_python_does_in_float64():
    values = torch.tensor([0.0, 1.0, -1.0, 0.3, 0.70000005, 0.6999999, 0.123456, -0.5 + 1e-7, 0.99999994],
                          dtype=torch.float32)
    expected = [round(v * 1024) / 1024 for v in values.double().tolist()]  # Python rounds half to even too
    grid = DEFAULT_SCORE_GRID
    assert grid == 2.0**-10
    assert snap_scores(values, grid).tolist() == expected
    assert snap_scores(values.double(), grid).dtype == torch.float64
    halfway = torch.tensor([0.5, 1.5, 2.5, -0.5]) / 1024  # exactly between two grid points: to the even one
    assert (snap_scores(halfway, grid) * 1024).tolist() == [0.0, 2.0, 2.0, -0.0]
    assert snap_scores(torch.tensor([-math.inf]), grid).item() == -math.inf  # a protected token stays out
    # identical tokens (cosine 1 give or take rounding) sit in the middle of a grid cell, not on a boundary
    near_one = torch.tensor([1 - 3e-7, 1.0, 1 + 3e-7])
    assert snap_scores(near_one, grid).tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(snap_scores(values, grid=0.0), values)


def test_a_near_tie_goes_to_the_lowest_index_and_the_released_rule_keeps_raw_scores():
    # B token 2 beats B token 1 by rounding noise only: both score 0.7 to within 1e-7
    scores = torch.tensor([[0.5, 0.7, 0.7 + 6e-8]])
    assert first_max(scores)[1].item() == 2  # raw scores: the noise decides
    score, partner = best_partner(scores, None)
    assert partner.item() == 1 and score.item() == round(0.7 * 1024) / 1024
    assert best_partner(scores, None, "original")[1].item() == 2  # the released code decides on raw scores
    # frame votes: every position prefers frame 2 by noise only, so the vote goes to frame 1
    per_position = scores.expand(4, 3).unsqueeze(1)  # (positions, A frames, B frames)
    assert best_partner(per_position, -3, "vote")[1].tolist() == [1]


def test_pairs_that_tie_after_snapping_merge_in_input_order():
    # four A tokens (even positions) scoring 0.8 against B to within 1e-6, the last one highest
    noise = torch.tensor([3e-6, 2e-6, 1e-6, 0.0])
    metric = torch.zeros(8, 2)
    metric[0::2] = torch.stack([torch.tensor([0.8, 0.6 + n]) for n in noise])
    metric[1::2] = torch.tensor([1.0, 0.0])  # every B token identical: their ties go to B token 0
    matching = geometry_matching(metric[None], r=2)
    assert matching.sources.tolist() == [[0, 2]]  # the two first A tokens, in input order
    assert matching.targets.tolist() == [[2, 2]]  # into B token 0 (output slot 4 - 2 = 2)
    raw = geometry_matching(metric[None], r=2, score_grid=0.0)
    assert raw.sources.tolist() == [[6, 4]]  # raw scores: the noise decides


def test_the_released_rule_is_unchanged_by_snapping():
    model = _converted_like_model(frame_matching="original", temporal_reduction=2, spatial_reduction=4)
    video = _clips(seeds=(0,))
    with torch.no_grad():
        snapped = model(video, trace_source=True)
        model.set_aggregation(score_grid=0.0)
        raw = model(video, trace_source=True)
    assert torch.equal(snapped.source_map, raw.source_map)
    assert torch.equal(snapped.last_hidden_state, raw.last_hidden_state)


# ------------------------------------------------------------------------------------------- the realistic clips


def test_realistic_clips_have_the_promised_structure():
    frames = 24
    clips = {kind: realistic_clip(kind, frames, 48, 64, seed=3) for kind in KINDS}
    for kind, clip in clips.items():
        assert clip.shape == (frames, 48, 64, 3) and clip.dtype == np.uint8, kind
        assert np.array_equal(clip, realistic_clip(kind, frames, 48, 64, seed=3)), kind  # deterministic
        assert not np.array_equal(clip, realistic_clip(kind, frames, 48, 64, seed=4)), kind
    distinct = {kind: len({frame.tobytes() for frame in clip}) for kind, clip in clips.items()}
    static = clips["static"].astype(int)
    assert np.abs(static - static[0]).max() <= 2  # one scene, +-1 grey level of sensor noise per frame
    assert distinct["frozen"] <= frames // 3  # every distinct frame held for 3 to 6 frames
    assert 2 <= distinct["slides"] <= 4 and 2 <= distinct["colour_cuts"] <= 4
    assert all((frame == frame[0, 0]).all() for frame in clips["colour_cuts"])  # flat: every patch identical
    pan = clips["pan"].astype(int)
    shifts = [s for s in (1, 2) if np.array_equal(pan[1:, :, :-s], pan[:-1, :, s:])]
    assert len(shifts) == 1 and distinct["pan"] == frames  # a steady 1 or 2 px per frame
    brightness = clips["fade"].reshape(frames, -1).mean(1)
    quarter = frames // 4  # fade out, black, fade in, hold
    assert (np.diff(brightness[: quarter + 1]) < 0).all() and (brightness[quarter : 2 * quarter] < 1).all()
    assert (np.diff(brightness[2 * quarter : 3 * quarter + 1]) > 0).all() and brightness[-1] > 40
    with pytest.raises(ValueError, match="'static', 'frozen'"):
        realistic_clip("blurry")


def test_the_tensor_variant_is_the_clip_normalised_like_the_video_processor():
    from modeling_testa.video_processing_testa import TestaVideoProcessor

    clip = realistic_clip("slides", 4, 32, 32, seed=0)
    processor = TestaVideoProcessor(do_resize=False, do_center_crop=False, num_frames=4)
    expected = processor(videos=[clip], num_frames=4, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(realistic_pixel_values("slides", 4, 32, seed=0), expected, atol=1e-5, rtol=0)
    assert torch.equal(normalise(clip), realistic_pixel_values("slides", 4, 32, seed=0))


def test_realistic_videos_are_real_mp4s_whose_repeats_survive_compression(tmp_path):
    rows = write_realistic_set(tmp_path, num_videos=len(KINDS), frames=20, size=64, seed=7)
    assert [row["kind"] for row in rows] == list(KINDS)
    assert (tmp_path / "videos.jsonl").read_text().count("\n") == len(KINDS)
    for row in rows:
        clip = realistic_clip(row["kind"], 20, 64, 64, seed=row["seed"])
        with av.open(str(tmp_path / row["video"])) as container:
            decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        assert decoded.shape == clip.shape, row
        assert np.abs(decoded.astype(int) - clip).mean() < 12, row  # H.264 at crf 18, chroma subsampled
    with av.open(str(tmp_path / rows[KINDS.index("slides")]["video"])) as container:
        slides = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(int)
    # a held slide decodes as near-repeats (the encoder refines it frame by frame), the cuts as changes
    steps = np.abs(np.diff(slides, axis=0)).mean(axis=(1, 2, 3))
    assert (steps < 1).sum() >= len(steps) - 3 and (steps > 5).sum() >= 1
    with pytest.raises(ValueError, match="even sides"):
        write_realistic_video(tmp_path / "odd.mp4", realistic_clip("static", 2, 33, 32))


# ----------------------------------------------------------------------------------- runtimes agree on these clips


def _assert_same_decisions(reference, out) -> None:
    assert torch.equal(out.source_map, reference.source_map)
    assert torch.equal(out.token_sizes, reference.token_sizes)
    torch.testing.assert_close(out.last_hidden_state, reference.last_hidden_state, atol=2e-5, rtol=1e-5)


def _exported(model, backend, tmp_path, video):
    exported = optimize_for_inference(copy.deepcopy(model), "fp32", backend=backend, cache_dir=tmp_path)
    with torch.no_grad():
        return exported(video, trace_source=True)


def test_openvino_fp32_takes_pytorchs_merge_decisions_on_repeated_frames(tmp_path):
    _needs("openvino")
    model, video = _converted_like_model(), _clips()
    with torch.no_grad():
        reference = model(video, trace_source=True)
    assert (reference.token_sizes > 1).any()
    _assert_same_decisions(reference, _exported(model, "openvino", tmp_path, video))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
@pytest.mark.parametrize("overrides", [dict(temporal_reduction=2, spatial_reduction=6), dict(frame_matching="vote"),
                                       dict(aggregation_strategy="importance")],
                         ids=["more-merging", "vote", "importance"])
def test_exported_fp32_takes_pytorchs_merge_decisions_on_every_kind(backend, overrides, tmp_path):
    _needs(backend)
    model, video = _converted_like_model(**overrides), _clips(kinds=KINDS)
    with torch.no_grad():
        reference = model(video, trace_source=True)
    _assert_same_decisions(reference, _exported(model, backend, tmp_path, video))


@pytest.mark.slow
def test_on_raw_scores_the_export_disagrees_so_the_agreement_test_can_fail(tmp_path):
    _needs("openvino")
    model, video = _converted_like_model(score_grid=0.0), _clips()
    with torch.no_grad():
        reference = model(video, trace_source=True)
    out = _exported(model, "openvino", tmp_path, video)
    same = (out.source_map == reference.source_map).flatten(1).all(1)
    assert not same.all()  # repeated identical frames: rounding picked other merges


def _agreement(reference, out) -> tuple[int, float]:
    """(clips with the reference's merge decisions, minimum cosine of the mean-pooled tokens)."""
    same = (out.source_map == reference.source_map).flatten(1).all(1)
    cosine = F.cosine_similarity(out.last_hidden_state.mean(1), reference.last_hidden_state.mean(1), dim=-1)
    return int(same.sum()), float(cosine.min())


def test_openvino_bf16_agrees_with_fp32_as_pytorch_bf16_does(tmp_path):
    """OpenVINO bf16 runs the linear layers in bf16 and the rest, the matching included, in fp32
    (`graph_surgery.linear_layers_in_bf16`). The plugin's own bf16 hint, used before, rounded the key similarities to
    bf16 too: on these clips it kept fp32's decisions on 2 of 18 and moved an embedding to cosine 0.87."""
    _needs("openvino")
    from testa_runtimes.exported import cpu_has_bf16

    if not cpu_has_bf16():
        pytest.skip("OpenVINO bf16 needs a CPU with AVX-512 BF16 or AMX (refused elsewhere)")
    model, video = _converted_like_model(), _clips(kinds=KINDS, seeds=(0, 1, 2))
    with torch.no_grad():
        reference = model(video, trace_source=True)
        in_torch = optimize_for_inference(copy.deepcopy(model), "bf16")
        torch_bf16 = _agreement(reference, in_torch(video, trace_source=True))
        exported = optimize_for_inference(copy.deepcopy(model), "bf16", backend="openvino", cache_dir=tmp_path)
        openvino_bf16 = _agreement(reference, exported(video, trace_source=True))
    same, cosine = openvino_bf16
    assert same >= len(video) // 2 and cosine >= 0.98, (openvino_bf16, torch_bf16)  # PyTorch bf16: 13 of 18, 0.998
    assert cosine >= torch_bf16[1] - 0.01


@pytest.mark.slow
def test_openvino_int8_and_bf16_meet_the_targets_on_every_video_of_the_demo_model(tmp_path):
    """Issue 35's targets on the demo's trained model (`make demo`; another folder with ``TESTA_DEMO``): cosine >= 0.99
    on every one of its 512 videos and top-10 overlap >= 9. Before the precision fix: int8 0.9806 (two videos below),
    bf16 0.72 with top-10 overlaps of 4 to 7."""
    import os
    from pathlib import Path

    from benchmarks.runtime_agreement import main

    _needs("openvino")
    from testa_runtimes.exported import cpu_has_bf16

    demo = Path(os.environ.get("TESTA_DEMO", "outputs/demo"))
    if not (demo / "runs" / "b" / "final").is_dir():
        pytest.skip(f"no demo model in {demo} (run `make demo`, or set TESTA_DEMO)")
    runtimes = ["openvino-int8"] + (["openvino-bf16"] if cpu_has_bf16() else [])
    report = main(["--model", str(demo / "runs" / "b" / "final"), "--data", str(demo / "data"), "--runtimes",
                   *runtimes, "--grids", "10", "--threads", "1", "--cache-dir", str(tmp_path)])
    for result in report["results"]:
        assert result["videos"] > 0 and result["below_0.99"] == 0, result
        assert min(result["top10_overlap"]) >= 9, result


@pytest.mark.slow
def test_onnxruntime_int8_meets_the_targets_on_every_video_of_the_demo_model(tmp_path):
    """The same targets for ONNX Runtime int8 (`OnnxRuntimeRuntime.quantize`). Before the attention's own products
    (`graph_surgery.attention_product_matmuls`) were kept out of its static QDQ quantization: one video at cosine
    0.983."""
    import os
    from pathlib import Path

    from benchmarks.runtime_agreement import main

    _needs("onnxruntime")
    demo = Path(os.environ.get("TESTA_DEMO", "outputs/demo"))
    if not (demo / "runs" / "b" / "final").is_dir():
        pytest.skip(f"no demo model in {demo} (run `make demo`, or set TESTA_DEMO)")
    report = main(["--model", str(demo / "runs" / "b" / "final"), "--data", str(demo / "data"), "--runtimes",
                   "onnxruntime-int8", "--grids", "10", "--threads", "1", "--cache-dir", str(tmp_path)])
    (result,) = report["results"]
    assert result["videos"] > 0 and result["below_0.99"] == 0, result
    assert min(result["top10_overlap"]) >= 9, result


# ------------------------------------------------------------------------------------- torch.compile (issue 36)


def _frame_metric(kinds=REPEATING) -> torch.Tensor:
    """Frame tokens of realistic clips as a matcher sees them: a fixed random projection of each frame."""
    video = _clips(kinds=kinds, seeds=(0, 1, 2))  # (clips, frames, 3, 32, 32)
    projection = torch.randn(3 * 32 * 32, 16, generator=torch.Generator().manual_seed(0)) / 55
    return video.flatten(2) @ projection


def test_compiled_matching_takes_eagers_decisions_on_repeated_frames():
    """The fast variant: the matcher alone, compiled by TorchInductor on the CPU."""
    metric = _frame_metric()
    eager = geometry_matching(metric, r=3)
    torch._dynamo.reset()
    compiled = torch.compile(geometry_matching, backend="inductor", fullgraph=True)(metric, r=3)
    for name in ("kept", "sources", "targets"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


@pytest.mark.slow
def test_compiled_encoder_takes_eagers_merge_decisions_in_fp32():
    model, video = _converted_like_model(temporal_reduction=2, spatial_reduction=4), _clips(kinds=KINDS)
    with torch.no_grad():
        reference = model(video, trace_source=True)
    compiled = optimize_for_inference(copy.deepcopy(model), "fp32", compile=True)
    if not compiled.inference_settings["compile"]:
        skip_or_fail("TorchInductor needs a C++ compiler on the CPU", "apt-get install g++")
    with torch.no_grad():
        out = compiled(video, trace_source=True)
    _assert_same_decisions(reference, out)


@pytest.mark.slow
def test_on_raw_scores_compiled_matching_disagrees_so_the_compile_test_can_fail():
    metric = _frame_metric()
    eager = geometry_matching(metric, r=3, score_grid=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(geometry_matching, backend="inductor", fullgraph=True)(metric, r=3, score_grid=0.0)
    assert not torch.equal(compiled.sources, eager.sources)  # inductor's rounding picked other merges


def test_a_grid_that_is_not_a_power_of_two_is_refused_naming_the_allowed_values():
    """The matcher scales the cosines by 1 / score_grid inside its matrix multiply, which is exact only for powers of
    two: any other grid (0.001, a natural choice) would decide some boundary cases differently from `snap_scores`.
    The config refuses it as the matcher does."""
    metric = torch.randn(1, 8, 4)
    message = r"score_grid=.* is not allowed; use 0 \(raw scores\) or a power of two up to 1, such as 2\*\*-10"
    for grid in (1e-3, 0.3, -(2.0**-10), 2.0):
        with pytest.raises(ValueError, match=message):
            geometry_matching(metric, 2, score_grid=grid)
        with pytest.raises(ValueError, match=message):
            tiny_vision_config(score_grid=grid)
    with pytest.raises(ValueError, match=message):
        geometry_matching(metric, 2, score_grid=True)
    for grid in (0.0, 0, 2.0**-6, 2.0**-12, 1.0):
        geometry_matching(metric, 2, score_grid=grid)
        assert tiny_vision_config(score_grid=grid).aggregation_settings().score_grid == grid
