"""`optimize_for_inference` (fp32 / bf16 / int8) and the parallel decoding of `encode_videos`, on tiny random models
and real mp4 files. The int8 layer is checked against a float64 re-computation of its arithmetic done by hand
(weights quantized per channel, activations per tensor); merging decisions against fp32 on inputs whose similarities
are clear-cut; pipelines against the same pipeline without the option."""

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from helpers.models import random_vision_model, videos as random_videos
from helpers.pipelines import build_qa, build_retrieval, tiny_processor, write_bad_files, write_videos
from helpers.requirements import require, skip_or_fail
from torch import nn
from transformers import pipeline

import modeling_testa.aggregation_block as aggregation_block
import testa_runtimes.linear_layers as linear_layers
import modeling_testa.video_decoding as video_decoding
from modeling_testa import TestaVisionModel, TestaVisionModelOutput
from testa_runtimes import PRECISIONS, Bf16Linear, Int8DynamicLinear, optimize_for_inference


LINEARS_PER_LAYER = 7  # temporal qkv, projection and temporal_fc; spatial qkv and projection; fc1, fc2


def _vision_model(seed: int = 0, **overrides) -> TestaVisionModel:
    return random_vision_model(seed, **overrides)


def _video(batch: int = 2, frames: int = 8, seed: int = 1) -> torch.Tensor:
    return random_videos(batch, frames, seed=seed)


# ------------------------------------------------------------------------------------------------ the API contract


def test_bad_precision_and_bad_model_raise_naming_the_allowed_values():
    model = _vision_model()
    with pytest.raises(ValueError, match=r"'fp32', 'bf16', 'int8'") as error:
        optimize_for_inference(model, precision="fp16")
    assert "fp16" in str(error.value)
    with pytest.raises(TypeError, match="TestaVisionModel, TestaForVideoTextRetrieval"):
        optimize_for_inference(nn.Linear(4, 4), precision="int8")
    assert not any(isinstance(m, (Int8DynamicLinear, Bf16Linear)) for m in model.modules())  # left untouched
    assert PRECISIONS == ("fp32", "bf16", "int8")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_outputs_api_is_kept(precision):
    reference = _vision_model()
    model = copy.deepcopy(reference).train()
    returned = optimize_for_inference(model, precision)
    assert returned is model and not model.training
    converted = [m for m in model.modules() if isinstance(m, (Int8DynamicLinear, Bf16Linear))]
    assert len(converted) == (0 if precision == "fp32" else LINEARS_PER_LAYER * len(model.layers))
    video = _video()
    with torch.inference_mode():
        expected = reference(video, output_hidden_states=True, trace_source=True)
        got = model(video, output_hidden_states=True, trace_source=True)
        as_tuple = model(video, return_dict=False)
    assert isinstance(got, TestaVisionModelOutput)
    assert list(got.keys()) == list(expected.keys())
    for name in ("last_hidden_state", "pooler_output", "token_sizes", "source_map"):
        assert getattr(got, name).shape == getattr(expected, name).shape, name
        assert getattr(got, name).dtype == getattr(expected, name).dtype, name
    assert len(got.hidden_states) == len(expected.hidden_states)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], model(video).last_hidden_state)
    if precision == "fp32":  # numerically the model as it is
        assert torch.equal(got.last_hidden_state, expected.last_hidden_state)


def test_optimizing_twice_or_int8_off_cpu_raises():
    model = optimize_for_inference(_vision_model(), "int8")
    with pytest.raises(ValueError, match="already prepared"):
        optimize_for_inference(model, "bf16")
    with pytest.raises(ValueError, match="runs on the CPU"):
        optimize_for_inference(_vision_model().to("meta"), "int8")


def test_compile_without_a_compiler_warns_and_leaves_the_model_eager(monkeypatch):
    monkeypatch.setattr(linear_layers.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    model = _vision_model()
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        optimize_for_inference(model, "fp32", compile=True)
    assert model.inference_settings["compile"] is False
    assert all(layer._compiled_call_impl is None for layer in model.layers)


def test_compiled_bf16_takes_eagers_merges_and_outputs(monkeypatch):
    """Inductor compiled the merge of 9d08ceb wrongly when the blocks' linears were bf16 (on this tiny encoder:
    last-hidden-state cosine 0.21 and 0.33 against eager bf16; on the demo model 0.11-0.19), so compiled bf16 was
    refused. The cause was the merge's in-place ``scatter_add_`` into the whole ``cat`` output at offset indices; the
    merge now writes through a view of the output's B part, and the compiled encoder equals eager. ``auto`` with
    ``compile=True`` picks bf16 on a GPU again."""
    from modeling_testa import TestaVisionConfig, TestaVisionModel
    from testa_runtimes.registry import choose
    from testa_runtimes.torch_eager import TorchEagerRuntime

    torch.manual_seed(0)
    config = TestaVisionConfig(num_frames=4, image_size=32, patch_size=16, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=128, temporal_reduction=1, spatial_reduction=2)
    reference = TestaVisionModel(config).eval()
    eager = optimize_for_inference(copy.deepcopy(reference), "bf16")
    torch._dynamo.reset()
    compiled = optimize_for_inference(copy.deepcopy(reference), "bf16", compile=True)
    if not compiled.inference_settings["compile"]:
        skip_or_fail("TorchInductor needs a C++ compiler on the CPU", "apt-get install g++")
    video = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, got = eager(video, trace_source=True), compiled(video, trace_source=True)
    assert torch.equal(got.source_map, expected.source_map)  # the same merge decisions
    cosine = F.cosine_similarity(got.last_hidden_state.flatten(1), expected.last_hidden_state.flatten(1))
    assert cosine.min() > 0.9999, cosine
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, atol=2e-2, rtol=2e-2)
    import testa_runtimes.registry as registry

    monkeypatch.setattr(registry, "device_type", lambda module: "cuda")  # what `choose` reads of the model
    assert choose("torch", "auto", reference, compile=True) == (TorchEagerRuntime, "bf16")


@pytest.mark.slow
def test_compiled_fp32_matches_eager():
    reference = _vision_model()
    model = optimize_for_inference(copy.deepcopy(reference), "fp32", compile=True)
    assert model.inference_settings["compile"] is True
    video = _video()
    with torch.inference_mode():
        torch.testing.assert_close(model(video).last_hidden_state, reference(video).last_hidden_state,
                                   atol=1e-4, rtol=1e-4)


def test_include_text_converts_the_text_transformers_only():
    model = optimize_for_inference(build_qa(), "int8", include_text=True)
    assert isinstance(model.text_encoder.encoder.layer[0].attention.self.query, Int8DynamicLinear)
    assert isinstance(model.text_decoder.bert.encoder.layer[0].attention.self.query, Int8DynamicLinear)
    assert type(model.text_decoder.cls.predictions.decoder) is nn.Linear  # the LM head, tied to the embeddings
    answers = model.generate(torch.tensor([[101, 2054, 2003, 102]]), torch.randn(1, 4, 3, 32, 32), max_new_tokens=3)
    assert answers.shape[0] == 1
    retrieval = optimize_for_inference(build_retrieval(), "bf16")  # by default only the video encoder
    assert type(retrieval.text_encoder.encoder.layer[0].attention.self.query) is nn.Linear
    assert type(retrieval.vision_proj) is nn.Linear and type(retrieval.itm_head) is nn.Linear
    assert not any(isinstance(m, (Int8DynamicLinear, Bf16Linear)) for m in retrieval.momentum.vision_model.modules())


# ------------------------------------------------------------------------------------------------ the int8 layer


def _hand_int8_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Float64 re-computation: weights rounded per output channel to [-127, 127] with scale max|w| / 127;
    activations per tensor to 7-bit unsigned (the range of x widened to 0, 127 steps, zero point rounded)."""
    w = linear.weight.double()
    w_scale = w.abs().amax(dim=1) / 127
    w_int = torch.round(w / w_scale[:, None]).clamp(-127, 127)
    xd = x.double().reshape(-1, linear.in_features)
    low, high = min(float(xd.min()), 0.0), max(float(xd.max()), 0.0)
    x_scale = (high - low) / 127
    zero = min(max(round(-low / x_scale), 0), 127)
    x_int = torch.clamp(torch.round(xd / x_scale) + zero, 0, 127)
    y = ((x_int - zero) * x_scale) @ (w_int * w_scale[:, None]).T + linear.bias.double()
    return y.view(*x.shape[:-1], linear.out_features)


def test_int8_linear_matches_a_hand_computed_reference():
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    with torch.no_grad():  # output channels of very different magnitudes: per-tensor weight scales would fail
        linear.weight.mul_(torch.logspace(-3, 2, 40)[:, None])
    layer = Int8DynamicLinear(linear)
    x = torch.randn(2, 17, 96) * 3 + 0.5
    got = layer(x).double()
    reference = _hand_int8_linear(linear, x)
    exact = linear(x).double()
    scale = exact.abs().amax(dim=(0, 1))  # per output channel
    assert ((got - reference).abs().amax(dim=(0, 1)) / scale).max() < 1e-5
    # ... while int8 itself is visibly not fp32 (so the comparison above means something), in every channel
    assert ((got - exact).abs().amax(dim=(0, 1)) / scale).max() > 1e-3
    assert ((got - exact).abs().amax(dim=(0, 1)) / scale).max() < 0.05
    assert torch.equal(layer.dequantized_weight(), layer.qweight.float() * layer.weight_scale[:, None])
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127


def test_int8_quantizes_activations_per_video():
    """A batch gives each video what it gets alone, even next to a video with a 10x larger range."""
    model = optimize_for_inference(_vision_model(), "int8")
    video = _video(batch=2)
    video[1] *= 10
    with torch.inference_mode():
        batched = model(video).last_hidden_state
        alone = torch.cat([model(video[i : i + 1]).last_hidden_state for i in range(2)])
    assert torch.equal(batched, alone)


# ------------------------------------------------------------------------------------------------ quality vs fp32


@pytest.mark.parametrize("precision, threshold", [("bf16", 0.9999), ("int8", 0.999)])
def test_pooled_embeddings_stay_close_to_fp32(precision, threshold):
    """On the clear-cut video (the same merge decisions as fp32, checked below). Where two merges are nearly tied,
    any change of the arithmetic can flip one and move the embedding further; see docs/inference.md's quality contract."""
    reference, video = _clear_cut_model_and_video()
    model = optimize_for_inference(copy.deepcopy(reference), precision)
    with torch.inference_mode():
        expected, got = reference(video), model(video)
    for pooled in (lambda out: out.pooler_output, lambda out: out.last_hidden_state.mean(dim=1)):
        cosine = F.cosine_similarity(pooled(got), pooled(expected))
        assert cosine.min() > threshold, cosine
    assert not torch.allclose(got.pooler_output, expected.pooler_output, atol=1e-6)  # it did change the arithmetic


def _clear_cut_model_and_video():
    """One reduction step (block 0: R_T=1, R_S=1), no temporal or spatial position embedding, and a video where
    exactly one pair of frames and, in every frame, exactly one pair of patches are identical: each is the only pair
    with similarity 1, far above every other pair."""
    model = _vision_model(temporal_reduction=[1, 0], spatial_reduction=[1, 0])
    with torch.no_grad():
        model.embeddings.position_embedding.zero_()
        model.embeddings.temporal_embedding.zero_()
    video = _video(batch=2)
    video[:, 3] = video[:, 2]  # frames 2 (set A) and 3 (set B)
    video[..., 0:8, 8:16] = video[..., 0:8, 0:8]  # patches 0 and 1 of every frame
    return model, video


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_merging_decisions_match_fp32_on_clear_cut_similarities(precision):
    reference, video = _clear_cut_model_and_video()
    model = optimize_for_inference(copy.deepcopy(reference), precision)
    with torch.inference_mode():
        expected = reference(video, trace_source=True)
        got = model(video, trace_source=True)
    # the fixture is what it claims: fp32 merged frames 2 and 3, and patches 0 and 1 of every frame
    assert (expected.source_map[:, 2] == expected.source_map[:, 3]).all()
    assert (expected.source_map[:, :, 0] == expected.source_map[:, :, 1]).all()
    assert torch.equal(got.source_map, expected.source_map)
    assert torch.equal(got.token_sizes, expected.token_sizes)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_matching_and_merging_run_in_fp32(precision, monkeypatch):
    """The matcher's similarity features, the token sizes and the merged tokens are fp32 in every precision."""
    seen = []

    def spy(function):
        def wrapper(*args, **kwargs):
            seen.append((function.__name__, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
            return function(*args, **kwargs)

        return wrapper

    for name in ("geometry_matching", "merge_tokens"):
        monkeypatch.setattr(aggregation_block, name, spy(getattr(aggregation_block, name)))
    model = optimize_for_inference(_vision_model(), precision)
    with torch.inference_mode():
        out = model(_video())
    assert {name for name, _ in seen} == {"geometry_matching", "merge_tokens"}
    assert all(dtype == torch.float32 for _, dtypes in seen for dtype in dtypes), seen
    assert out.token_sizes.dtype == torch.float32 and out.last_hidden_state.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ saving refuses


def test_save_pretrained_refuses_an_optimized_model(tmp_path):
    model = build_retrieval()
    optimize_for_inference(model, "int8")
    for target in (model, model.vision_model):
        folder = tmp_path / type(target).__name__
        with pytest.raises(RuntimeError, match=r"optimize_for_inference \(precision='int8'.*inference only") as error:
            target.save_pretrained(folder)
        assert "Save the original model" in str(error.value)
        assert not folder.exists() or not any(folder.iterdir())


# ------------------------------------------------------------------------------------------------ pipelines


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    require("av")
    return write_videos(tmp_path_factory.mktemp("inference") / "videos")


@pytest.fixture(scope="module")
def retrieval_pipe():
    return pipeline("video-text-retrieval", model=build_retrieval(), processor=tiny_processor(), device="cpu")


def test_pipeline_precision_option(videos, tmp_path):
    processor = tiny_processor()
    plain = pipeline("video-text-retrieval", model=build_retrieval(), processor=processor, device="cpu")
    fast = pipeline("video-text-retrieval", model=build_retrieval(), processor=processor, device="cpu",
                    precision="int8")
    assert sum(isinstance(m, Int8DynamicLinear) for m in fast.model.modules()) == 2 * LINEARS_PER_LAYER
    assert not any(isinstance(m, Int8DynamicLinear) for m in plain.model.modules())
    expected = plain.encode_videos(videos)
    got = fast.encode_videos(videos)
    cosine = (got.embeddings * expected.embeddings).sum(dim=1)
    assert cosine.min() > 0.98 and not torch.equal(got.embeddings, expected.embeddings)
    result = fast(text="a red square", videos=videos[:3], top_k=2)
    assert len(result) == 2 and {"video", "score", "reranked"} <= set(result[0])
    with pytest.raises(RuntimeError, match="inference only"):
        fast.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"'fp32', 'bf16', 'int8'"):
        pipeline("video-text-retrieval", model=build_retrieval(), processor=processor, precision="int4")
    with pytest.raises(ValueError, match="go with `precision`"):
        pipeline("video-text-retrieval", model=build_retrieval(), processor=processor, compile=True)


# ------------------------------------------------------------------------------------------------ parallel decoding


def test_encode_videos_with_workers_matches_sequential_in_order(retrieval_pipe, videos, monkeypatch):
    used = set()
    open_video = video_decoding.DecoderProcess.open

    def recording(self, *args, **kwargs):
        used.add(id(self))
        return open_video(self, *args, **kwargs)

    monkeypatch.setattr(video_decoding.DecoderProcess, "open", recording)
    order = videos[::-1] + videos[:2]  # 7 videos, a repeat included
    expected = retrieval_pipe.encode_videos(order, batch_size=3)
    shared = set(used)
    used.clear()
    got = retrieval_pipe.encode_videos(order, batch_size=3, num_workers=2)
    assert got.videos == expected.videos == order[:5]  # a video given twice is one row
    for name in ("embeddings", "tokens", "token_sizes"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert len(used) == 2 and not used & shared  # two helper processes of the threads' own, not the shared one
    for stats in (expected.stats, got.stats):
        assert stats["videos"] == 5 and stats["videos_per_second"] > 0
        assert 0 < stats["decode_wait_seconds"] <= stats["seconds"] and 0 < stats["encode_seconds"] <= stats["seconds"]
    assert (expected.stats["num_workers"], got.stats["num_workers"]) == (0, 2)
    assert all(worker.process is None for worker in video_decoding._OWN_WORKERS)  # stopped afterwards


def test_encode_videos_with_workers_names_a_bad_file(retrieval_pipe, videos, tmp_path):
    bad = write_bad_files(tmp_path / "bad", videos[1])["truncated"]
    batch = videos[:3] + [bad] + videos[3:]
    for workers in (0, 2):
        with pytest.raises(ValueError, match=rf"{os.path.basename(bad)}") as error:
            retrieval_pipe.encode_videos(batch, batch_size=2, num_workers=workers, on_error="raise")
        assert isinstance(error.value, video_decoding.VideoDecodingError)
    with pytest.raises(ValueError, match="num_workers"):
        retrieval_pipe.encode_videos(videos, num_workers=-1)


def _importance_model() -> TestaVisionModel:
    from modeling_testa import TestaVisionConfig

    torch.manual_seed(0)
    config = TestaVisionConfig(num_frames=4, image_size=32, patch_size=16, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=128, temporal_reduction=1, spatial_reduction=2,
                               aggregation_strategy="importance")
    return TestaVisionModel(config).eval()


def test_compiling_the_importance_strategy_is_refused_before_and_after_set_aggregation(monkeypatch):
    """TorchInductor compiles the importance strategy's merges wrongly (see the slow test below): refused when asked,
    and a compiled model switched to it by `set_aggregation` refuses to run rather than answer (the compiler is
    stubbed here: what is tested is the runtime's check, not TorchInductor)."""
    import testa_runtimes.torch_eager as torch_eager

    model = _importance_model()
    with pytest.raises(ValueError, match="aggregation_strategy='importance'"):
        optimize_for_inference(model, "fp32", compile=True)
    assert getattr(model, "inference_settings", None) is None
    monkeypatch.setattr(torch_eager, "compile_blocks", lambda vision: True)
    pruning = _importance_model()
    pruning.set_aggregation(reduction_mode="prune")  # compiles right: allowed
    assert optimize_for_inference(pruning, "fp32", compile=True).inference_settings["compile"] is True
    video = torch.randn(1, 4, 3, 32, 32)
    pruning(video)
    pruning.set_aggregation(reduction_mode="merge")
    with pytest.raises(ValueError, match="aggregation_strategy='importance'"):
        pruning(video)
    uncompiled = optimize_for_inference(_importance_model(), "fp32")
    uncompiled(video)  # eager importance merging runs


@pytest.mark.slow
def test_inductor_still_compiles_the_importance_merge_wrongly():
    """Why the refusal above exists: the importance strategy compiled by TorchInductor (bypassing the refusal)
    against eager, fp32. When this test fails, TorchInductor got it right: lift `COMPILED_IMPORTANCE_REFUSAL`."""
    from testa_runtimes.linear_layers import compile_blocks

    reference = _importance_model()
    compiled = copy.deepcopy(reference)
    torch._dynamo.reset()
    if not compile_blocks(compiled):
        skip_or_fail("TorchInductor needs a C++ compiler on the CPU", "apt-get install g++")
    video = torch.randn(2, 4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, got = reference(video).last_hidden_state, compiled(video).last_hidden_state
    cosine = F.cosine_similarity(got.flatten(1), expected.flatten(1))
    assert cosine.min() < 0.99, cosine
