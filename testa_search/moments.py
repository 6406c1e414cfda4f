"""Moments of long videos: windows planned in seconds, decoded in one streaming pass, and search results per moment.

* `plan_windows` cuts a video of `duration` seconds into windows of `window` seconds every `stride` seconds (the last
  one ends at the video's end; a video no longer than one window is one window, the whole video).
* `frames_in_window` chooses the frames a window needs from the frames' **timestamps** (uniform segment midpoints of
  the frames shown inside the window), so variable-frame-rate files are cut at the right times.
* `WindowStream` decodes a video **once, front to back**, for all its windows (`video_decoding.VideoFrames`: the
  decoder is asked for the union of the windows' frames and streams them in order; PyAV seeks to the keyframe before
  a distant frame and skips frames nobody needs). Each frame is prepared as it arrives (by a model's video processor:
  resized to its input size, `TestaVideoProcessor.frame_transforms`) and kept only while a window that needs it is
  still open; overlapping windows share their frames; a window is handed out as soon as its last frame is in. Memory
  is therefore bounded by the open windows at the model's input size, whatever the video's length.
* Windows the video's data does not reach (a truncated file, a decoder that stopped) come out as failures naming the
  time where decoding ended, never as copies of the last frame. A decoder that crashes or stalls mid-video fails the
  windows it did not reach (``"auto"`` first continues with the next decoder from where the first stopped).
* `WindowRowDecoder` is the index builder's decoder (`homes.Decoder`) for rows that are moments: each video
  streamed once for its rows, windows encoded in batches as they complete (in `num_workers` threads, one video each,
  each with a decoder process of its own).
* `decode_windows` / `window_pixel_values` collect every window of one video (raw frames / model input), `moment_frames`
  decodes one moment (a strip of frames; seeking makes it cheap anywhere in a long file).
* `format_time` writes seconds as ``h:mm:ss`` (`moment_label`: a result's span); `best_moment_per_video` keeps each
  video's best moment of a ranking.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from testa_search.encoding import DecodeAhead, DecodedBatch, Failure, check_on_error, is_media_error
from modeling_testa.video_decoding import (
    VideoDecodingError,
    VideoFrames,
    backends_to_try,
    check_backend_installed,
    check_source,
    combined_error,
    format_time,
    own_decoder_process,
    sample_frame_indices,
)


# Times closer than this (seconds) are the same time: keeps 0.1 + 0.2 from planning an extra window.
TIME_TOLERANCE = 1e-6

from modeling_testa.video_decoding import STREAM_ORDER as STREAM_BACKENDS  # noqa: E402
# The decoders ``backend="auto"`` tries when streaming a video's windows, in this order (the decoder table,
# `video_decoding.DECODERS`): PyAV first, since it holds one frame at a time whatever the consumer's pace and seeks over
# what no window needs, where decord decodes ahead of a slow consumer into its own buffers (`Decoder.streams`).


def check_window_options(window: float | None, stride: float | None, required: bool = False
                         ) -> tuple[float | None, float | None]:
    """`(window, stride)` as floats after checking them; `stride` defaults to `window` (windows that touch). The one
    check of these options, made once by every entry point that takes them (the pipeline's `encode_videos`,
    `train.index`, `plan_windows`, `decode_windows`, `window_pixel_values`, `build.window_entries`); what they call
    trusts them.

    Raises a `ValueError` naming the option for a non-positive or non-finite value, a stride without a window, a
    stride longer than the window (the seconds between two windows would be in none: gaps no search could find), or
    no window where one is `required`."""
    if window is None:
        if stride is not None:
            raise ValueError(f"`stride={stride!r}` needs `window` (seconds per window) as well.")
        if required:
            raise ValueError("`window` (seconds per window) is required.")
        return None, None
    for name, value in (("window", window), ("stride", stride)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"`{name}` must be a positive number of seconds, got {value!r}.")
    if stride is not None and stride > window:
        raise ValueError(f"`stride={stride!r}` is longer than `window={window!r}`: the video between two windows "
                         "would be in none of them. Use a stride of at most the window.")
    return float(window), float(window if stride is None else stride)


def check_num_frames(num_frames: Any) -> int:
    """`num_frames` after checking that it is a positive int (a `ValueError` naming it otherwise)."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
    return num_frames


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
    return window_spans(duration, *check_window_options(window, stride, required=True))


def window_spans(duration: float, window: float, stride: float) -> list[tuple[float, float]]:
    """`plan_windows` for options already checked (`check_window_options`): what the entry points plan each video
    with."""
    duration = float(duration)
    if not math.isfinite(duration) or duration <= 0:
        raise ValueError(f"Cannot plan windows over a video of {duration!r} seconds.")
    if duration <= window + TIME_TOLERANCE:
        return [(0.0, duration)]
    # windows after the first: enough to reach the end (the last one clamped to end there)
    count = 1 + math.ceil((duration - window) / stride - TIME_TOLERANCE)
    starts = [min(i * stride, duration - window) for i in range(count)]
    return [(float(start), float(start + window)) for start in starts]


def frames_in_window(times: np.ndarray, start: float, end: float, num_frames: int,
                     duration: float | None = None) -> np.ndarray | None:
    """`num_frames` frame indices for the window `[start, end)` seconds of a video whose frames are shown at `times`
    (sorted seconds): the uniform segment midpoints (`sample_frame_indices`) of the frames shown inside the window,
    as a whole clip would be sampled; the frame on screen at `start` for a window shorter than one frame. None when
    the window starts at or after `duration` (where the frames end; default `data_end(times)`)."""
    times = np.asarray(times, dtype=np.float64)
    if not len(times) or start >= (data_end(times) if duration is None else duration) - TIME_TOLERANCE:
        return None
    first = int(np.searchsorted(times, start - TIME_TOLERANCE, "left"))
    stop = int(np.searchsorted(times, end - TIME_TOLERANCE, "left"))
    if stop <= first:  # no frame starts inside the window: the one on screen at its start
        first = max(int(np.searchsorted(times, start + TIME_TOLERANCE, "right")) - 1, 0)
        stop = first + 1
    return first + sample_frame_indices(stop - first, num_frames, "uniform")


def window_frame_indices(start: float, end: float, fps: float, total_num_frames: int, num_frames: int) -> np.ndarray:
    """`frames_in_window` for a constant frame rate: frame `i` is shown at `i / fps`. Raises `ValueError` for a
    window that starts after the last frame."""
    indices = frames_in_window(np.arange(total_num_frames) / fps, start, end, num_frames, total_num_frames / fps)
    if indices is None:
        raise ValueError(f"The window {start:g}-{end:g} s starts after the last of the video's {total_num_frames} "
                         f"frames at {fps:g} fps.")
    return indices


def data_end(times: np.ndarray, fps: float | None = None) -> float:
    """Where a video's frames end, in seconds: the last frame's time plus its duration (the step before it, else
    ``1 / fps``, else 0)."""
    if len(times) > 1:
        step = float(times[-1] - times[-2])
    else:
        step = 1.0 / fps if fps else 0.0
    return float(times[-1]) + step


# ------------------------------------------------------------------------------------------------------ streaming


@dataclass
class WindowClip:
    """One window of a `WindowStream`: its frames (as the stream's `finish` made them), or why it has none.

    Attributes:
        position: the window's position in the stream's plan.
        start, end: seconds.
        frame_indices: the video frames it holds (None when it has none).
        frames: the prepared frames, finished (None for a failure).
        error: a `VideoDecodingError` naming the video, the window and where decoding ended (None when decoded).
    """

    position: int
    start: float
    end: float
    frame_indices: np.ndarray | None = None
    frames: Any = None
    error: VideoDecodingError | None = None


class WindowAssembly:
    """Assembles a stream of decoded frames (in increasing index order) into windows, in the windows' order, keeping a
    frame only while a window still to hand out needs it.

    Args:
        source: the video (for error messages).
        windows: `(start, end)` seconds of every window.
        plan: each window's frame indices, or None for a window the video's data does not reach.
        times: every frame's time (seconds), for messages.
        total: the frames the video declares.
        finish: turns a window's prepared frames (a list, in order) into its `WindowClip.frames`.
    """

    def __init__(self, source: str, windows: list[tuple[float, float]], plan: list[np.ndarray | None],
                 times: np.ndarray, total: int, finish: Callable[[list[Any]], Any]) -> None:
        self.source, self.windows, self.plan, self.times, self.total = source, windows, plan, times, total
        self.finish = finish
        self.last_use: dict[int, int] = {}
        for position, indices in enumerate(plan):
            for index in [] if indices is None else indices.tolist():
                self.last_use[index] = position
        self.wanted = sorted(self.last_use)
        self.frames: dict[int, Any] = {}
        self.received = -1  # the highest frame index received
        self.next = 0  # the next window to hand out
        self.ended: VideoDecodingError | None = None  # why no more frames will come

    def pending(self) -> list[int]:
        """The frames still to receive."""
        return [index for index in self.wanted if index > self.received]

    def add(self, index: int, frame: Any) -> None:
        """A decoded (and prepared) frame."""
        if self.last_use.get(index, -1) >= self.next:
            self.frames[index] = frame
        self.received = max(self.received, index)

    def end(self, error: VideoDecodingError) -> None:
        """No more frames will come, because of `error` (the windows still waiting fail with it)."""
        self.ended = error

    def _where(self) -> str:
        if self.received < 0:
            return "before its first frame"
        return f"at {format_time(float(self.times[self.received]))} (frame {self.received + 1} of {self.total})"

    def ready(self) -> Iterator[WindowClip]:
        """The windows that can be handed out now, in order: complete ones, and ones that can no longer be."""
        while self.next < len(self.windows):
            position, (start, end), indices = self.next, self.windows[self.next], self.plan[self.next]
            moment = f"{format_time(start)}-{format_time(end)}"
            if indices is None:
                reach = format_time(data_end(self.times, None)) if len(self.times) else "0:00:00"
                clip = WindowClip(position, start, end, error=VideoDecodingError(
                    self.source, f"the moment {moment} lies past the end of the video's decodable data at {reach} "
                                 f"({len(self.times)} of the {self.total} frames it declares)", code="no_frames"))
            elif int(indices[-1]) <= self.received:
                missing = [int(i) for i in indices if int(i) not in self.frames]
                if missing:
                    clip = WindowClip(position, start, end, indices, error=VideoDecodingError(
                        self.source, f"frame {missing[0]} of the moment {moment} could not be decoded",
                        code="unreadable"))
                else:
                    clip = WindowClip(position, start, end, indices,
                                      frames=self.finish([self.frames[int(i)] for i in indices]))
            elif self.ended is not None:
                clip = WindowClip(position, start, end, indices, error=VideoDecodingError(
                    self.source, f"decoding stopped {self._where()}, before the end of the moment {moment}: "
                                 f"{self.ended.reason}", self.ended.backend, code=self.ended.code))
            else:
                return
            self.next += 1
            for index in [i for i in self.frames if self.last_use[i] < self.next]:
                del self.frames[index]
            yield clip


class WindowStream:
    """The windows of one video, decoded in one streaming pass and handed out in order as they complete (see the
    module docstring). Iterate it once: `WindowClip` per window.

    Args:
        source: a video file (or URL).
        windows: `(start, end)` seconds of the windows, or a function of the video's duration that plans them (e.g.
            ``lambda d: plan_windows(d, 30, 15)``).
        num_frames: frames per window.
        prepare: applied to each decoded frame (uint8 RGB ``(H, W, 3)`` array) as it arrives, e.g. a resize to the
            model's input size; default: kept as is.
        finish: turns a window's prepared frames (a list, in order) into its frames; default: `np.stack`.
        backend, isolate_decoder, decode_timeout, num_threads: as `video_decoding.decode_video` (decode_timeout is
            a stall limit), except that ``"auto"`` tries `STREAM_BACKENDS` (PyAV first); a decoder that fails or
            stalls mid-video is then followed by the next one, from the first frame not yet decoded.
        long_read: the stream holds its decoder helper while its windows are used (an index encodes them): it
            decodes in this process' helper for streams (`video_decoding.decoder_process`), so that short reads
            (`decode_video`, `moment_frames`) in other threads never wait for it. False for a short read.

    Attributes (once iteration has begun): `metadata` (`VideoMetadata` of the decoder that opened the video: its
    `duration` is what the container declares, over which `windows` is planned when it is a function),
    `frame_times` (seconds), `duration` (where the frames the decoder found end), `windows` (the plan).

    Raises (when iterated): `FileNotFoundError` or `VideoDecodingError` when no decoder can open the video, a
    `ValueError` for a video without a frame rate or timestamps.
    """

    def __init__(self, source: str | os.PathLike, windows: list[tuple[float, float]] | Callable[[float], list],
                 num_frames: int, prepare: Callable[[np.ndarray], Any] | None = None,
                 finish: Callable[[list[Any]], Any] | None = None, backend: str = "auto",
                 isolate_decoder: bool = True, decode_timeout: float | None = 120.0,
                 num_threads: int | None = None, long_read: bool = True) -> None:
        self.source = check_source(source)
        self.plan_windows, self.num_frames = windows, check_num_frames(num_frames)
        self.prepare = prepare or (lambda frame: frame)
        self.finish = finish or np.stack
        self.options = {"isolate_decoder": isolate_decoder, "decode_timeout": decode_timeout,
                        "num_threads": num_threads, "stream": long_read}
        self.backends = backends_to_try(backend, STREAM_BACKENDS)
        self.metadata = self.frame_times = self.duration = self.windows = None

    def _open(self, backends: list[str], failures: list[tuple[str, VideoDecodingError]]) -> VideoFrames | None:
        """The video opened with the first of `backends` that can (the others' failures added to `failures`)."""
        while backends:
            name = backends.pop(0)
            try:
                check_backend_installed(name)
                video = VideoFrames(self.source, name, **self.options)
                video.open()
                return video
            except VideoDecodingError as error:
                failures.append((name, error))
        return None

    def _assembly(self, video: VideoFrames) -> WindowAssembly:
        metadata = self.metadata = video.metadata
        times = video.frame_times
        if times is None or not len(times):
            if not metadata.fps:
                raise ValueError(f"Cutting {self.source!r} into windows of seconds needs its frame rate or its "
                                 "frames' timestamps; it has neither.")
            times = np.arange(metadata.total_num_frames) / metadata.fps
        if not len(times):
            raise VideoDecodingError(self.source, "the video stream contains no frames", video.backend,
                                     code="no_frames")
        self.frame_times, self.duration = times, data_end(times, metadata.fps)
        # planned over the duration the container declares, as an index plans its rows: a truncated file's windows
        # past its data then fail, naming where the data ends
        declared = metadata.duration or self.duration
        planned = self.plan_windows(declared) if callable(self.plan_windows) else list(self.plan_windows)
        self.windows = [(float(start), float(end)) for start, end in planned]
        step = self.duration - float(times[-1])  # one frame: the tolerance on where the data ends
        plan = [frames_in_window(times, start, end, self.num_frames, self.duration)
                if end <= self.duration + step + TIME_TOLERANCE else None for start, end in self.windows]
        return WindowAssembly(self.source, self.windows, plan, times, int(metadata.total_num_frames), self.finish)

    def __iter__(self) -> Iterator[WindowClip]:
        backends, failures = list(self.backends), []
        video = self._open(backends, failures)
        if video is None:
            raise combined_error(self.source, failures)
        try:
            assembly = self._assembly(video)
            yield from assembly.ready()
            while assembly.next < len(self.windows):
                try:
                    for index, frame in video.frames(assembly.pending()):
                        assembly.add(index, self.prepare(frame))
                        yield from assembly.ready()
                    reason = f"FFmpeg: {video.end_error}" if video.end_error else "the video's data ends there"
                    assembly.end(VideoDecodingError(self.source, reason, video.backend,
                                                    code="unreadable" if video.end_error else "no_frames"))
                except VideoDecodingError as error:  # a crash, a stall, an error: the next decoder goes on from here
                    video.close()
                    failures.append((video.backend, error))
                    video = self._open(backends, failures)
                    if video is None:
                        assembly.end(combined_error(self.source, failures))
                yield from assembly.ready()
        finally:
            if video is not None:
                video.close()


# ------------------------------------------------------------------------------------------------ one video, whole


@dataclass
class VideoWindows:
    """The windows of one video and their frames.

    Attributes:
        source: the video file.
        windows: `(start, end)` seconds of every window decoded.
        frames: every decoded window's frames, stacked: uint8 `(len(windows), num_frames, height, width, 3)` RGB
            (`decode_windows`), or `pixel_values` `(len(windows), num_frames, 3, h, w)` (`window_pixel_values`).
        frame_indices: int64 `(len(windows), num_frames)`: which frame of the video each one is.
        fps: the video's (average) frame rate.
        total_num_frames: the frames the video declares.
        duration: where its decodable frames end, in seconds.
        failures: `(start, end, VideoDecodingError)` of every planned window that could not be decoded (e.g. past the
            end of a truncated file's data).
    """

    source: str
    windows: list[tuple[float, float]]
    frames: Any
    frame_indices: np.ndarray
    fps: float | None
    total_num_frames: int
    duration: float
    failures: list[tuple[float, float, VideoDecodingError]] = field(default_factory=list)


def collect_windows(stream: WindowStream, stack: Callable[[list[Any]], Any] = np.stack) -> VideoWindows:
    """Every window of `stream`, decoded ones stacked (`stack`), failed ones listed; raises the first window's error
    when none could be decoded."""
    clips = list(stream)
    decoded = [clip for clip in clips if clip.error is None]
    if not decoded:
        raise clips[0].error if clips else ValueError(f"No window was planned for {stream.source!r}.")
    return VideoWindows(stream.source, [(clip.start, clip.end) for clip in decoded],
                        stack([clip.frames for clip in decoded]), np.stack([clip.frame_indices for clip in decoded]),
                        stream.metadata.fps, int(stream.metadata.total_num_frames), stream.duration,
                        [(clip.start, clip.end, clip.error) for clip in clips if clip.error is not None])


def decode_windows(
    source: str | os.PathLike,
    window: float,
    stride: float | None = None,
    num_frames: int = 8,
    windows: list[tuple[float, float]] | None = None,
    **decode_options: Any,
) -> VideoWindows:
    """Decodes `source` once and cuts it into windows of `window` seconds every `stride` seconds (default: `window`),
    each with `num_frames` RGB frames at the video's resolution (`WindowStream`; this collects them all: for long
    videos, stream them, or use `window_pixel_values`, which keeps them at the model's input size).

    Args:
        source: a video file (or URL).
        window, stride: seconds (see `plan_windows`), planned over the video's decodable duration.
        num_frames: frames per window.
        windows: `(start, end)` seconds planned beforehand (e.g. by `build.window_entries`), cut instead.
        decode_options: ``backend``, ``isolate_decoder``, ``decode_timeout``, ``num_threads`` (`WindowStream`).

    Raises:
        `ValueError` for bad options or a video without a known frame rate (naming the file); the decoder's
        `VideoDecodingError` for files it cannot read.
    """
    window, stride = check_window_options(window, stride, required=True)
    plan = windows if windows is not None else (lambda duration: window_spans(duration, window, stride))
    return collect_windows(WindowStream(source, plan, num_frames, **decode_options))


def processor_stream_options(video_processor: Any) -> dict[str, Any]:
    """The decoder settings of a video processor (`TestaVideoProcessor`), as `WindowStream` takes them."""
    return {"backend": video_processor.video_backend, "isolate_decoder": video_processor.isolate_decoder,
            "decode_timeout": video_processor.decode_timeout, "num_threads": video_processor.decode_threads}


def processor_frame_steps(video_processor: Any) -> tuple[Callable[[np.ndarray], Any], Callable[[list[Any]], Any]]:
    """`(prepare, finish)` for a `WindowStream` that gives a video processor's `pixel_values` per window: each frame
    resized to the model's input size and normalised as it is decoded (once, though overlapping windows share it),
    each window the concatenation of its frames. The processor's own steps (`TestaVideoProcessor.frame_transforms`),
    which work frame by frame, so every window equals the processor's output for its frames."""
    resize, normalise = video_processor.frame_transforms()

    def prepare(frame: np.ndarray) -> torch.Tensor:
        return normalise(resize(torch.from_numpy(frame)[None].permute(0, 3, 1, 2)))

    return prepare, torch.cat


def window_pixel_values(video_processor: Any, source: str | os.PathLike, window: float, stride: float | None = None,
                        num_frames: int | None = None, windows: list[tuple[float, float]] | None = None
                        ) -> tuple[VideoWindows, torch.Tensor]:
    """Every window of `source` as model input: `(windows, pixel_values)` with `pixel_values`
    `(len(windows), num_frames, 3, H, W)` (also `windows.frames`), decoded once with the processor's decoder settings,
    each frame resized to the model's input size as it is decoded, and transformed as the processor transforms a
    whole clip (resize, crop, normalise)."""
    window, stride = check_window_options(window, stride, required=True)
    plan = windows if windows is not None else (lambda duration: window_spans(duration, window, stride))
    prepare, finish = processor_frame_steps(video_processor)
    stream = WindowStream(source, plan, int(num_frames or video_processor.num_frames), prepare,
                          finish, **processor_stream_options(video_processor))
    cut = collect_windows(stream, torch.stack)
    return cut, cut.frames


def moment_frames(source: str | os.PathLike, start: float, end: float, num_frames: int = 6,
                  **decode_options: Any) -> np.ndarray:
    """`num_frames` RGB frames `(num_frames, H, W, 3)` spread over `[start, end)` seconds of a video (uniform segment
    midpoints of the frames shown then), e.g. a strip that shows a moment. PyAV seeks to the keyframe before the
    moment, so this costs about one GOP wherever the moment lies. `decode_options` as `WindowStream`'s."""
    check_num_frames(num_frames)
    if not (math.isfinite(start) and math.isfinite(end)) or not 0 <= start < end:
        raise ValueError(f"A moment needs 0 <= start < end seconds, got ({start!r}, {end!r}).")
    (clip,) = list(WindowStream(source, [(float(start), float(end))], num_frames, long_read=False, **decode_options))
    if clip.error is not None:
        raise clip.error
    return clip.frames


# ------------------------------------------------------------------------------------------------ refining


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


# ------------------------------------------------------------------------------------------- rows of an index


def probe_duration(source: str | os.PathLike) -> float:
    """A video's duration in seconds from its container (PyAV: the frames it declares, else its packets, over the
    frame rate; no frame is decoded). Raises `ValueError` naming the file."""
    from modeling_testa.video_decoding_worker import DecodeFailure, pyav_open, pyav_probe

    source = os.fspath(source)
    try:
        container, stream = pyav_open(source, 1)
        with container:
            rate = stream.average_rate or stream.guessed_rate
            total, fps = int(stream.frames or 0), (float(rate) if rate else None)
        if not total:  # not declared: count the packets
            info = pyav_probe(source)
            total = info["packets"]
    except (DecodeFailure, OSError, ImportError) as error:
        raise ValueError(f"Cannot read the duration of {source!r}: {error}") from error
    if not total or not fps:
        raise ValueError(f"Cannot read the duration of {source!r}: {total} frames at {fps} fps.")
    return total / fps


def video_groups(rows: Iterable[int], names: list[str]) -> list[tuple[str, list[int]]]:
    """Consecutive rows of the same video, grouped: ``[(video, [rows...]), ...]`` (each video decoded once)."""
    groups: list[tuple[str, list[int]]] = []
    for row in rows:
        if groups and groups[-1][0] == names[row] and groups[-1][1][-1] == row - 1:
            groups[-1][1].append(row)
        else:
            groups.append((names[row], [row]))
    return groups


def rebatch(batches: Iterable[Any], batch_size: int) -> Iterator[Any]:
    """`encoding.DecodedBatch` es regrouped into batches of at most `batch_size` rows (short videos joined, a long
    one split over several encoder forwards); failures pass with the next batch."""
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


class WindowRowDecoder:
    """The index builder's decoder (`homes.Decoder`: ``decode(entries, positions)`` -> `encoding.DecodedBatch`
    es) for rows that are moments of video files (``entry.start``/``entry.end`` seconds; None: the whole video).

    The rows of one video (consecutive positions, `video_groups`) are decoded in one `WindowStream`: each frame
    resized to the model's input size as it is decoded (`processor_frame_steps`), kept while an open window needs it,
    and every window handed to the encoder as soon as it is complete, `batch_size` windows at a time, so the index
    fills while the video is still decoding and memory does not grow with its length. With `num_workers`, that many
    videos are decoded at once in threads (`encoding.DecodeAhead`, each with a decoder process of its own), each at most
    `batch_size` windows ahead of the encoder. A row that cannot be decoded (the file, or only its moment: past the
    end of a truncated file's data, after a decoder stopped) is a `Failure` with the row's start and end
    (``on_error="skip"``), or raises (``"raise"``).

    Args:
        video_processor: a `TestaVideoProcessor` (its decoder settings and `frame_transforms`).
        num_frames: frames per row.
        batch_size: rows per batch.
        num_workers: videos decoded at once in threads (0: in the calling thread).
        on_error: ``"skip"`` or ``"raise"``.
    """

    def __init__(self, video_processor: Any, num_frames: int, batch_size: int = 8, num_workers: int = 0,
                 on_error: str = "skip") -> None:
        self.video_processor, self.num_frames = video_processor, check_num_frames(num_frames)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.on_error = check_on_error(on_error)

    def _failure(self, error: BaseException, video: str, row: int, entry: Any) -> tuple[int, None, Failure]:
        if self.on_error == "raise" or not is_media_error(error):
            raise error
        return row, None, Failure.from_error(error, video, row, start=entry.start, end=entry.end)

    def _whole(self, video: str, row: int, entry: Any) -> tuple[int, torch.Tensor | None, Failure | None]:
        try:
            pixel_values = self.video_processor(videos=[video], num_frames=self.num_frames, frame_sampling="uniform",
                                                return_tensors="pt")["pixel_values"][0]
        except Exception as error:  # noqa: BLE001 - a media error becomes the row's failure, others raise
            return self._failure(error, video, row, entry)
        return row, pixel_values, None

    def video_rows(self, video: str, rows: list[int], entries: list[Any]
                   ) -> Iterator[tuple[int, torch.Tensor | None, Failure | None]]:
        """``(row, pixel_values or None, failure or None)`` for the rows of one video, in order, each window as
        soon as it is decoded."""
        # whole-video rows first, before the stream opens the video (their tensors are one clip each)
        whole = {row: self._whole(video, row, entries[row]) for row in rows if entries[row].start is None}
        moments = [row for row in rows if entries[row].start is not None]
        clips: Iterator[WindowClip] = iter(())
        if moments:
            prepare, finish = processor_frame_steps(self.video_processor)
            clips = iter(WindowStream(video, [(float(entries[r].start), float(entries[r].end)) for r in moments],
                                      self.num_frames, prepare, finish,
                                      **processor_stream_options(self.video_processor)))
        unopened: BaseException | None = None
        for row in rows:
            entry = entries[row]
            if entry.start is None:
                yield whole.pop(row)
                continue
            if unopened is not None:
                yield self._failure(unopened, video, row, entry)
                continue
            try:
                clip = next(clips)
            except (OSError, VideoDecodingError) as error:  # the video cannot be opened: every moment fails
                unopened = error
                yield self._failure(error, video, row, entry)
                continue
            if clip.error is not None:
                yield self._failure(clip.error, video, row, entry)
            else:
                yield row, clip.frames, None
        for _ in clips:  # let the stream read the decoder's end, so its helper serves the next video
            pass

    def __call__(self, entries: list[Any], positions: list[int]) -> Iterator[DecodedBatch]:
        groups = video_groups(positions, [entry.name(i) for i, entry in enumerate(entries)])
        with DecodeAhead(lambda g: self.video_rows(*groups[g], entries), len(groups), self.num_workers,
                         thread_initializer=own_decoder_process, max_items=self.batch_size) as streams:
            rows = (([], None, [failure]) if failure is not None else ([row], pixel_values[None], [])
                    for row, pixel_values, failure in streams)
            yield from rebatch(rows, self.batch_size)


def moment_label(result: Mapping[str, Any]) -> str:
    """``"  0:01:30-0:02:00"`` for a search result that is a moment, ``""`` for a whole video."""
    return "" if result.get("start") is None else f"  {format_time(result['start'])}-{format_time(result['end'])}"


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
    "STREAM_BACKENDS",
    "VideoWindows",
    "WindowAssembly",
    "WindowClip",
    "WindowRowDecoder",
    "WindowStream",
    "best_moment_per_video",
    "check_num_frames",
    "check_window_options",
    "collect_windows",
    "data_end",
    "decode_windows",
    "format_time",
    "frame_spans",
    "frames_in_window",
    "moment_frames",
    "moment_label",
    "plan_windows",
    "probe_duration",
    "processor_frame_steps",
    "processor_stream_options",
    "rebatch",
    "refine_moment",
    "video_groups",
    "window_frame_indices",
    "window_spans",
    "window_pixel_values",
]
