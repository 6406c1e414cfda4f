"""visualize_aggregation and the `python -m modeling_testa.visualize` command, on hand-worked videos."""

import numpy as np
import pytest
import torch
from helpers.models import tiny_vision_config
from PIL import Image

from modeling_testa import TestaVisionModel
from modeling_testa.visualization import aggregation_groups, trace_sources, visualize_aggregation


SINGLE_FRAME_GREY = (170, 170, 170)
VIDEO = torch.rand(8, 3, 32, 32)


def _model(**overrides) -> TestaVisionModel:
    model = TestaVisionModel(tiny_vision_config(**overrides)).eval()
    with torch.no_grad():  # identical pixels -> identical tokens, wherever they are
        model.embeddings.position_embedding.zero_()
    return model


def _pixel(image: Image.Image, x: int, y: int) -> tuple[int, int, int]:
    return image.getpixel((int(x), int(y)))


def _outline_colour(image: Image.Image, t: int) -> tuple[int, int, int]:
    """The colour just outside the left edge of frame ``t``'s box (where every frame outline is drawn)."""
    x0, y0, _, y1 = image.info["frame_boxes"][t]
    return _pixel(image, x0 - 1, (y0 + y1) // 2)


def _patch_centre(image: Image.Image, t: int, row: int, col: int) -> tuple[int, int, int]:
    x0, y0, _, _ = image.info["frame_boxes"][t]
    pp = image.info["patch_pixels"]
    return _pixel(image, x0 + col * pp + pp // 2, y0 + row * pp + pp // 2)


def _patch_top_edge(image: Image.Image, t: int, row: int, col: int) -> tuple[int, int, int]:
    x0, y0, _, _ = image.info["frame_boxes"][t]
    pp = image.info["patch_pixels"]
    return _pixel(image, x0 + col * pp + pp // 2, y0 + row * pp)


def test_image_is_rgb_with_one_box_per_frame_at_the_requested_scale():
    model = _model()
    video = torch.randn(8, 3, 32, 32)
    image = visualize_aggregation(model, None, video, patch_pixels=10, columns=3)
    assert isinstance(image, Image.Image) and image.mode == "RGB"
    boxes = image.info["frame_boxes"]
    assert len(boxes) == 8
    for x0, y0, x1, y1 in boxes:
        assert (x1 - x0, y1 - y0) == (40, 40)  # 4 x 4 patches of 10 pixels
        assert 0 < x0 and x1 < image.width and 0 < y0 and y1 < image.height
    rows = sorted({y0 for _, y0, _, _ in boxes})
    assert len(rows) == 3  # 8 frames in rows of 3
    assert len({x0 for x0, _, _, _ in boxes}) == 3
    # (1, T, C, H, W) input gives the same picture
    again = visualize_aggregation(model, None, video[None], patch_pixels=10, columns=3)
    assert np.array_equal(np.asarray(image), np.asarray(again))


def test_trace_matches_the_models_own_source_map():
    model = _model(temporal_reduction=[1, 2], spatial_reduction=[3, 2], trace_source=True)
    video = torch.randn(1, 8, 3, 32, 32)
    source_map, grid = trace_sources(model, video, layer=-1)
    assert torch.equal(source_map, model(video).source_map)
    assert grid == (8 - 1 - 2, 16 - 3 - 2)
    _, first_grid = trace_sources(model, video, layer=0)
    assert first_grid == (7, 13)


def test_identical_frames_in_a_and_b_share_a_rectangle_colour_and_no_other_frame_does():
    # Frames 2 (set A: even) and 3 (set B: odd) are identical, so their frame tokens have cosine 1 and they are the
    # pair that R_T=1 merges in block 0; every other frame is random noise and stays alone.
    model = _model(temporal_reduction=[1, 0], spatial_reduction=0)
    video = torch.rand(8, 3, 32, 32)
    video[3] = video[2]
    groups = aggregation_groups(model, None, video)
    assert groups.grid == (7, 16)
    frame_groups = groups.frame_groups.tolist()
    assert frame_groups[2] == frame_groups[3]
    assert len(set(frame_groups)) == 7

    image = visualize_aggregation(model, None, video)
    assert image.info["frame_groups"] == frame_groups
    merged = _outline_colour(image, 2)
    assert _outline_colour(image, 3) == merged
    assert merged != SINGLE_FRAME_GREY
    for t in (0, 1, 4, 5, 6, 7):
        assert _outline_colour(image, t) == SINGLE_FRAME_GREY


def test_patches_of_a_flat_region_share_tint_and_border_and_other_patches_keep_their_pixels():
    # Frame 5: the top row is two flat regions, X over patches 0-1 and Y over patches 2-3; the rest is noise. In the
    # alternating split of [CLS, p0, p1, ...], p1 and p3 are in set A, p0 and p2 in set B, so with R_S=2 block 0
    # merges exactly p1 -> p0 and p3 -> p2 (cosine 1), while all noise patches stay alone.
    model = _model(temporal_reduction=0, spatial_reduction=[2, 0])
    video = torch.rand(8, 3, 32, 32)
    video[5, :, :8, :16] = torch.tensor([0.9, 0.2, 0.1]).view(3, 1, 1)
    video[5, :, :8, 16:] = torch.tensor([0.1, 0.3, 0.8]).view(3, 1, 1)
    groups = aggregation_groups(model, None, video, layer=0)
    tokens = groups.source_map[5]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[0] != tokens[2]
    assert len(set(tokens[4:].tolist())) == 12 and not set(tokens[4:].tolist()) & {int(tokens[0]), int(tokens[2])}

    image = visualize_aggregation(model, None, video, layer=0)
    plain = visualize_aggregation(model, None, video, layer=0, alpha=0.0)
    x_fill, y_fill = _patch_centre(image, 5, 0, 0), _patch_centre(image, 5, 0, 2)
    assert _patch_centre(image, 5, 0, 1) == x_fill and _patch_centre(image, 5, 0, 3) == y_fill
    assert x_fill != y_fill
    assert x_fill != _patch_centre(plain, 5, 0, 0)  # tinted
    x_border, y_border = _patch_top_edge(image, 5, 0, 0), _patch_top_edge(image, 5, 0, 2)
    assert _patch_top_edge(image, 5, 0, 1) == x_border and _patch_top_edge(image, 5, 0, 3) == y_border
    assert x_border != y_border and x_border != x_fill
    for row, col in [(1, 0), (2, 1), (3, 3)]:  # unmerged noise patches are neither tinted nor outlined
        assert _patch_centre(image, 5, row, col) == _patch_centre(plain, 5, row, col)
        assert _patch_top_edge(image, 5, row, col) == _patch_top_edge(plain, 5, row, col)


def test_joint_merging_draws_no_frame_groups_and_colours_tokens_across_frames():
    model = _model(aggregation_dims="joint", spatial_reduction=[20, 10])
    video = torch.rand(8, 3, 32, 32)
    groups = aggregation_groups(model, None, video)
    assert groups.grid == (1, 8 * 16 - 30)
    assert groups.frame_groups.tolist() == list(range(8))
    image = visualize_aggregation(model, None, video)
    assert all(_outline_colour(image, t) == SINGLE_FRAME_GREY for t in range(8))


def test_pruned_frames_are_marked_and_a_wrapping_model_is_accepted():
    class Wrapper(torch.nn.Module):  # like TestaForVideoTextRetrieval: the encoder lives in .vision_model
        def __init__(self, vision_model):
            super().__init__()
            self.vision_model = vision_model

    model = Wrapper(_model(reduction_mode="prune", temporal_reduction=[2, 1], spatial_reduction=2))
    video = torch.rand(8, 3, 32, 32)
    groups = aggregation_groups(model, None, video)
    pruned = (groups.frame_groups < 0).nonzero().flatten().tolist()
    assert len(pruned) == 3  # 8 -> 6 -> 5 frames, nothing merged
    image = visualize_aggregation(model, None, video)
    for t in range(8):
        assert _outline_colour(image, t) == ((0, 0, 0) if t in pruned else SINGLE_FRAME_GREY)


def test_processor_output_is_used_and_denormalised():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)

    class Processor:
        image_mean, image_std = mean, std

        def __init__(self):
            self.calls = []

        def __call__(self, videos, return_tensors="pt", **kwargs):
            self.calls.append((videos, return_tensors, kwargs))
            frames = torch.from_numpy(np.stack(videos[0])).permute(0, 3, 1, 2).float() / 255
            pixel_values = (frames - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
            return {"pixel_values": pixel_values[None]}

    processor = Processor()
    frames = [np.full((32, 32, 3), (200, 100, 50), dtype=np.uint8) for _ in range(8)]
    image = visualize_aggregation(_model(spatial_reduction=0, temporal_reduction=0), processor, frames, alpha=0.0,
                                  processor_kwargs={"num_frames": 8})
    assert processor.calls == [([frames], "pt", {"num_frames": 8})]
    centre = np.array(_patch_centre(image, 0, 1, 1))
    assert np.abs(centre - np.array([200, 100, 50])).max() <= 1  # the original colour, not the normalised values


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda m: visualize_aggregation(m, None, torch.rand(8, 3, 32, 32), layer=2), ValueError, "[-2, 1]"),
        (lambda m: visualize_aggregation(m, None, torch.rand(2, 8, 3, 32, 32)), ValueError, "one video"),
        (lambda m: visualize_aggregation(m, None, "video.mp4"), TypeError, "processor"),
        (lambda m: visualize_aggregation(torch.nn.Linear(2, 2), None, VIDEO), TypeError, "vision_model"),
        (lambda m: visualize_aggregation(m, None, VIDEO, patch_pixels=0), ValueError, "patch_pixels"),
    ],
)
def test_bad_inputs_raise_errors_that_name_them(call, error, words):
    with pytest.raises(error) as info:
        call(_model())
    assert words in str(info.value)


def _write_video(path, num_frames=12, size=64):
    """An mp4 with a flat blue-grey background and a red block moving right by 4 pixels per frame."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(num_frames):
            frame = np.zeros((size, size, 3), np.uint8)
            frame[:] = (30, 60, 90)
            frame[16:40, 4 * i : 4 * i + 16] = (240, 40, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_cli_without_a_saved_processor_decodes_with_a_testa_video_processor_for_the_model(tmp_path, capsys):
    """A model folder without a processor: the frames come from a TestaVideoProcessor at the model's image size and
    frame count (uniform sampling, square resize, CLIP normalisation), the one decoding path of the package."""
    from modeling_testa import TestaVideoProcessor
    from modeling_testa.visualize import load_processor, main

    model = _model(temporal_reduction=[1, 1], spatial_reduction=3)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    path = tmp_path / "clip.mp4"
    _write_video(path)
    processor, origin = load_processor(folder, num_frames=4, image_size=32)
    assert isinstance(processor, TestaVideoProcessor) and origin == "TestaVideoProcessor at 32 px"
    assert processor.num_frames == 4 and (processor.crop_size.height, processor.crop_size.width) == (32, 32)
    pixel_values = processor(videos=[path], return_tensors="pt")["pixel_values"]
    assert pixel_values.shape == (1, 4, 3, 32, 32)
    rgb = pixel_values[0] * torch.tensor(processor.image_std).view(1, 3, 1, 1)
    rgb = rgb + torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    background = rgb[:, :, 28:, :].mean(dim=(0, 2, 3)) * 255
    assert torch.allclose(background, torch.tensor([30.0, 60.0, 90.0]), atol=8)
    red = rgb[:, 0, 8:20] > 0.7  # rows of the red block, at half scale
    centroids = [float(torch.nonzero(r)[:, 1].float().mean()) for r in red]
    assert centroids == sorted(centroids) and centroids[-1] - centroids[0] > 6  # sampled in time order, spread out

    out = tmp_path / "aggregation.png"
    assert main([str(path), "--model", str(folder), "--out", str(out), "--layer", "0"]) == 0
    assert "frames from TestaVideoProcessor at 32 px" in capsys.readouterr().out
    expected = visualize_aggregation(
        model, TestaVideoProcessor(num_frames=8, size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        path, layer=0,
    )  # the model's 8 frames
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected))


def test_cli_uses_the_processor_saved_in_the_folder(tmp_path, capsys):
    from modeling_testa import TestaVideoProcessor
    from modeling_testa.visualize import main

    model = _model(temporal_reduction=[1, 1], spatial_reduction=3)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    TestaVideoProcessor(num_frames=4, size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        folder)
    path = tmp_path / "clip.mp4"
    _write_video(path)
    out = tmp_path / "aggregation.png"
    assert main([str(path), "--model", str(folder), "--out", str(out), "--layer", "0"]) == 0
    assert f"frames from AutoVideoProcessor from {folder}" in capsys.readouterr().out
    expected = visualize_aggregation(model, None, torch.zeros(4, 3, 32, 32), layer=0)  # the saved 4 frames' layout
    assert Image.open(out).size == expected.size


def test_cli_writes_a_png_for_a_saved_model_and_an_mp4(tmp_path, capsys):
    from modeling_testa.visualize import main

    model = _model(temporal_reduction=[1, 1], spatial_reduction=3)
    model.save_pretrained(tmp_path / "model")
    video = tmp_path / "clip.mp4"
    _write_video(video)
    out = tmp_path / "out" / "aggregation.png"
    assert main([str(video), "--model", str(tmp_path / "model"), "--out", str(out), "--num-frames", "6",
                 "--layer", "0"]) == 0
    assert "wrote" in capsys.readouterr().out
    image = Image.open(out)
    assert image.format == "PNG" and image.mode == "RGB"
    expected = visualize_aggregation(model, None, torch.zeros(6, 3, 32, 32), layer=0)  # same layout for 6 frames
    assert image.size == expected.size
