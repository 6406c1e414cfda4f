"""Qwen vision towers run in chunks of frames (`video_llms.qwen_tower.run_tower_chunked`, the ``chunk_frames`` option
of `apply_testa_to_video_llm`), on tiny offline models (`helpers.video_llms`).

References: the one-pass tower of the same patched model (features, positions, sizes and DeepStack features within
1e-5, with and without TESTA, temporal merges across chunk edges included) and the stock model (R = 0, chunked:
logits within 1e-5 and the same greedy tokens); hooks on the blocks' MLPs show that no block ever sees more than
one chunk's tokens."""

import itertools

import pytest
import torch

from helpers import video_llms as tiny

from video_llms import apply_testa_to_video_llm, remove_testa_from_video_llm

# Two videos of different lengths: 8 frames (4 tubelets) and 6 frames (3 tubelets), 4 merge units per tubelet
# (Qwen3-VL: 2x2 units at 64x64 px; Qwen2.5-VL at 112x84 px: 4x3 units in 4 uneven windows).
VIDEOS = (8, 6)
SCHEDULES = {
    "idle": {},
    "temporal+spatial": {"temporal_reduction": [1, 0, 1, 0], "spatial_reduction": [0, 1, 1, 0]},
    "temporal first block": {"temporal_reduction": [1, 0, 0, 0]},
    "spatial only": {"spatial_reduction": [1, 0, 1, 0]},
}


def _model(family: str, attention: str = "sdpa"):
    if family == "qwen2_5_vl":
        return tiny.qwen2_5_vl(attention, frame_pixels=112 * 84)
    return tiny.qwen3_vl(attention)


def _inputs(family: str, processor, frames=VIDEOS):
    texts = [tiny.prompt(processor, text) for text, _ in zip(itertools.cycle(["describe the video", "what happens"]),
                                                               frames)]
    if family == "qwen2_5_vl":
        videos = [tiny.video(count, i, 84, 112) for i, count in enumerate(frames)]
        return processor(text=texts, videos=videos, return_tensors="pt", padding=True)
    videos = [tiny.video(count, i, 64, 64) for i, count in enumerate(frames)]
    return processor(text=texts, videos=videos, video_metadata=[tiny.metadata(count) for count in frames],
                     return_tensors="pt", padding=True)


def _encode(model, inputs, chunk_frames):
    patch = model.testa_video_llm
    with torch.no_grad():
        return patch.adapter.encode(model.model, inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                    patch.settings, chunk_frames)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_chunked_tower_equals_one_pass(family, schedule):
    """Chunks of 1 and 2 tubelets (the 3-tubelet video's last chunk shorter): the same tokens, centroids, sizes and
    DeepStack features as the one-pass tower, in the same order."""
    model, processor = _model(family)
    apply_testa_to_video_llm(model, processor, **SCHEDULES[schedule])
    inputs = _inputs(family, processor)
    one_pass = _encode(model, inputs, None)
    for chunk_frames in (2, 4):
        chunked = _encode(model, inputs, chunk_frames)
        for whole, parts in zip(one_pass, chunked):
            assert parts.grid == whole.grid
            torch.testing.assert_close(parts.features, whole.features, atol=1e-5, rtol=0)
            torch.testing.assert_close(parts.positions, whole.positions, atol=1e-6, rtol=0)
            assert torch.equal(parts.sizes, whole.sizes)
            assert len(parts.deepstack) == len(whole.deepstack) == (2 if family == "qwen3_vl" else 0)
            for a, b in zip(parts.deepstack, whole.deepstack):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if "temporal" in schedule:  # with one tubelet per chunk, every temporal merge joins tubelets of two chunks
        times = torch.cat([video.positions[:, 0] for video in one_pass])
        assert bool((times != times.round()).any())


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_chunked_idle_model_equals_stock(family, attention):
    """R = 0 with ``chunk_frames=2`` (one tubelet at a time): the stock logits within 1e-5 and the same greedy
    tokens, for a batch of two videos of different lengths."""
    model, processor = _model(family, attention)
    inputs = _inputs(family, processor)
    with torch.no_grad():
        stock_logits = model(**inputs).logits
        stock_tokens = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    apply_testa_to_video_llm(model, processor, chunk_frames=2)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, stock_logits, atol=1e-5, rtol=0)
            assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), stock_tokens)
    finally:
        remove_testa_from_video_llm(model)


@pytest.mark.parametrize("schedule", ["idle", "temporal+spatial"])
def test_no_block_sees_more_than_a_chunk(schedule):
    """Hooks on every block's MLP and attention record the tokens they get: one tubelet's at ``chunk_frames=2``
    (48 tokens at 112x84 px: 8x6 patches), the whole batch's without chunks."""
    model, processor = _model("qwen2_5_vl")
    apply_testa_to_video_llm(model, processor, **SCHEDULES[schedule])
    inputs = _inputs("qwen2_5_vl", processor)
    seen = []
    hooks = [module.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
             for block in model.model.visual.blocks for module in (block.mlp, block.attn.qkv)]
    try:
        _encode(model, inputs, 2)
        assert max(seen) == 48
        seen.clear()
        _encode(model, inputs, None)
        assert max(seen) == 7 * 48
    finally:
        for hook in hooks:
            hook.remove()


def test_bad_chunk_frames_are_refused_by_name():
    model, processor = _model("qwen3_vl")
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match="chunk_frames"):
            apply_testa_to_video_llm(model, processor, chunk_frames=bad)
    with pytest.raises(ValueError, match="chunk_frames=3 must be a multiple"):
        apply_testa_to_video_llm(model, processor, chunk_frames=3)
    assert "testa_video_llm" not in model.__dict__ and "get_video_features" not in model.model.__dict__


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("schedule", ["idle", "spatial only", "temporal+spatial"])
def test_patch_embedding_runs_per_chunk(family, schedule):
    """The patch embedding (and Qwen3-VL's learned positions with it) runs once per chunk, on that chunk's patches
    only, when the chunk starts: without temporal merges each chunk reaches the patch merger before the next one is
    embedded, so no more than one chunk's embedding ever exists. Counted with hooks (rows per call, in call order),
    not timed or measured."""
    model, processor = _model(family)
    apply_testa_to_video_llm(model, processor, **SCHEDULES[schedule])
    inputs = _inputs(family, processor)
    visual = model.model.visual
    events = []
    hooks = [visual.patch_embed.register_forward_hook(lambda m, args, out: events.append(("embed", args[0].shape[0]))),
             visual.merger.register_forward_hook(lambda m, args, out: events.append(("merger", args[0].shape[0])))]
    try:
        _encode(model, inputs, 2)  # one tubelet (2 frames) per chunk
    finally:
        for hook in hooks:
            hook.remove()
    patches = [int(h * w) for _, h, w in inputs["video_grid_thw"].tolist()]
    tubelets = [int(t) for t in inputs["video_grid_thw"][:, 0].tolist()]
    embeds = [rows for name, rows in events if name == "embed"]
    assert embeds == [p for p, t in zip(patches, tubelets) for _ in range(t)]  # one call per tubelet, its patches
    if "temporal" not in schedule:  # depth first: embed, merger, embed, merger, ...
        assert [name for name, _ in events] == ["embed", "merger"] * sum(tubelets)
    else:  # the first temporal merge (block 0) needs every chunk's block-0 attention: then all embeddings come first
        first_merger = [name for name, _ in events].index("merger")
        assert first_merger == tubelets[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_video_gives_the_same_outputs(family, offload, tmp_path, monkeypatch):
    """``chunk_offload``: the slices that wait at a temporal merge leave the tower (host memory, or files) and come
    back as they were: the outputs equal the chunked tower's without offload exactly, through `generate` too; on
    disk the slices are written while the tower runs (each file read back and deleted at its merge), and the
    temporary directory is gone afterwards."""
    import video_llms.qwen_tower as qwen_tower

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    model, processor = _model(family)
    schedule = SCHEDULES["temporal+spatial"]
    apply_testa_to_video_llm(model, processor, chunk_frames=2, **schedule)
    inputs = _inputs(family, processor)  # the patched processor: the reduced placeholder count
    held = _encode(model, inputs, 2)
    with torch.no_grad():
        held_tokens = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    written = []
    put = qwen_tower.SliceShelf.put

    def recording_put(shelf, record):
        record = put(shelf, record)
        if offload == "disk":
            assert isinstance(record.tokens, str) and record.carried is None
            written.append(record.tokens)
        else:
            assert record.tokens.device.type == "cpu"
        return record

    monkeypatch.setattr(qwen_tower.SliceShelf, "put", recording_put)
    apply_testa_to_video_llm(model, processor, chunk_frames=2, chunk_offload=offload, **schedule)
    patch = model.testa_video_llm
    with torch.no_grad():
        offloaded = patch.adapter.encode(model.model, inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                         patch.settings, 2, offload)
        assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), held_tokens)
    for a, b in zip(offloaded, held):
        assert torch.equal(a.features, b.features) and torch.equal(a.positions, b.positions)
        assert torch.equal(a.sizes, b.sizes) and all(map(torch.equal, a.deepstack, b.deepstack))
    if offload == "disk":
        assert written and all(path.startswith(str(tmp_path)) for path in written)
        assert not any(tmp_path.iterdir())  # every file read back and deleted, the directory removed


def test_offloaded_directory_is_removed_when_the_tower_fails(tmp_path, monkeypatch):
    """A tower that raises halfway (here: at the first merge of the whole video) leaves no temporary files."""
    import video_llms.qwen_tower as qwen_tower

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    model, processor = _model("qwen2_5_vl")
    apply_testa_to_video_llm(model, processor, chunk_frames=2, chunk_offload="disk",
                             **SCHEDULES["temporal+spatial"])

    def failing_merge(*args, **kwargs):
        assert any(tmp_path.iterdir())  # the slices are on disk when the merge starts
        raise RuntimeError("merge failed")
        yield

    monkeypatch.setattr(qwen_tower, "merge_slice_records", failing_merge)
    with pytest.raises(RuntimeError, match="merge failed"):
        model.model.get_video_features(**{k: _inputs("qwen2_5_vl", processor)[k]
                                          for k in ("pixel_values_videos", "video_grid_thw")})
    assert not any(tmp_path.iterdir())


def test_bad_chunk_offload_is_refused_by_name():
    import video_llms.qwen_tower as qwen_tower

    model, processor = _model("qwen3_vl")
    for bad in ("gpu", "Disk", 1, True):
        with pytest.raises(ValueError, match=r"chunk_offload must be None, 'cpu' or 'disk'; got"):
            apply_testa_to_video_llm(model, processor, chunk_frames=2, chunk_offload=bad)
    with pytest.raises(ValueError, match="chunk_offload='disk' says where a tower run in chunks.*pass chunk_frames"):
        apply_testa_to_video_llm(model, processor, chunk_offload="disk")  # without chunks it would do nothing
    with pytest.raises(ValueError, match="chunk_offload must be None"):
        qwen_tower.SliceShelf("gpu")
    assert "testa_video_llm" not in model.__dict__
