"""Tests of TestaVideoProcessor (`modeling_testa.video_processing_testa`): batches of real mp4 files, RGB
conversion, the numbers against a manual reference, defaults and dtypes, sampling by frame rate, saving and loading."""

import json

import numpy as np
import PIL.Image
import pytest
import torch
import torchvision.transforms.v2.functional as tvF
from helpers.videos import RAW, random_clip, read_index, uniform, write_test_videos

from modeling_testa import TestaVideoProcessor, decode_video


CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Real H.264 mp4s of different lengths, frame rates and sizes; one grayscale; plus broken files."""
    return write_test_videos(tmp_path_factory.mktemp("videos"))


def test_batch_of_files_with_different_sizes_and_fps(videos):
    vp = TestaVideoProcessor(num_frames=4)
    paths = [videos["long"], str(videos["small"]), videos["gray"], videos["short"]]
    out = vp(paths, return_metadata=True)
    assert out["pixel_values"].shape == (4, 4, 3, 224, 224) and out["pixel_values"].dtype == torch.float32
    metas = out["video_metadata"]
    assert [m.total_num_frames for m in metas] == [90, 50, 40, 5]
    assert [m.fps for m in metas] == [30, 25, 24, 10]
    assert [(m.width, m.height) for m in metas] == [(320, 240), (176, 144), (208, 160), (192, 160)]
    frames, metas = vp.fetch_videos([videos["long"], videos["short"]], sample_indices_fn=lambda metadata: [0, 1])
    assert [f.shape for f in frames] == [(2, 240, 320, 3), (2, 160, 192, 3)]
    assert [read_index(f) for f in frames[1]] == [0, 1]
    for backend in ("decord", "pyav"):  # any order and repeats, as requested
        for wanted in ([70, 3, 12], [70, 3, 70, 12]):
            frames, meta = vp.fetch_videos(videos["long"], lambda metadata: wanted, video_backend=backend)
            assert [read_index(f) for f in frames] == wanted == meta.frames_indices


def test_grayscale_video_becomes_rgb(videos):
    out = TestaVideoProcessor(num_frames=4)(videos["gray"], **RAW)["pixel_values"][0]
    assert out.shape[1] == 3
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])
    frames = [PIL.Image.fromarray(np.full((20, 30), v, np.uint8), mode="L") for v in (0, 128, 255)]
    out = TestaVideoProcessor(num_frames=3)(frames, **RAW)["pixel_values"][0]
    assert out.shape == (3, 3, 20, 30) and out[1].unique().tolist() == [128.0]


def test_full_pipeline_numbers_match_a_manual_reference(videos):
    frames, _ = decode_video(videos["small"], lambda m: uniform(m.total_num_frames, 4), backend="pyav")
    clip = torch.from_numpy(frames).permute(0, 3, 1, 2)
    square = tvF.resize(clip, [224, 224], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    expected = (square.float() / 255 - CLIP_MEAN) / CLIP_STD
    out = TestaVideoProcessor(num_frames=4, video_backend="pyav")(videos["small"])["pixel_values"][0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

    # shortest edge (144 -> 224, width 176 -> 273) then a center crop to 224 x 224
    resized = tvF.resize(clip, [224, 273], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
    left = (273 - 224) // 2
    expected = (resized[..., :, left : left + 224].float() / 255 - CLIP_MEAN) / CLIP_STD
    out = TestaVideoProcessor(num_frames=4, video_backend="pyav", resize_mode="shortest_edge")(videos["small"])
    torch.testing.assert_close(out["pixel_values"][0], expected, atol=1e-5, rtol=1e-5)


def test_defaults_dtype_and_array_metadata():
    vp = TestaVideoProcessor()
    assert vp.num_frames == 32 and vp.crop_size.height == vp.crop_size.width == 224
    assert vp.frame_sampling == "uniform" and vp.resize_mode == "square" and vp.video_backend == "auto"
    clip = np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1).repeat(20, 1).repeat(30, 2).repeat(3, 3)
    out = vp(clip, num_frames=4, return_metadata=True, video_metadata={"fps": 5.0}, **RAW)
    meta = out["video_metadata"][0]
    assert meta.frames_indices == uniform(10, 4) == [1, 3, 6, 8]
    assert out["pixel_values"][0, :, 0, 0, 0].tolist() == [1.0, 3.0, 6.0, 8.0]  # the sampled frames
    assert meta.timestamps == [0.2, 0.6, 1.2, 1.6] and meta.duration == 2.0
    assert vp(clip, dtype="bfloat16")["pixel_values"].dtype == torch.bfloat16
    assert TestaVideoProcessor(dtype=torch.float16)(clip)["pixel_values"].dtype == torch.float16
    assert isinstance(vp(clip, return_tensors="np")["pixel_values"], np.ndarray)
    listed = vp([clip, clip[:, :10]], return_tensors=None, do_sample_frames=False, **RAW)["pixel_values"]
    assert [tuple(p.shape) for p in listed] == [(10, 3, 20, 30), (10, 3, 10, 30)]


def test_processor_rejects_bad_sampling_arguments():
    with pytest.raises(ValueError, match="num_frames"):
        TestaVideoProcessor(num_frames=0)
    # sampling by fps (issue #24) needs the frame rate, which an array only has through `video_metadata`
    with pytest.raises(ValueError, match=r"fps=2.*frame rate of videos.*video_metadata"):
        TestaVideoProcessor()(np.zeros((4, 8, 8, 3), np.uint8), fps=2)


# ----------------------------------------------------------------------------------------------------------------------
# sampling by frame rate (issue #24): transformers' count, max(1, int(frames / video_fps * fps)), uniform midpoints
# ----------------------------------------------------------------------------------------------------------------------


def test_fps_sampling_of_a_file(videos):
    vp = TestaVideoProcessor()
    out = vp(videos["long"], fps=2, return_metadata=True, **RAW)  # 90 frames at 30 fps: 3 s -> 6 frames
    meta = out["video_metadata"][0]
    assert meta.frames_indices == [7, 22, 37, 52, 67, 82]  # midpoints of 6 segments of 15 frames
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == [7, 22, 37, 52, 67, 82]
    assert meta.timestamps == pytest.approx([7 / 30, 22 / 30, 37 / 30, 52 / 30, 67 / 30, 82 / 30])
    random = vp(videos["long"], fps=2, frame_sampling="random", seed=0, return_metadata=True, **RAW)
    assert all(15 * i <= j < 15 * (i + 1) for i, j in enumerate(random["video_metadata"][0].frames_indices))
    with pytest.raises(ValueError, match=r"short\.mp4 at fps=20 asks for 10 frames, but it has only 5"):
        vp(videos["short"], fps=20)  # 5 frames at 10 fps: more frames than there are, as transformers refuses


def test_fps_sampling_of_arrays_uses_video_metadata():
    clip = np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1).repeat(20, 1).repeat(30, 2).repeat(3, 3)
    vp = TestaVideoProcessor()
    out = vp(clip, fps=2, video_metadata={"fps": 5.0}, return_metadata=True, **RAW)  # 2 s -> 4 frames
    assert out["video_metadata"][0].frames_indices == [1, 3, 6, 8]
    assert out["pixel_values"][0, :, 0, 0, 0].tolist() == [1.0, 3.0, 6.0, 8.0]
    with pytest.raises(ValueError, match=r"fps=2.*frame rate of videos\[1\].*video_metadata"):
        vp([clip, clip], fps=2, video_metadata=[{"fps": 5.0}, {}])


def test_fps_batches_follow_the_durations(videos):
    vp = TestaVideoProcessor()
    out = vp([videos["long"], videos["small"]], fps=1, return_tensors=None, return_metadata=True, **RAW)
    assert [m.frames_indices for m in out["video_metadata"]] == [[15, 45, 75], [12, 37]]  # 3 s and 2 s
    assert [tuple(p.shape[:2]) for p in out["pixel_values"]] == [(3, 3), (2, 3)]
    with pytest.raises(ValueError, match="different shapes.*fixed num_frames"):
        vp([videos["long"], videos["small"]], fps=1)


def test_num_frames_and_fps_are_mutually_exclusive_and_a_call_overrides_the_setting(videos, tmp_path):
    with pytest.raises(ValueError, match="`num_frames` and `fps` are mutually exclusive"):
        TestaVideoProcessor()(videos["long"], num_frames=4, fps=2)
    with pytest.raises(ValueError, match="`num_frames` and `fps` are mutually exclusive"):
        TestaVideoProcessor(num_frames=8, fps=2)
    with pytest.raises(ValueError, match="`fps` must be a positive number"):
        TestaVideoProcessor(fps=-1)
    by_rate = TestaVideoProcessor(fps=2)
    assert by_rate.num_frames is None and by_rate.fps == 2
    assert by_rate(videos["long"], return_metadata=True)["video_metadata"][0].frames_indices == [7, 22, 37, 52, 67, 82]
    by_count = by_rate(videos["long"], num_frames=4, return_metadata=True)["video_metadata"][0]
    assert by_count.frames_indices == [11, 33, 56, 78]  # the call's num_frames replaces the setting
    by_rate.save_pretrained(tmp_path)
    loaded = TestaVideoProcessor.from_pretrained(tmp_path)
    assert loaded.to_dict() == by_rate.to_dict() and loaded.fps == 2 and loaded.num_frames is None
    assert TestaVideoProcessor(num_frames=4)(videos["long"], fps=1, return_metadata=True)["video_metadata"][
        0].frames_indices == [15, 45, 75]  # and the call's fps replaces a processor's num_frames


# ----------------------------------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    from transformers import AutoVideoProcessor

    vp = TestaVideoProcessor(num_frames=8, frame_sampling="headtail", resize_mode="shortest_edge",
                             dtype=torch.bfloat16, video_backend="pyav", crop_size={"height": 112, "width": 96})
    before = vp.to_dict()
    vp.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video_decoding.py", "video_decoding_worker.py",
                                                          "video_inputs.py", "video_preprocessor_config.json",
                                                          "video_processing_testa.py", "worker_process.py"]
    saved = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    assert saved["auto_map"] == {"AutoVideoProcessor": "video_processing_testa.TestaVideoProcessor"}
    assert saved["num_frames"] == 8 and saved["dtype"] == "bfloat16" and saved["frame_sampling"] == "headtail"

    local = TestaVideoProcessor.from_pretrained(tmp_path)
    remote = AutoVideoProcessor.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(remote).__name__ == "TestaVideoProcessor"  # the local registration wins in this process; the
    # pure remote-code load (modeling_testa not importable) is tested in test_processing_testa.py
    clip = random_clip(t=12)
    expected = vp(clip, seed=0)["pixel_values"]
    assert expected.shape == (1, 8, 3, 112, 96) and expected.dtype == torch.bfloat16
    # the round trip is exact (issue #24): `auto_map` is written to the file, and is no setting of the processor
    assert vp.to_dict() == before and "auto_map" not in before
    for loaded in (local, remote):
        assert loaded.to_dict() == vp.to_dict()
        assert torch.equal(loaded(clip, seed=0)["pixel_values"], expected)
    local.save_pretrained(tmp_path / "again")  # saving the loaded copy writes the same file
    assert (tmp_path / "again" / "video_preprocessor_config.json").read_text() == json.dumps(saved, indent=2,
                                                                                               sort_keys=True) + "\n"


def test_dtype_auto_means_float32(tmp_path):
    """`pipeline()` and `from_pretrained(..., dtype="auto")` pass the model's "auto" dtype to the processor."""
    from modeling_testa import TestaVideoProcessor

    TestaVideoProcessor(num_frames=2, size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(tmp_path)
    loaded = TestaVideoProcessor.from_pretrained(tmp_path, dtype="auto")
    frames = np.zeros((3, 20, 20, 3), dtype=np.uint8)
    assert loaded(videos=[frames])["pixel_values"].dtype == torch.float32
    assert TestaVideoProcessor(dtype="bfloat16")(videos=[frames])["pixel_values"].dtype == torch.bfloat16
