"""The one input normalisation (`modeling_testa.video_inputs`): every accepted layout of a video, and clear errors
naming the input, both through TestaVideoProcessor and through the functions the pipelines use."""

import numpy as np
import PIL.Image
import pytest
import torch
from helpers.videos import random_clip

from modeling_testa import TestaVideoProcessor
from modeling_testa.video_inputs import (
    check_video,
    describe,
    flatten_video_inputs,
    is_frame,
    is_single_video,
    metadata_per_video,
    text_list,
    to_rgb,
    video_list,
    video_to_tensor,
)


def test_all_input_layouts_give_the_same_output():
    clip = random_clip()
    vp = TestaVideoProcessor(num_frames=4, crop_size={"height": 40, "width": 48})  # square resize to own size
    reference = vp(clip)["pixel_values"]
    assert reference.shape == (1, 4, 3, 40, 48)
    tchw = torch.from_numpy(clip).permute(0, 3, 1, 2)
    variants = {
        "THWC tensor": torch.from_numpy(clip),
        "TCHW tensor": tchw,
        "TCHW numpy": tchw.numpy(),
        "float [0, 1]": clip.astype(np.float32) / 255,
        "float [0, 255]": torch.from_numpy(clip).double(),
        "PIL frames": [PIL.Image.fromarray(f) for f in clip],
        "list of arrays": list(clip),
        "RGBA": np.concatenate([clip, np.full(clip.shape[:3] + (1,), 255, np.uint8)], -1),
        "int64": clip.astype(np.int64),
    }
    for name, video in variants.items():
        torch.testing.assert_close(vp(video)["pixel_values"], reference, atol=1e-5, rtol=1e-5, msg=name)
    batch = vp([clip, tchw])["pixel_values"]
    assert batch.shape == (2, 4, 3, 40, 48) and torch.equal(batch[0], batch[1])
    batch5d = vp(np.stack([clip, clip[::-1]]))["pixel_values"]
    assert torch.equal(batch5d[0], reference[0]) and not torch.equal(batch5d[1], reference[0])


def test_bad_arrays_and_lists():
    vp = TestaVideoProcessor(num_frames=2)
    cases = [
        (np.zeros((8, 8, 3), np.uint8), r"3 dimensions.*shape \(8, 8, 3\)"),
        (np.zeros((1, 2, 4, 8, 8, 3), np.uint8), "6 dimensions"),
        (np.zeros((4, 8, 8, 5), np.uint8), r"shape \(4, 8, 8, 5\).*no channel dimension"),
        (torch.zeros(4, 2, 8, 8), "no channel dimension"),
        (np.zeros((0, 8, 8, 3), np.uint8), "0 frames"),
        (np.zeros((2, 0, 8, 3), np.uint8), "empty frames"),
        (np.zeros((2, 8, 8, 3), bool), "dtype bool"),
        ([], "empty list"),
        ([np.zeros((2, 8, 8, 3), np.uint8), []], r"videos\[1\] is an empty list"),
        ([np.zeros((2, 8, 8, 3), np.uint8), np.zeros((8, 8, 3))], r"videos\[1\].*3 dimensions"),
        ([[np.zeros((8, 8, 3)), np.zeros((4, 8, 8, 3))]], r"videos\[0\]\[1\]"),
        ([np.zeros((8, 8, 3)), np.zeros((9, 8, 3))], "same shape"),
        (PIL.Image.new("RGB", (8, 8)), "single PIL image"),
        (None, "None"),
        (np.zeros((2, 4, 8, 8, 2), np.uint8), r"videos\[0\].*no channel dimension"),
    ]
    for video, message in cases:
        with pytest.raises(ValueError, match=message):
            vp(video)
    with pytest.raises(TypeError, match="unsupported type"):
        vp(12)
    with pytest.raises(ValueError, match="channels"):
        vp(np.zeros((2, 8, 8, 2), np.uint8), input_data_format="channels_last")
    with pytest.raises(ValueError, match="do_convert_rgb"):
        vp(np.zeros((2, 8, 8, 1), np.uint8), do_convert_rgb=False)
    with pytest.raises(ValueError, match="video_metadata"):
        vp([np.zeros((2, 8, 8, 3), np.uint8)] * 2, video_metadata=[{"fps": 1}])
    for option, value in [("frame_sampling", "middle"), ("resize_mode", "fit"), ("video_backend", "opencv"),
                          ("dtype", "int8")]:
        with pytest.raises(ValueError, match=option):
            vp(np.zeros((2, 8, 8, 3), np.uint8), **{option: value})


# ----------------------------------------------------------------------------------------------------------------------
# the functions themselves (shared by the video processor and the pipelines)
# ----------------------------------------------------------------------------------------------------------------------


VIDEO = np.zeros((2, 8, 8, 3), np.uint8)
FRAME = np.zeros((8, 8, 3), np.uint8)
IMAGE = PIL.Image.new("RGB", (8, 8))


def test_what_counts_as_a_video_and_a_frame():
    assert is_frame(FRAME) and is_frame(np.zeros((8, 8))) and is_frame(IMAGE) and not is_frame(VIDEO)
    for video in ("clip.mp4", VIDEO, torch.zeros(2, 3, 8, 8), [IMAGE, IMAGE], (FRAME,)):
        assert is_single_video(video)
    for other in (FRAME, np.zeros((1, 2, 8, 8, 3)), [], [VIDEO], [FRAME, VIDEO], IMAGE, None, 3):
        assert not is_single_video(other)
    assert describe(np.zeros((2, 3))) == "an array of shape (2, 3)" and describe({}) == "a dict"


@pytest.mark.parametrize(
    "item, error, message",
    [
        (FRAME, ValueError, r"^videos\[3\] is an array with 3 dimensions \(shape \(8, 8, 3\)\); a video must be 4-D"),
        ([], ValueError, r"^videos\[3\] is an empty list of frames\.$"),
        ([FRAME, VIDEO], ValueError, r"^videos\[3\]\[1\] is an array of shape \(2, 8, 8, 3\); a frame must be"),
        ([IMAGE, "x"], ValueError, r"^videos\[3\]\[1\] is a str; a frame must be"),
        (IMAGE, ValueError, r"^videos\[3\] is a single PIL image; pass a video as a list of frames"),
        ({"path": "a.mp4"}, TypeError, r"^videos\[3\] is a dict, an unsupported type; a video must be a file path"),
    ],
)
def test_check_video_names_the_bad_item(item, error, message):
    with pytest.raises(error, match=message):
        check_video(item, "videos[3]")


def test_check_video_accepts_every_kind_of_video():
    for video in ("clip.mp4", VIDEO, torch.zeros(2, 3, 8, 8), [IMAGE], [FRAME, np.zeros((8, 8))]):
        check_video(video, "video")  # no exception


def test_video_list_makes_one_entry_per_video():
    assert video_list("a.mp4") == ["a.mp4"]
    assert len(video_list(VIDEO)) == 1 and video_list(VIDEO)[0] is VIDEO
    batch = np.zeros((3, 2, 8, 8, 3))
    assert [v.shape for v in video_list(batch)] == [(2, 8, 8, 3)] * 3
    items = ["a.mp4", VIDEO, [FRAME]]
    assert video_list(tuple(items)) == items
    assert video_list([[IMAGE, IMAGE]], "clips") == [[IMAGE, IMAGE]]  # a list of frame lists: one video


@pytest.mark.parametrize(
    "videos, error, message",
    [
        (None, ValueError, r"`clips` is missing \(None\)"),
        ([], ValueError, r"`clips` is an empty list; pass at least one video"),
        (np.zeros((0, 2, 8, 8, 3)), ValueError, r"`clips` is an empty batch \(shape \(0, 2, 8, 8, 3\)\)"),
        (FRAME, ValueError, r"`clips` is an array with 3 dimensions .* a batch 5\. For a single frame pass `\[frame\]`"),
        (IMAGE, ValueError, r"`clips` is a single PIL image; pass a list of frames"),
        (3, TypeError, r"`clips` must be a video or a list of videos, got a int, an unsupported type"),
        ([VIDEO, [IMAGE, FRAME[None]]], ValueError, r"clips\[1\]\[1\] is an array of shape \(1, 8, 8, 3\)"),
        # a list of frames is a list of (bad) videos here: the pipelines take a collection
        ([FRAME, FRAME], ValueError, r"clips\[0\] is an array with 3 dimensions"),
    ],
)
def test_video_list_errors_name_the_argument(videos, error, message):
    with pytest.raises(error, match=message):
        video_list(videos, "clips")


def test_flatten_video_inputs_labels_and_frame_lists():
    assert flatten_video_inputs("a.mp4") == [("a.mp4", "a.mp4")]
    (label, video), = flatten_video_inputs(VIDEO)
    assert label == "videos" and video is VIDEO
    frames = (FRAME, FRAME)  # all frames: one video, returned as a list
    assert flatten_video_inputs(frames) == [("videos", [FRAME, FRAME])]
    pairs = flatten_video_inputs(["b.mp4", VIDEO, (IMAGE,)])
    assert [label for label, _ in pairs] == ["b.mp4", "videos[1]", "videos[2]"]
    assert pairs[2][1] == [IMAGE]
    assert [label for label, _ in flatten_video_inputs(np.zeros((2, 2, 8, 8, 3)))] == ["videos[0]", "videos[1]"]


def test_text_list():
    assert text_list("a cat", "text") == (["a cat"], True)
    assert text_list(("a", "b"), "question") == (["a", "b"], False)
    for bad, message in [(None, "`text` is missing"), ([], "`text` is an empty list"), ([1], "list of strings, got a list"),
                         (3, "list of strings, got a int")]:
        with pytest.raises(ValueError, match=message):
            text_list(bad, "text")


def test_video_to_tensor_layouts_and_dtypes():
    thwc = np.arange(2 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 4, 5, 3)
    tchw = video_to_tensor(thwc, "v")
    assert tchw.shape == (2, 3, 4, 5) and tchw.dtype == torch.uint8
    assert tchw[1, 2, 3, 4] == thwc[1, 3, 4, 2]  # (t, c, y, x) <- (t, y, x, c)
    assert torch.equal(video_to_tensor(torch.from_numpy(thwc).permute(0, 3, 1, 2), "v"), tchw)
    assert torch.equal(video_to_tensor(list(thwc), "v"), tchw)  # frame by frame
    gray = video_to_tensor([np.zeros((4, 5), np.uint8)] * 2, "v")
    assert gray.shape == (2, 1, 4, 5)
    assert video_to_tensor(thwc.astype(np.int32), "v").dtype == torch.float32
    # (2, 3, 3, 3): both axes fit; channels last unless told
    square = np.zeros((2, 3, 3, 3), np.uint8)
    square[:, 0] = 7  # row 0 in channels-last terms, channel 0 in channels-first terms
    assert video_to_tensor(square, "v")[:, :, 0].min() == 7
    assert video_to_tensor(square, "v", "channels_first")[:, 0].min() == 7
    with pytest.raises(ValueError, match="input_data_format"):
        video_to_tensor(square, "v", "sideways")
    with pytest.raises(ValueError, match="v mixes PIL images and arrays"):
        video_to_tensor([IMAGE, FRAME], "v")


def test_to_rgb_and_metadata_per_video():
    gray = torch.arange(4.0).view(1, 1, 2, 2)
    rgb = to_rgb(gray, "v", True)
    assert rgb.shape == (1, 3, 2, 2) and torch.equal(rgb[:, 2], gray[:, 0])
    assert torch.equal(to_rgb(torch.ones(1, 4, 2, 2), "v", True), torch.ones(1, 3, 2, 2))
    with pytest.raises(ValueError, match="v has 1 channels and do_convert_rgb=False"):
        to_rgb(gray, "v", False)
    with pytest.raises(ValueError, match="v has 2 channels; expected 1, 3 or 4"):
        to_rgb(torch.ones(1, 2, 2, 2), "v", True)
    assert metadata_per_video(None, 2) == [None, None]
    assert metadata_per_video({"fps": 5}, 1) == [{"fps": 5}]
    assert metadata_per_video([[{"fps": 1}], [None]], 2) == [{"fps": 1}, None]  # nested per batch
    with pytest.raises(ValueError, match="Got 3 videos but 1 `video_metadata` entries"):
        metadata_per_video([{"fps": 1}], 3)
