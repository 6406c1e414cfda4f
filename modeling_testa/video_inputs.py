"""The one place where video and text inputs are recognised, checked and normalised.

A **video** is a file path or URL (`str` or `os.PathLike`), a decoded clip as a 4-D `np.ndarray`/`torch.Tensor`
(`(frames, height, width, channels)` or `(frames, channels, height, width)`), or a non-empty list of frames (PIL
images, or 2-D/3-D arrays). A **collection of videos** is a list of videos or a 5-D array/tensor.

The video processor (`flatten_video_inputs`, `video_to_tensor`, `to_rgb`, `metadata_per_video`) and the pipelines
(`video_list`, `check_video`, `text_list`) check their inputs with these functions, so that the same bad input gets the
same error everywhere: a `ValueError` (or a `TypeError` for an unsupported type) whose message names the input by its
argument name and position, e.g. ``videos[1] is an array with 3 dimensions (shape (32, 32, 3)); ...``.

This file is Hub remote code (exported with `video_processing_testa.py`): sibling-relative imports only.
"""

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.video_utils import VideoMetadata


VIDEO_DIMENSIONS = "(frames, height, width, channels) or (frames, channels, height, width)"
FRAME_DIMENSIONS = "(height, width[, channels]) or (channels, height, width)"


def is_array(value: Any) -> bool:
    """Whether `value` is a numpy array or a torch tensor."""
    return isinstance(value, (np.ndarray, torch.Tensor))


def is_pil_image(value: Any) -> bool:
    """Whether `value` is a PIL image. Pillow is optional (the models run without it, e.g. on a GPU machine with
    torch and transformers only), and a value can only be a PIL image once Pillow has been imported."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


def is_frame(value: Any) -> bool:
    """Whether `value` is one frame: a PIL image, or a 2-D/3-D array or tensor."""
    return is_pil_image(value) or (is_array(value) and value.ndim in (2, 3))


def is_path(value: Any) -> bool:
    """Whether `value` names a video file or URL (`str` or `os.PathLike`)."""
    return isinstance(value, (str, os.PathLike))


def is_frame_list(value: Any) -> bool:
    """Whether `value` is a non-empty list (or tuple) of frames, i.e. one video given frame by frame."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(is_frame(frame) for frame in value)


def is_single_video(value: Any) -> bool:
    """Whether `value` is one video: a path, a 4-D array/tensor, or a non-empty list of frames."""
    if is_path(value):
        return True
    if is_array(value):
        return value.ndim == 4
    return is_frame_list(value)


def describe(value: Any) -> str:
    """A short description of `value` for error messages: ``"an array of shape (2, 3)"``, ``"a dict"``."""
    if is_array(value):
        return f"an array of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def check_video(item: Any, label: str) -> None:
    """Raises a `ValueError` (or a `TypeError` for an unsupported type) naming `label` unless `item` is one video.

    Args:
        item: the value to check.
        label (`str`): how the error names it, e.g. ``"videos[2]"`` or ``"video"``.
    """
    if is_path(item):
        return
    if is_array(item):
        if item.ndim != 4:
            raise ValueError(
                f"{label} is an array with {item.ndim} dimensions (shape {tuple(item.shape)}); a video must be 4-D: "
                f"{VIDEO_DIMENSIONS}."
            )
        return
    if is_pil_image(item):
        raise ValueError(
            f"{label} is a single PIL image; pass a video as a list of frames (`[image]` for a one-frame video)."
        )
    if isinstance(item, (list, tuple)):
        if len(item) == 0:
            raise ValueError(f"{label} is an empty list of frames.")
        for j, frame in enumerate(item):
            if not is_frame(frame):
                raise ValueError(
                    f"{label}[{j}] is {describe(frame)}; a frame must be a PIL image or a 2-D/3-D array "
                    f"{FRAME_DIMENSIONS}."
                )
        return
    raise TypeError(
        f"{label} is {describe(item)}, an unsupported type; a video must be a file path, a 4-D array/tensor or a "
        "list of frames."
    )


def video_list(videos: Any, name: str = "videos") -> list[Any]:
    """Checks a collection of videos and returns it as a list, one entry per video.

    A single path or 4-D array/tensor becomes a one-element list and a 5-D array/tensor a list of 4-D ones; a list is
    taken as a list of videos (each checked with `check_video`, named ``f"{name}[{i}]"``).

    Args:
        videos: the collection.
        name (`str`, defaults to `"videos"`): the argument's name, for error messages.

    Raises:
        `ValueError`: `None`, an empty list or batch, an array of another rank, a single PIL image, or a bad video.
        `TypeError`: an unsupported type.
    """
    if videos is None:
        raise ValueError(
            f"`{name}` is missing (None); pass a video path, a 4-D array/tensor, a list of frames, or a list of those."
        )
    if is_array(videos):
        if videos.ndim == 5:
            if videos.shape[0] == 0:
                raise ValueError(f"`{name}` is an empty batch (shape {tuple(videos.shape)}).")
            return list(videos)
        if videos.ndim == 4:
            return [videos]
        raise ValueError(
            f"`{name}` is an array with {videos.ndim} dimensions (shape {tuple(videos.shape)}); a video must have 4 "
            f"{VIDEO_DIMENSIONS}, and a batch 5. For a single frame pass `[frame]` or `frame[None]`."
        )
    if is_path(videos):
        return [videos]
    if is_pil_image(videos):
        raise ValueError(f"`{name}` is a single PIL image; pass a list of frames (`[image]`) for a one-frame video.")
    if not isinstance(videos, (list, tuple)):
        raise TypeError(f"`{name}` must be a video or a list of videos, got {describe(videos)}, an unsupported type.")
    if len(videos) == 0:
        raise ValueError(f"`{name}` is an empty list; pass at least one video.")
    for i, item in enumerate(videos):
        check_video(item, f"{name}[{i}]")
    return list(videos)


def flatten_video_inputs(videos: Any) -> list[tuple[str, Any]]:
    """Splits every accepted layout of the video processor's `videos` argument into `(label, video)` pairs, one per
    video, in order.

    Unlike `video_list`, a list whose items are all frames is **one** video (given frame by frame). The label names the
    video in error messages: its path for files, ``"videos"`` for a single video, ``"videos[i]"`` in a batch. Lists of
    frames are returned as lists.

    Raises:
        the errors of `video_list`.
    """
    if is_frame_list(videos):
        return [("videos", list(videos))]
    items = video_list(videos, "videos")
    batch = isinstance(videos, (list, tuple)) or (is_array(videos) and videos.ndim == 5)
    pairs = []
    for i, item in enumerate(items):
        label = os.fspath(item) if is_path(item) else (f"videos[{i}]" if batch else "videos")
        pairs.append((label, list(item) if isinstance(item, (list, tuple)) else item))
    return pairs


def text_list(text: Any, name: str, allow_empty: bool = False) -> tuple[list[str], bool]:
    """`(texts, single)`: a string becomes a one-element list (`single=True`); a list of strings is copied.

    Args:
        text: a string or a non-empty list of strings.
        name (`str`): the argument's name, for error messages.
        allow_empty (`bool`): take empty strings (the processor tokenizes whatever it is given; the pipelines'
            queries, labels and questions must have words).

    Raises:
        `ValueError`: `None`, an empty list, anything but strings, or a string that is empty (or only spaces):
            a query with no words would rank every video by the same meaningless embedding.
    """
    if text is None:
        raise ValueError(f"`{name}` is missing; pass a string or a list of strings.")
    single = isinstance(text, str)
    if single:
        text = [text]
    if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
        raise ValueError(f"`{name}` must be a string or a list of strings, got {describe(text)}.")
    if len(text) == 0:
        raise ValueError(f"`{name}` is an empty list; pass at least one string.")
    empty = [] if allow_empty else [i for i, t in enumerate(text) if not t.strip()]
    if empty:
        where = f"`{name}`" if single else f"`{name}[{empty[0]}]`"
        raise ValueError(f"{where} is empty ({text[empty[0]]!r}); pass words to search for.")
    return list(text), single


def _channel_axis(shape: tuple[int, ...], label: str, input_data_format: Any) -> str:
    """Returns "first" (T, C, H, W) or "last" (T, H, W, C) for a 4-D video shape."""
    fmt = getattr(input_data_format, "value", input_data_format)
    if fmt in ("channels_first", "first"):
        axis = "first"
    elif fmt in ("channels_last", "last"):
        axis = "last"
    elif fmt is None:
        last_ok, first_ok = shape[3] in (1, 3, 4), shape[1] in (1, 3, 4)
        if last_ok:
            axis = "last"  # also the choice when both fit (tiny frames); pass input_data_format to override
        elif first_ok:
            axis = "first"
        else:
            raise ValueError(
                f"{label} has shape {shape}: no channel dimension of size 1, 3 or 4 in position 1 (frames, channels, "
                "height, width) or 3 (frames, height, width, channels)."
            )
    else:
        raise ValueError(f"Unknown input_data_format={input_data_format!r}; use 'channels_first' or 'channels_last'.")
    channels = shape[1] if axis == "first" else shape[3]
    if channels not in (1, 3, 4):
        raise ValueError(
            f"{label} has {channels} channels (shape {shape}, channels {axis}); expected 1 (grayscale), 3 (RGB) or "
            "4 (RGBA)."
        )
    return axis


def _stack_frames(frames: list[Any], label: str) -> np.ndarray:
    """A list of PIL images (converted to RGB) or of 2-D/3-D arrays -> one `(T, ...)` array."""
    if all(is_pil_image(frame) for frame in frames):
        arrays = [np.asarray(frame.convert("RGB")) for frame in frames]
    elif any(is_pil_image(frame) for frame in frames):
        raise ValueError(f"{label} mixes PIL images and arrays; use one kind of frame per video.")
    else:
        arrays = [
            frame.detach().cpu().numpy() if isinstance(frame, torch.Tensor) else np.asarray(frame) for frame in frames
        ]
        arrays = [a[..., None] if a.ndim == 2 else a for a in arrays]
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"{label}: all frames must have the same shape, got {sorted(shapes)}.")
    return np.stack(arrays)


def video_to_tensor(video: Any, label: str, input_data_format: Any = None) -> torch.Tensor:
    """Converts one in-memory video to a `(frames, channels, height, width)` tensor, checking its layout.

    Args:
        video: a 4-D array/tensor or a list of frames (see the module docstring).
        label (`str`): names the video in error messages.
        input_data_format (`str` or `ChannelDimension`, *optional*): `"channels_first"` or `"channels_last"`; guessed
            from the shape when `None` (channels last when both fit).

    Returns:
        `torch.Tensor`: uint8 pixels stay uint8 (0-255), floating pixels keep their dtype, other integer types become
        float32 (values taken as 0-255). Channels are 1, 3 or 4, as given (see `to_rgb`).
    """
    if isinstance(video, list):
        video = _stack_frames(video, label)
    if isinstance(video, np.ndarray):
        numeric = np.issubdtype(video.dtype, np.integer) or np.issubdtype(video.dtype, np.floating)
        if video.dtype == np.bool_ or not numeric:
            raise ValueError(f"{label} has dtype {video.dtype}; expected uint8 (0-255) or float pixels.")
        if video.dtype not in (np.uint8, np.float32, np.float64, np.float16):
            video = video.astype(np.float32)  # other integer types: values taken as 0-255
        video = torch.from_numpy(np.ascontiguousarray(video))
    elif video.dtype == torch.bool or video.is_complex():
        raise ValueError(f"{label} has dtype {video.dtype}; expected uint8 (0-255) or float pixels.")
    elif not video.is_floating_point() and video.dtype != torch.uint8:
        video = video.float()
    if video.ndim != 4:
        raise ValueError(f"{label} must be 4-D {VIDEO_DIMENSIONS}, got shape {tuple(video.shape)}.")
    shape = tuple(video.shape)
    if shape[0] == 0:
        raise ValueError(f"{label} has 0 frames (shape {shape}).")
    if _channel_axis(shape, label, input_data_format) == "last":
        video = video.permute(0, 3, 1, 2)
    if video.shape[-1] == 0 or video.shape[-2] == 0:
        raise ValueError(f"{label} has empty frames (shape {shape}).")
    return video


def to_rgb(clip: torch.Tensor, label: str, do_convert_rgb: bool | None) -> torch.Tensor:
    """`(T, C, H, W)` with C in {1, 3, 4} -> `(T, 3, H, W)`: grayscale is repeated, alpha dropped.

    Raises:
        `ValueError` naming `label`: other channel counts, or a conversion needed with `do_convert_rgb=False`.
    """
    channels = clip.shape[1]
    if channels == 3:
        return clip
    if not do_convert_rgb:
        raise ValueError(f"{label} has {channels} channels and do_convert_rgb=False; the model needs 3 (RGB).")
    if channels == 1:
        return clip.expand(-1, 3, -1, -1)
    if channels == 4:
        return clip[:, :3]
    raise ValueError(f"{label} has {channels} channels; expected 1, 3 or 4.")


def metadata_per_video(video_metadata: Any, count: int) -> list[dict[str, Any] | None]:
    """Normalises the video processor's optional `video_metadata` argument (for in-memory videos) to one dict, or
    `None`, per video: one dict or `VideoMetadata` for a single video, or a list (possibly nested per batch) of them.

    Raises:
        `ValueError`: the number of entries is not `count`.
    """
    if video_metadata is None:
        return [None] * count
    if isinstance(video_metadata, (dict, VideoMetadata)):
        video_metadata = [video_metadata]
    video_metadata = list(video_metadata)
    if video_metadata and isinstance(video_metadata[0], (list, tuple)):
        video_metadata = [m for group in video_metadata for m in group]
    if len(video_metadata) != count:
        raise ValueError(f"Got {count} videos but {len(video_metadata)} `video_metadata` entries; pass one per video.")
    return [dict(m) if m is not None else None for m in video_metadata]


VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".3gp", ".ts")
"""File name endings taken as videos when a folder is searched (`find_video_files`), and in text that is only a
video file name (`processing_testa.check_not_video_paths`)."""


def is_video_file_name(name: str | os.PathLike) -> bool:
    return Path(name).suffix.lower() in VIDEO_SUFFIXES


def find_video_files(folder: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The video files below ``folder`` (recursive, sorted, absolute) and the other files there. Raises
    `NotADirectoryError` naming ``folder`` when it is not a folder."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise NotADirectoryError(f"{str(folder)!r} is not a folder.")
    files = sorted(p.resolve() for p in path.rglob("*") if p.is_file())
    return [str(p) for p in files if is_video_file_name(p)], [str(p) for p in files if not is_video_file_name(p)]


__all__ = [
    "VIDEO_SUFFIXES",
    "check_video",
    "describe",
    "find_video_files",
    "flatten_video_inputs",
    "is_array",
    "is_frame",
    "is_frame_list",
    "is_path",
    "is_pil_image",
    "is_single_video",
    "is_video_file_name",
    "metadata_per_video",
    "text_list",
    "to_rgb",
    "video_list",
    "video_to_tensor",
]
