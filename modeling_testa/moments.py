"""Moments of long videos: windows planned in seconds, decoded in one pass, and search results per moment.

* `plan_windows` cuts a video of `duration` seconds into windows of `window` seconds every `stride` seconds (the last
  one ends at the video's end; a video no longer than one window is one window, the whole video).
* `window_frame_indices` chooses the frames a window needs (uniform segment midpoints inside the window).
* `decode_windows` decodes a video **once** for all its windows: the union of every window's frames is asked from the
  decoder in a single call (one open, one forward pass; frames shared by overlapping windows are decoded once), then
  cut into windows. Decoding each window on its own would re-open the file, and a decoder that cannot seek cheaply
  (PyAV here decodes forward from the start) would re-decode the video up to every window: quadratic in its length.
* `window_pixel_values` turns those frames into a model's `pixel_values`, one clip per window.
* `format_time` writes seconds as ``h:mm:ss``; `best_moment_per_video` keeps each video's best moment of a ranking.

Memory: `decode_windows` holds every window's frames at the video's own resolution at once,
``windows x num_frames x height x width x 3`` bytes (an hour in 30 s windows of 8 frames at 640x360: 120 x 8 x 0.7 MB,
about 0.66 GB).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .indexing import check_on_error, decode_or_failure
from .video_decoding import decode_video, sample_frame_indices


# Times closer than this (seconds) are the same time: keeps 0.1 + 0.2 from planning an extra window.
TIME_TOLERANCE = 1e-6


def check_window_options(window: float | None, stride: float | None) -> tuple[float | None, float | None]:
    """`(window, stride)` as floats after checking them; `stride` defaults to `window` (windows that touch).

    Raises a `ValueError` naming the option for a non-positive or non-finite value, or a stride without a window."""
    if window is None:
        if stride is not None:
            raise ValueError(f"`stride={stride!r}` needs `window` (seconds per window) as well.")
        return None, None
    for name, value in (("window", window), ("stride", stride)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number of seconds, got {value!r}.")
    return float(window), float(window if stride is None else stride)


def plan_windows(duration: float, window: float, stride: float) -> list[tuple[float, float]]:
    """The `(start, end)` seconds of the windows of a video of `duration` seconds.

    Windows start every `stride` seconds from 0 and last `window` seconds. The last window is moved back to end at the
    video's end (full length, so every window holds the same amount of video) when the regular ones stop short of it.
    A video no longer than `window` is one window ``(0, duration)``.

    >>> plan_windows(100, 40, 30)
    [(0.0, 40.0), (30.0, 70.0), (60.0, 100.0)]
    >>> plan_windows(25, 40, 30)
    [(0.0, 25.0)]
    """
    window, stride = check_window_options(window, stride)
    duration = float(duration)
    if not math.isfinite(duration) or duration <= 0:
        raise ValueError(f"Cannot plan windows over a video of {duration!r} seconds.")
    if duration <= window + TIME_TOLERANCE:
        return [(0.0, duration)]
    # windows after the first: enough to reach the end (the last one clamped to end there)
    count = 1 + math.ceil((duration - window) / stride - TIME_TOLERANCE)
    starts = [min(i * stride, duration - window) for i in range(count)]
    return [(float(start), float(start + window)) for start in starts]


def window_frame_indices(start: float, end: float, fps: float, total_num_frames: int, num_frames: int) -> np.ndarray:
    """`num_frames` frame indices inside the window `[start, end)` seconds: the uniform segment midpoints of the
    window's frames (`sample_frame_indices`), as a whole clip would be sampled. Frame `i` is shown at `i / fps`."""
    first = min(int(round(start * fps)), total_num_frames - 1)
    stop = min(max(int(round(end * fps)), first + 1), total_num_frames)
    return first + sample_frame_indices(stop - first, num_frames, "uniform")


@dataclass
class VideoWindows:
    """The windows of one video and their frames.

    Attributes:
        source: the video file.
        windows: `(start, end)` seconds of every window.
        frames: uint8 `(len(windows), num_frames, height, width, 3)` RGB frames of every window.
        frame_indices: int64 `(len(windows), num_frames)`: which frame of the video each one is.
        fps: the video's frame rate.
        total_num_frames: the frames of the video.
    """

    source: str
    windows: list[tuple[float, float]]
    frames: np.ndarray
    frame_indices: np.ndarray
    fps: float
    total_num_frames: int

    @property
    def duration(self) -> float:
        return self.total_num_frames / self.fps


def windows_sampler(window: float, stride: float, num_frames: int, source: str,
                    planned: list[tuple[float, float]] | None = None):
    """A `sample_indices_fn` for `decode_video` that plans the windows from the video's metadata (or takes the
    `planned` ones), remembers the plan (`sampler.plan`, updated if the decoder samples again over a truncated file),
    and asks for every window's frames at once."""

    def sampler(metadata: Any) -> np.ndarray:
        total, fps = int(metadata.total_num_frames), metadata.fps
        if not fps:
            raise ValueError(f"Cutting {source!r} into windows of seconds needs its frame rate, which is unknown.")
        windows = list(planned) if planned is not None else plan_windows(total / fps, window, stride)
        indices = np.stack([window_frame_indices(s, e, fps, total, num_frames) for s, e in windows])
        sampler.plan = (windows, indices, float(fps), total)
        return indices.reshape(-1)

    sampler.plan = None
    return sampler


def decode_windows(
    source: str | os.PathLike,
    window: float,
    stride: float | None = None,
    num_frames: int = 8,
    fetch: Any = None,
    windows: list[tuple[float, float]] | None = None,
    **decode_options: Any,
) -> VideoWindows:
    """Decodes `source` once and cuts it into windows of `window` seconds every `stride` seconds (default: `window`),
    each with `num_frames` frames.

    Args:
        source: a video file (or URL).
        window, stride: seconds (see `plan_windows`).
        num_frames: frames per window.
        fetch: the decoding function, ``fetch(source, sample_indices_fn=...) -> (frames, metadata)``: default
            `decode_video` with `decode_options` (``backend``, ``isolate_decoder``, ``decode_timeout``,
            ``num_threads``); a video processor's ``fetch_videos`` uses its own decoder settings.
        windows: `(start, end)` seconds planned beforehand (e.g. by `plan_window_rows`), cut instead of planning
            from the decoded video's metadata (frames past the video's end are its last frames).

    Raises:
        `ValueError` for bad options or a video without a known frame rate (naming the file); the decoder's
        `VideoDecodingError` for files it cannot read.
    """
    window, stride = check_window_options(window, stride)
    if window is None:
        raise ValueError("`window` (seconds per window) is required.")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
    source = os.fspath(source)
    sampler = windows_sampler(window, stride, num_frames, source, windows)
    if fetch is None:
        frames, _ = decode_video(source, sample_indices_fn=sampler, **decode_options)
    else:
        frames, _ = fetch(source, sample_indices_fn=sampler)
    windows, indices, fps, total = sampler.plan
    frames = np.asarray(frames).reshape(len(windows), num_frames, *np.asarray(frames).shape[1:])
    return VideoWindows(source, windows, frames, indices, fps, total)


def moment_frames(source: str | os.PathLike, start: float, end: float, num_frames: int = 6,
                  **decode_options: Any) -> np.ndarray:
    """`num_frames` RGB frames `(num_frames, H, W, 3)` spread over `[start, end)` seconds of a video (uniform segment
    midpoints), e.g. a strip that shows a moment. `decode_options` go to `decode_video`."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
    if not (math.isfinite(start) and math.isfinite(end)) or not 0 <= start < end:
        raise ValueError(f"A moment needs 0 <= start < end seconds, got ({start!r}, {end!r}).")
    source = os.fspath(source)

    def sample(metadata: Any) -> np.ndarray:
        if not metadata.fps:
            raise ValueError(f"Finding {start:g}-{end:g} s in {source!r} needs its frame rate, which is unknown.")
        return window_frame_indices(start, end, metadata.fps, metadata.total_num_frames, num_frames)

    frames, _ = decode_video(source, sample_indices_fn=sample, **decode_options)
    return frames


def window_pixel_values(video_processor: Any, source: str | os.PathLike, window: float, stride: float | None = None,
                        num_frames: int | None = None, windows: list[tuple[float, float]] | None = None
                        ) -> tuple[VideoWindows, torch.Tensor]:
    """Every window of `source` as model input: `(windows, pixel_values)` with `pixel_values`
    `(len(windows), num_frames, 3, H, W)`, decoded once with the processor's decoder settings and transformed as the
    processor transforms a whole clip (resize, crop, normalise)."""
    num_frames = int(num_frames or video_processor.num_frames)

    def fetch(path: str, sample_indices_fn: Any) -> tuple[np.ndarray, Any]:
        return video_processor.fetch_videos(path, sample_indices_fn=lambda metadata: sample_indices_fn(metadata))

    cut = decode_windows(source, window, stride, num_frames, fetch=fetch, windows=windows)
    # every window already holds exactly `num_frames` frames: uniform sampling of T out of T keeps them all, in order
    pixel_values = video_processor(videos=list(cut.frames), num_frames=num_frames, frame_sampling="uniform",
                                   return_tensors="pt")["pixel_values"]
    return cut, pixel_values


def frame_spans(start: float, end: float, num_frames: int) -> list[tuple[float, float]]:
    """The time each of a window's `num_frames` uniformly sampled frames stands for: equal shares of `[start, end)`."""
    step = (end - start) / num_frames
    return [(start + t * step, start + (t + 1) * step) for t in range(num_frames)]


def refine_moment(spans: list[tuple[float, float]], scores: Any, level: float = 0.5) -> tuple[float, float]:
    """The moment around the best-scoring frame: the longest run of frames in time order, containing the best one,
    whose scores are at least ``low + level * (high - low)`` of the scores given (half-way by default).

    Args:
        spans: `(start, end)` seconds of every frame (e.g. `frame_spans` of one or several overlapping windows; sorted
            here by start).
        scores: one score per frame (e.g. the similarity of the query with the frame's TESTA segment); NaN never
            qualifies.
        level: where between the lowest and the highest score the threshold lies, in [0, 1].

    Returns:
        `(start, end)` seconds from the first frame of the run to the end of its last frame.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(spans) != len(scores) or not len(spans):
        raise ValueError(f"Need one score per frame span, got {len(scores)} scores for {len(spans)} spans.")
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"`level` must lie in [0, 1], got {level!r}.")
    if np.isnan(scores).all():
        raise ValueError("Every frame score is NaN: no frame to build a moment around.")
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][1]))
    ordered = np.where(np.isnan(scores[order]), -np.inf, scores[order])
    finite = ordered[np.isfinite(ordered)]
    threshold = finite.min() + level * (finite.max() - finite.min())
    best = int(np.argmax(ordered))
    first = last = best
    while first > 0 and ordered[first - 1] >= threshold:
        first -= 1
    while last < len(ordered) - 1 and ordered[last + 1] >= threshold:
        last += 1
    return float(spans[order[first]][0]), float(max(spans[order[i]][1] for i in range(first, last + 1)))


def probe_duration(source: str | os.PathLike) -> float:
    """A video's duration in seconds from its container (PyAV: declared frames, else packets, over the frame rate;
    no frame is decoded), as the PyAV decoder will count its frames. Raises `ValueError` naming the file."""
    from .video_decoding_worker import DecodeFailure, pyav_probe

    source = os.fspath(source)
    try:
        info = pyav_probe(source)
    except (DecodeFailure, OSError, ImportError) as error:
        raise ValueError(f"Cannot read the duration of {source!r}: {error}") from error
    total = info["declared_frames"] or info["packets"]
    if not total or not info["fps"]:
        raise ValueError(f"Cannot read the duration of {source!r}: {total} frames at {info['fps']} fps.")
    return total / info["fps"]


def plan_window_rows(videos: list[str], window: float, stride: float | None,
                     duration: Callable[[str], float] = probe_duration
                     ) -> tuple[list[str], list[list[float] | None], list[tuple[str, str]]]:
    """The rows of an index of moments planned before decoding (an on-disk store needs its rows up front): every
    video's windows from its `duration`, as `(names, segments)` with one entry per row; a video whose duration
    cannot be read is one row with segment `None` (decoding it will then fail and record why, or index it whole),
    and is listed with the reason in the third value."""
    window, stride = check_window_options(window, stride)
    names: list[str] = []
    segments: list[list[float] | None] = []
    unreadable: list[tuple[str, str]] = []
    for video in videos:
        try:
            planned = plan_windows(duration(video), window, stride)
        except (ValueError, OSError) as error:
            names.append(video)
            segments.append(None)
            unreadable.append((video, str(error)))
            continue
        names += [video] * len(planned)
        segments += [[start, end] for start, end in planned]
    return names, segments, unreadable


def video_groups(rows: Iterable[int], names: list[str]) -> list[tuple[str, list[int]]]:
    """Consecutive rows of the same video, grouped: ``[(video, [rows...]), ...]`` (each video decoded once)."""
    groups: list[tuple[str, list[int]]] = []
    for row in rows:
        if groups and groups[-1][0] == names[row] and groups[-1][1][-1] == row - 1:
            groups[-1][1].append(row)
        else:
            groups.append((names[row], [row]))
    return groups


class DecodeWindowRows:
    """DataLoader collation for an index of moments built row by row (`train.index --window`): takes
    ``[(video, rows)]`` (from `video_groups`) and decodes each video once for the windows of its rows
    (``segments[row]``; a `None` segment is the whole video), returning a `indexing.DecodedBatch` over rows. A video
    that cannot be read fails all its rows (``on_error="skip"``) or raises."""

    def __init__(self, video_processor: Any, num_frames: int, segments: list[list[float] | None],
                 on_error: str = "skip"):
        self.video_processor, self.num_frames, self.segments = video_processor, num_frames, segments
        self.on_error = check_on_error(on_error)

    def decode(self, video: str, rows: list[int]) -> torch.Tensor:
        """One clip per row, in the rows' order: the whole video for a row without a segment, else its window (a
        video may have both kinds of rows, given as entries)."""
        planned = [self.segments[row] for row in rows]
        whole = None
        if any(segment is None for segment in planned):
            whole = self.video_processor(videos=[video], num_frames=self.num_frames, frame_sampling="uniform",
                                         return_tensors="pt")["pixel_values"]
            if all(segment is None for segment in planned):
                return whole.expand(len(rows), *whole.shape[1:]).clone() if len(rows) > 1 else whole
        windows = [(float(segment[0]), float(segment[1])) for segment in planned if segment is not None]
        window = max(end - start for start, end in windows)
        clips = iter(window_pixel_values(self.video_processor, video, window, window, self.num_frames,
                                         windows=windows)[1])
        return torch.stack([whole[0] if segment is None else next(clips) for segment in planned])

    def __call__(self, groups: list[tuple[str, list[int]]]):
        indices, pixels, failures = [], [], []
        for video, rows in groups:
            decoded, failure = decode_or_failure(lambda: self.decode(video, rows), rows[0], video,  # noqa: B023
                                                 self.on_error)
            if failure is not None:
                failures += [dataclasses.replace(failure, index=row) for row in rows]
                continue
            indices += rows
            pixels.append(decoded)
        return indices, (torch.cat(pixels) if pixels else None), failures


def rebatch(batches: Iterable[Any], batch_size: int) -> Iterator[Any]:
    """`indexing.DecodedBatch` es regrouped into batches of at most `batch_size` rows (a long video's windows split
    over several encoder forwards, short ones joined); failures pass with the next batch."""
    indices: list[int] = []
    pixels: list[torch.Tensor] = []
    failures: list[Any] = []
    for batch_indices, batch_pixels, batch_failures in batches:
        failures += batch_failures
        for offset, row in enumerate(batch_indices):
            indices.append(row)
            pixels.append(batch_pixels[offset])
            if len(indices) == batch_size:
                yield indices, torch.stack(pixels), failures
                indices, pixels, failures = [], [], []
    if indices or failures:
        yield indices, (torch.stack(pixels) if pixels else None), failures


def format_time(seconds: float | None) -> str:
    """``h:mm:ss`` (whole seconds, rounded down), e.g. ``3725.4 -> "1:02:05"``; ``"-"`` for None (a whole video)."""
    if seconds is None:
        return "-"
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"A time must be a non-negative number of seconds, got {seconds!r}.")
    whole = int(seconds + TIME_TOLERANCE)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def best_moment_per_video(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A ranking (best first) of ``{"video", "start", "end", "score", ...}`` with each video once, at its first (best)
    moment, in the order of the ranking."""
    seen: set[Any] = set()
    grouped = []
    for result in results:
        video = result["video"]
        key = video if isinstance(video, (str, os.PathLike)) else id(video)  # an in-memory array: its own object
        if key not in seen:
            seen.add(key)
            grouped.append(dict(result))
    return grouped


__all__ = [
    "DecodeWindowRows",
    "VideoWindows",
    "plan_window_rows",
    "probe_duration",
    "rebatch",
    "video_groups",
    "best_moment_per_video",
    "check_window_options",
    "decode_windows",
    "format_time",
    "frame_spans",
    "moment_frames",
    "refine_moment",
    "plan_windows",
    "window_frame_indices",
    "window_pixel_values",
]
