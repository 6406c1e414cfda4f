"""Video decoding: `decode_video` (decord or PyAV, isolated in a helper process), frame sampling and its errors.

* `sample_frame_indices` chooses which frames to decode (uniform segment midpoints, random per segment, head/tail),
  and `frames_for_fps` how many frames a frame rate asks for.
* `decode_video` opens a file or URL, lets a caller's function choose the frame indices from the video's metadata, and
  decodes them with decord or PyAV (`backend="auto"`: decord, then PyAV if decord is missing or fails on the file).
* `VideoFrames` is one video opened with one decoder: its metadata and every frame's time (`frame_times`, from the
  container's timestamps), then the frames asked for, streamed in order as they are decoded, so a caller keeps only
  what it still needs (`moments` cuts long videos into windows this way). PyAV skips frames that are not needed and
  seeks to the keyframe before a distant one; decord seeks by itself.
* `VideoDecodingError` (a `ValueError`) and `VideoDecodingTimeoutError` name the file and give the decoder's reason.

Decord and PyAV are C libraries around FFmpeg: decord has upstream reports of segmentation faults and aborts on some
corrupt files and of endless "rewind" loops, and the PyAV fallback is typically asked to read the very file that just
failed in decord. On POSIX systems **both** backends therefore run in one long-lived helper process by default
(`isolate_decoder=True`; the helper is the sibling `worker_process.py` run by path, serving
`video_decoding_worker.py`), with a stall limit (`decode_timeout`: seconds without progress, however long the video),
so that a crash or a hang in either decoder raises a `VideoDecodingError` naming the file and where the decoder was,
in the caller, instead of killing or blocking it. With `isolate_decoder=False`, or where no helper process can be
started (not POSIX), the same readers run in process. `own_decoder_process` gives a thread a helper of its own (parallel
decoding); `shutdown_decoder_process` stops the helpers.

This file is Hub remote code (exported with `video_processing_testa.py`): sibling-relative imports only.
"""

import atexit
import errno
import logging
import math
import os
import pickle
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from transformers.video_utils import VideoMetadata

# `from .module import ...` (not `from . import module`): transformers exports the files named this way with the code
from .video_decoding_worker import DECODERS, DecodeFailure, TruncatedVideo, open_reader
from .worker_process import START_TIMEOUT, WorkerGone, WorkerProcess, signal_name


try:  # POSIX only; without it the decoders run in process
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


logger = logging.getLogger(__name__)

FRAME_SAMPLING_STRATEGIES = ("uniform", "random", "headtail")
"""The frame-sampling strategies of `sample_frame_indices`."""

VIDEO_BACKENDS = ("auto", *DECODERS)
"""The values of `decode_video(backend=...)`: ``"auto"`` and the decoders (`video_decoding_worker.DECODERS`)."""
STREAM_ORDER = tuple(sorted(DECODERS, key=lambda name: not DECODERS[name].streams))
"""The ``"auto"`` order of a long stream (`testa_search.moments`): streaming decoders (`Decoder.streams`) first."""

_URL_SCHEMES = ("http://", "https://", "rtsp://", "rtmp://", "ftp://")

# ----------------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------------


class VideoDecodingError(ValueError):
    """A video could not be decoded. The message names the input and gives the decoder's reason.

    Attributes:
        source (`str`): the path or URL that failed.
        reason (`str`): why it failed (the decoder's own message where there is one).
        backend (`str` or `None`): the decoder that failed (`"decord"`, `"pyav"`), or `None` when no decoder was run or
            when all decoders failed (the reason then lists each).
        code (`str`): why, as a stable word set where the error is raised (`testa_search.encoding.FAILURE_CODES`): `"empty"`,
            `"no_frames"`, `"decoder_crash"`, `"timeout"`, or `"unreadable"` (the default: any other reason).
    """

    code = "unreadable"

    def __init__(self, source: str, reason: str, backend: str | None = None, code: str | None = None) -> None:
        self.source = str(source)
        self.reason = reason
        self.backend = backend
        if code is not None:
            self.code = code
        via = f" with {backend}" if backend else ""
        super().__init__(f"Could not decode video {self.source!r}{via}: {reason}")


class VideoDecodingTimeoutError(VideoDecodingError, TimeoutError):
    """The decoder made no progress for `decode_timeout` seconds (a stall); the decoder process was killed."""

    code = "timeout"


# ----------------------------------------------------------------------------------------------------------------------
# Frame sampling
# ----------------------------------------------------------------------------------------------------------------------


def sample_frame_indices(
    total_num_frames: int,
    num_frames: int,
    strategy: str = "uniform",
    generator: torch.Generator | None = None,
) -> np.ndarray:
    """Chooses `num_frames` frame indices (in temporal order) out of a video of `total_num_frames` frames.

    Args:
        total_num_frames (`int`): number of frames in the video (>= 1).
        num_frames (`int`): number of indices to return (>= 1).
        strategy (`str`, defaults to `"uniform"`):
            - `"uniform"`: the video is cut into `num_frames` equal segments and the middle frame of each is taken,
              `floor((i + 0.5) * total / num_frames)`. This covers the whole video, tail included, and is
              deterministic (evaluation).
            - `"random"`: one frame drawn uniformly at random inside each segment (training).
            - `"headtail"`: `num_frames // 2` distinct random frames from the first half of the video and the rest
              from the second half, each part sorted (the original's pretraining sampler; it returned one frame too
              few for odd `num_frames`, this returns exactly `num_frames`).
            Videos with fewer frames than `num_frames` always use the uniform rule, which then repeats frames evenly
            and in order (e.g. 3 frames -> 8: `[0, 0, 0, 1, 1, 2, 2, 2]`).
        generator (`torch.Generator`, *optional*): random source for `"random"` and `"headtail"`; the global torch
            RNG when `None` (so `torch.manual_seed` and DataLoader worker seeding apply).

    Returns:
        `np.ndarray` of `num_frames` int64 indices in `[0, total_num_frames)`, non-decreasing.
    """
    total_num_frames = int(total_num_frames)
    num_frames = int(num_frames)
    if total_num_frames < 1:
        raise ValueError(f"Cannot sample frames from a video with {total_num_frames} frames.")
    if num_frames < 1:
        raise ValueError(f"`num_frames` must be >= 1, got {num_frames}.")
    if strategy not in FRAME_SAMPLING_STRATEGIES:
        raise ValueError(f"Unknown frame_sampling={strategy!r}; use one of {FRAME_SAMPLING_STRATEGIES}.")

    if strategy == "uniform" or total_num_frames < num_frames:
        # integer arithmetic: floor((2i + 1) * total / (2 * num_frames))
        steps = 2 * np.arange(num_frames, dtype=np.int64) + 1
        return steps * total_num_frames // (2 * num_frames)

    if strategy == "random":
        bounds = np.arange(num_frames + 1, dtype=np.int64) * total_num_frames // num_frames
        starts, lengths = bounds[:-1], np.diff(bounds)  # every segment is non-empty since total >= num_frames
        offsets = torch.rand(num_frames, generator=generator, dtype=torch.float64).numpy()
        return starts + np.minimum((offsets * lengths).astype(np.int64), lengths - 1)

    # headtail
    half = total_num_frames // 2
    n_head = num_frames // 2
    n_tail = num_frames - n_head
    head = torch.randperm(half, generator=generator)[:n_head].numpy()
    tail = half + torch.randperm(total_num_frames - half, generator=generator)[:n_tail].numpy()
    return np.concatenate([np.sort(head), np.sort(tail)]).astype(np.int64)


def frames_for_fps(total_num_frames: int, video_fps: float | None, fps: float, source: str = "the video") -> int:
    """How many frames sampling `fps` frames per second takes from a video: transformers' rule,
    `max(1, int(total_num_frames / video_fps * fps))` (`BaseVideoProcessor.sample_frames`).

    Args:
        total_num_frames (`int`): frames in the video.
        video_fps (`float`, *optional*): the video's frame rate; `None` or 0 when unknown (an in-memory array without
            `video_metadata`), which raises.
        fps (`float`): frames to sample per second of video (> 0).
        source (`str`, defaults to `"the video"`): names the video in error messages.

    Raises:
        `ValueError`: the frame rate is unknown, or `fps` asks for more frames than the video has (as transformers;
            `num_frames` instead repeats frames of short videos).
    """
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise ValueError(f"`fps` must be a positive number of frames per second, got {fps!r}.")
    if not video_fps:
        raise ValueError(
            f"Sampling by `fps={fps}` needs the frame rate of {source}, which is unknown: pass "
            "`video_metadata={'fps': ...}` with arrays or lists of frames, or sample a fixed `num_frames` instead."
        )
    count = max(1, int(total_num_frames / video_fps * fps))
    if count > total_num_frames:
        raise ValueError(
            f"Sampling {source} at fps={fps} asks for {count} frames, but it has only {total_num_frames} "
            f"({video_fps:g} frames per second); use an `fps` of at most {video_fps:g} or a fixed `num_frames`."
        )
    return count


def check_frame_indices(indices: Any, total_num_frames: int, source: str) -> np.ndarray:
    """Returns the indices chosen by a frame-sampling function as a flat int64 array, after checking that there is at
    least one and that all lie in `[0, total_num_frames)`; otherwise raises a `ValueError` naming `source`."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.size == 0:
        raise ValueError(f"The frame-sampling function returned no indices for {source!r}.")
    if indices.min() < 0 or indices.max() >= total_num_frames:
        raise ValueError(
            f"The frame-sampling function returned indices outside [0, {total_num_frames}) for {source!r}: "
            f"min {indices.min()}, max {indices.max()}."
        )
    return indices


# ----------------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------------


def _is_url(source: str) -> bool:
    return source.lower().startswith(_URL_SCHEMES)


def check_source(source: str | os.PathLike) -> str:
    """Normalises a path/URL and raises early, with the path, for missing, non-regular and empty files."""
    source = os.fspath(source)
    if not isinstance(source, str):
        source = os.fsdecode(source)
    if source.startswith("file://"):
        source = source[len("file://") :]
    if _is_url(source):
        return source
    if not os.path.exists(source):
        raise FileNotFoundError(errno.ENOENT, "Video file not found", source)
    if os.path.isdir(source):
        raise IsADirectoryError(errno.EISDIR, "Expected a video file but got a directory", source)
    if os.path.getsize(source) == 0:
        raise VideoDecodingError(source, "the file is empty (0 bytes), so no decoder can read it", code="empty")
    return source


def decoder_available(name: str) -> bool:
    """Whether the decoder `name` (a key of `DECODERS`) can be imported."""
    try:
        DECODERS[name].load()
    except Exception:  # ImportError, or a broken shared library
        return False
    return True


_DECORD_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
_FFMPEG_ADDRESS = re.compile(r" @ 0x[0-9a-fA-F]+\]")


def _clean_decoder_message(message: str) -> str:
    """Shortens decord's C++ messages (timestamps, source locations, stack traces) to their first meaningful line."""
    lines = []
    for line in str(message).splitlines():
        line = _DECORD_PREFIX.sub("", line.strip())
        line = _DECORD_PREFIX.sub("", line)  # decord nests "[time] file:line: [time] file:line: message"
        if not line or line.startswith(("Stack trace", "[bt]")):
            continue
        lines.append(line)
    return " | ".join(lines[:2]) if lines else str(message).strip()


def format_time(seconds: float | None) -> str:
    """``h:mm:ss`` (whole seconds, rounded down), e.g. ``3725.4 -> "1:02:05"``; ``"-"`` for None (a whole video)."""
    if seconds is None:
        return "-"
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"A time must be a non-negative number of seconds, got {seconds!r}.")
    whole = int(seconds + 1e-6)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _where(frames_reached: int, seconds_reached: float | None, total: int | None) -> str:
    """``"0:41:12 (frame 74160 of 108000)"``: how far a decoder got."""
    of = f" of {total}" if total else ""
    at = f"{format_time(seconds_reached)} " if seconds_reached is not None else ""
    return f"{at}(frame {frames_reached}{of})"


def _finish(
    frames_unique: np.ndarray, inverse: np.ndarray, indices: np.ndarray, metadata: VideoMetadata
) -> tuple[np.ndarray, VideoMetadata]:
    """Expands the decoded unique frames back to the requested (possibly repeated, unsorted) indices."""
    in_order = len(inverse) == len(frames_unique) and np.array_equal(inverse, np.arange(len(inverse)))
    frames = frames_unique if in_order else frames_unique[inverse]
    metadata.frames_indices = [int(i) for i in indices]
    metadata.height, metadata.width = int(frames.shape[1]), int(frames.shape[2])
    return np.ascontiguousarray(frames), metadata


def _read_all(video: "VideoFrames", unique: np.ndarray) -> np.ndarray:
    """The frames `unique` (sorted, distinct) of an opened video, stacked; `TruncatedVideo` when the decoder's data
    ends before the last of them."""
    frames = dict(video.frames(unique))
    missing = [int(i) for i in unique if int(i) not in frames]
    if missing:
        if missing[0] < video.reached:  # a frame inside the data could not be decoded: not a truncation
            raise VideoDecodingError(video.source, f"frame {missing[0]} could not be decoded"
                                     + (f" (FFmpeg: {video.end_error})" if video.end_error else ""), video.backend)
        raise TruncatedVideo(video.reached, video.end_error)
    return np.stack([frames[int(i)] for i in unique])


def _sample_and_read(
    video: "VideoFrames", sample_indices_fn: Callable[[VideoMetadata], Any]
) -> tuple[np.ndarray, VideoMetadata]:
    """Samples the indices of an opened video here (this process' RNG) from its metadata and reads the frames. A
    video that turns out truncated (`TruncatedVideo`: fewer frames than declared) is sampled again over the frames
    that are really there."""
    source, backend, metadata = video.source, video.backend, video.metadata
    total, fps = metadata.total_num_frames, metadata.fps
    if total <= 0:
        what = "no decodable frames" if DECODERS[backend].counts_decodable_frames else "no frames"
        raise VideoDecodingError(source, f"the video stream contains {what}", backend, code="no_frames")
    indices = check_frame_indices(sample_indices_fn(metadata), total, source)
    unique, inverse = np.unique(indices, return_inverse=True)
    try:
        frames = _read_all(video, unique)
    except TruncatedVideo as exc:
        ffmpeg = f" (FFmpeg: {exc.error})" if exc.error else ""
        if exc.decoded <= 0:
            raise VideoDecodingError(source, f"the video stream contains no decodable frames{ffmpeg}", backend,
                                     code="no_frames") from None
        logger.warning("Only %d of the %d frames declared by %r could be decoded%s; sampling from those.",
                       exc.decoded, total, source, ffmpeg)
        metadata.total_num_frames = exc.decoded
        metadata.duration = exc.decoded / fps if fps else None
        indices = check_frame_indices(sample_indices_fn(metadata), exc.decoded, source)
        unique, inverse = np.unique(indices, return_inverse=True)
        try:
            frames = _read_all(video, unique)
        except TruncatedVideo:
            raise VideoDecodingError(source, f"decoding is not reproducible{ffmpeg}", backend) from None
    return _finish(frames, inverse, indices, metadata)


def _reader_errors(source: str, backend: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with the in-process decoders' errors raised as `VideoDecodingError` naming the file."""
    try:
        return fn(*args)
    except ImportError:
        raise
    except DecodeFailure as exc:
        raise VideoDecodingError(source, str(exc), backend, code=exc.code) from exc
    except Exception as exc:  # DECORDError, av.FFmpegError, RuntimeError, ...
        raise VideoDecodingError(source, _clean_decoder_message(exc), backend) from exc


class VideoFrames:
    """One video opened with one decoder, in this process or in a decoder helper process: its `metadata`, then the
    frames asked for, streamed (`frames`). A context manager; the helper (the calling thread's, see
    `decoder_process`) serves this video only until it is closed.

    Args:
        source: a checked path or URL.
        backend: ``"decord"`` or ``"pyav"``.
        isolate_decoder: decode in the helper process (where supported).
        decode_timeout: the stall limit in seconds: the helper is killed when it makes no progress (opens, decodes
            a frame, demuxes) for this long, and `VideoDecodingTimeoutError` says where it was. None: no limit.
        num_threads: decoder threads (None or 0: the decoder chooses).
        helper: the `DecoderProcess` to decode in (default: the calling thread's, `decoder_process`). A helper this
            thread is already using for another open video is not waited for (that would never end): a helper of
            this video's own serves it instead.
        stream: the video is read whole while its frames are used (`decoder_process(stream=True)`).

    Attributes (after `open`): `metadata` (a `VideoMetadata`) and `frame_times` (every frame's presentation time in
    seconds from the first, from the container's timestamps, as float64; None where it has no usable ones). After
    `frames` is exhausted: `reached` (one past the last frame index the decoder got to) and `end_error` (the
    decoder's reason when it stopped before the end of the data, else None).
    """

    def __init__(self, source: str, backend: str, isolate_decoder: bool = True, decode_timeout: float | None = 120.0,
                 num_threads: int | None = None, helper: "DecoderProcess | None" = None, stream: bool = False) -> None:
        self.source, self.backend, self.timeout, self.num_threads = source, backend, decode_timeout, num_threads
        if helper is None and isolate_decoder and isolation_supported():
            helper = decoder_process(stream)
        self.helper = helper
        self.temporary = False
        self.reader = None
        self.metadata: VideoMetadata | None = None
        self.frame_times: np.ndarray | None = None
        self.reached, self.end_error = 0, None
        self.locked = False

    def __enter__(self) -> "VideoFrames":
        self.open()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def open(self) -> VideoMetadata:
        """Opens the video and returns its metadata; raises `VideoDecodingError` naming the file."""
        if self.helper is not None:
            if self.helper.holder == threading.get_ident():  # this thread is inside another video on it
                self.helper, self.temporary = DecoderProcess(), True
            self.helper.lock.acquire()
            self.helper.holder, self.locked = threading.get_ident(), True
            try:
                info = self.helper.open(self.backend, self.source, self.num_threads, self.timeout)
            except BaseException:
                self.close()
                raise
        else:
            self.reader = _reader_errors(self.source, self.backend, open_reader, self.backend, self.source,
                                         self.num_threads)
            info = self.reader.metadata
        total, fps = int(info["total_num_frames"]), info["fps"]
        self.metadata = VideoMetadata(total_num_frames=total, fps=fps, width=info.get("width"),
                                      height=info.get("height"), duration=total / fps if fps else None,
                                      video_backend=self.backend)
        times = info.get("frame_times")
        self.frame_times = None if times is None else np.asarray(times, dtype=np.float64)
        return self.metadata

    def frames(self, wanted: Any) -> Iterator[tuple[int, np.ndarray]]:
        """Yields ``(index, frame)`` (uint8 RGB ``(H, W, 3)``) for the sorted, distinct indices `wanted`, in order, as
        they are decoded. Ends early where the video's data ends (see `reached`, `end_error`): a frame asked for
        and not given is not decodable. Raises `VideoDecodingError` if the decoder fails, crashes or stalls."""
        wanted = [int(i) for i in wanted]
        if self.helper is not None:
            stream = self.helper.stream(wanted, self.source, self.backend, self.timeout, self.frame_times,
                                        self.metadata.total_num_frames)
            for item in stream:
                yield item
            self.reached, self.end_error = self.helper.ended
            return
        reader = self.reader
        frames = reader.frames(wanted)
        while True:
            item = _reader_errors(self.source, self.backend, next, frames, None)
            if item is None:
                break
            yield item
        self.reached, self.end_error = reader.reached, reader.error

    def close(self) -> None:
        """Releases the video (and the helper, which is stopped if a stream was left unfinished)."""
        self.reader = None
        if self.helper is not None and self.locked:
            try:
                self.helper.finish_video()
                if self.temporary:
                    self.helper.stop()
            finally:
                self.locked, self.helper.holder = False, None
                self.helper.lock.release()


# --- the decoder helper process ---------------------------------------------------------------------------------------
#
# Both backends run in a long-lived helper process (`worker_process.py` run by path, serving the sibling
# `video_decoding_worker.py`, which imports only numpy and the decoder libraries) that talks to this process over
# pipes (`worker_process`). If a decoder crashes (segfault, C++ abort) or stops making progress, only the helper dies
# or is killed; the caller gets a `VideoDecodingError` and the next call starts a new helper. Starting the helper
# costs ~0.3 s once per process (its own limit, `worker_process.START_TIMEOUT`, not the stall limit); each video
# then costs only the pipe transfer of its frames.

_WORKER_SCRIPT = os.path.abspath(sys.modules[open_reader.__module__].__file__)
"""The helper's request handler (the `video_decoding_worker.py` next to this file, also in an exported Hub folder)."""

_KIT_SCRIPT = os.path.abspath(sys.modules[WorkerProcess.__module__].__file__)
"""The helper's main script (`worker_process.py`, next to this file)."""


def isolation_supported() -> bool:
    """Whether decoders can run in a helper process here (POSIX: needs `select` on pipes and a Python executable)."""
    return (os.name == "posix" and fcntl is not None and bool(sys.executable) and os.path.isfile(_WORKER_SCRIPT)
            and os.path.isfile(_KIT_SCRIPT))


def _helper_argv() -> list[str]:
    return [sys.executable, _KIT_SCRIPT, _WORKER_SCRIPT]


class DecoderProcess(WorkerProcess):
    """The client side of one decoder helper process (`video_decoding_worker.py`), which decodes with decord or PyAV.

    By default every thread of a Python process shares one (re-created after `fork`); `own_decoder_process` gives a
    thread one of its own. One video at a time (`lock`, held by `VideoFrames` from open to close). The helper starts
    at the first video and is started again after a crash, a stall or `stop()`.
    """

    def __init__(self) -> None:
        super().__init__(_helper_argv)
        self.lock = threading.Lock()
        self.holder: int | None = None  # the thread that holds `lock` (an open `VideoFrames`)
        self.busy = False  # a request was sent and its reply not fully read: the protocol state is unknown
        self.ended: tuple[int, str | None] = (0, None)
        self.log_offset = 0

    def _exit_description(self, backend: str) -> str:
        code = self.exit_code()
        if code is None:
            return "the decoder process stopped responding"
        name = signal_name(code)
        if name:
            return f"the {backend} decoder crashed ({name})"
        return f"the decoder process exited unexpectedly (exit code {code})"

    def _log_tail(self, offset: int, max_lines: int = 3) -> str:
        lines = [_FFMPEG_ADDRESS.sub("]", _DECORD_PREFIX.sub("", line.strip()))
                 for line in self.log_since(offset).splitlines()]
        return " | ".join([line for line in lines if line][-max_lines:])

    def _ensure_started(self, source: str, backend: str) -> None:
        if self.running() and not self.busy:
            return
        self.stop()
        self.busy = False
        try:
            self.start()
        except (WorkerGone, TimeoutError, OSError, ValueError, pickle.UnpicklingError) as exc:
            if self.process is not None and isinstance(exc, WorkerGone):
                description = self._exit_description(backend)
            elif isinstance(exc, TimeoutError):
                description = f"it did not answer within {START_TIMEOUT:g} s"
            else:
                description = str(exc) or type(exc).__name__
            tail = self._log_tail(0)
            description += f"; decoder log: {tail}" if tail else ""
            self.stop()
            raise VideoDecodingError(
                source, f"could not start the decoder process: {description}", backend, code="decoder_crash"
            ) from None

    def _request(self, message: tuple, source: str, backend: str, timeout: float | None,
                 where: Callable[[], str] = lambda: "") -> Iterator[tuple]:
        """Sends `message` and yields its replies until a final one (not ``"progress"`` or ``"frame"``), a frame's
        message with its pixels. Each reply must come within `timeout` seconds of the one before (the stall limit).
        The helper's failures are raised as `VideoDecodingError` naming `source`."""
        try:
            self.busy = True
            self.send(message)
            while True:
                reply = self.receive(time.monotonic() + timeout if timeout else None)
                if reply[0] == "frame":
                    frame = np.empty(reply[2], dtype=np.dtype(reply[3]))
                    self.receive_into(memoryview(frame).cast("B"), time.monotonic() + timeout if timeout else None)
                    reply = (reply[0], reply[1], frame)
                elif reply[0] == "error":
                    self.busy = False
                    raise self._error(source, backend, reply)
                final = reply[0] not in ("progress", "frame")
                if final:
                    self.busy = False
                yield reply
                if final:
                    return
        except VideoDecodingError:
            raise
        except (WorkerGone, BrokenPipeError):
            description = self._exit_description(backend)
            tail = self._log_tail(self.log_offset)
            self.stop()
            raise VideoDecodingError(
                source, description + (f"; decoder log: {tail}" if tail else ""), backend, code="decoder_crash"
            ) from None
        except TimeoutError:
            self.stop()
            at = where()
            raise VideoDecodingTimeoutError(
                source, f"the decoder made no progress for decode_timeout={timeout:g} s"
                + (f" at {at}" if at else "") + "; the decoder process was killed", backend,
            ) from None

    def _error(self, source: str, backend: str, message: tuple) -> VideoDecodingError:
        _, kind, text, code = message
        reason = text if kind == "DecodeFailure" else _clean_decoder_message(text)
        if kind == "ImportError":
            reason = f"the decoder process cannot import it: {reason}"
        tail = self._log_tail(self.log_offset)
        if tail and tail not in reason:
            reason = f"{reason} (decoder log: {tail})"
        return VideoDecodingError(source, reason, backend, code=code)

    def open(self, backend: str, source: str, num_threads: int | None, timeout: float | None) -> dict[str, Any]:
        """Opens `source` in the helper (started if needed); returns its metadata. Call with `lock` held."""
        self._ensure_started(source, backend)
        self.log_offset = self.log_mark()
        # a shared helper keeps the working directory it started in: a relative path is resolved here, in the caller's
        # (its messages still name `source` as given)
        path = source if "://" in source else os.path.abspath(source)
        replies = self._request(("open", backend, path, int(num_threads or 0)), source, backend, timeout,
                                lambda: "opening it")
        return [reply for reply in replies if reply[0] == "metadata"][0][1]

    def stream(self, wanted: list[int], source: str, backend: str, timeout: float | None,
               times: np.ndarray | None = None, total: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """Streams the frames `wanted` of the open video, ``(index, frame)`` in order; `ended` then holds
        ``(frames reached, the decoder's error or None)``. `times` and `total` (the video's frame times and frame
        count) let a stall's error say where the decoder was. Call with `lock` held."""
        progress = [0, None]

        def where() -> str:
            return _where(progress[0], progress[1], total)

        for reply in self._request(("stream", wanted), source, backend, timeout, where):
            if reply[0] == "progress":
                progress[:] = reply[1:]
            elif reply[0] == "frame":
                index = reply[1]
                progress[:] = [index + 1, float(times[index]) if times is not None and index < len(times) else None]
                yield index, reply[2]
            else:
                self.ended = (reply[1], reply[2])

    def finish_video(self) -> None:
        """Closes the open video; a helper left in the middle of a reply (a stream not read to its end) is
        stopped, and the next video starts a new one."""
        if self.busy:
            self.stop()
        self.busy = False

    def decode(
        self,
        backend: str,
        source: str,
        sample_indices_fn: Callable[[VideoMetadata], Any],
        num_threads: int | None,
        timeout: float | None,
    ) -> tuple[np.ndarray, VideoMetadata]:
        """Opens `source` in the helper, samples indices here (this process' RNG), decodes them there."""
        with VideoFrames(source, backend, decode_timeout=timeout, num_threads=num_threads, helper=self) as video:
            return _sample_and_read(video, sample_indices_fn)


_SHARED: dict[bool, DecoderProcess] = {}  # this process' shared helpers: for short reads (False), for streams (True)
_WORKER_LOCK = threading.Lock()
_THREAD_WORKER = threading.local()
_OWN_WORKERS: "weakref.WeakSet[DecoderProcess]" = weakref.WeakSet()


def own_decoder_process() -> DecoderProcess:
    """Gives the calling thread a decoder helper process of its own, so that several threads decode in parallel
    (by default every thread of a process shares one helper, which decodes one video at a time). The helper starts at
    the thread's first isolated decode. Returns it: call its `stop()` when the thread is done decoding."""
    worker = DecoderProcess()
    _THREAD_WORKER.worker = worker
    with _WORKER_LOCK:
        _OWN_WORKERS.add(worker)
    return worker


def decoder_process(stream: bool = False) -> DecoderProcess:
    """The calling thread's own decoder helper (`own_decoder_process`), else one of this process' shared ones (new
    ones after `fork`, e.g. in DataLoader workers): one for short reads (`decode_video`: a clip's frames, a moment's
    strip), another for streams that hold their helper for a whole video while its windows are encoded
    (``stream=True``: `moments.WindowStream`), so that a short read never waits for a long stream."""
    own = getattr(_THREAD_WORKER, "worker", None)
    if own is not None and own.owner_pid == os.getpid():
        return own
    with _WORKER_LOCK:
        shared = _SHARED.get(stream)
        if shared is None or shared.owner_pid != os.getpid():
            shared = _SHARED[stream] = DecoderProcess()
        return shared


def shutdown_decoder_process() -> None:
    """Stops this process' decoder helper processes (the shared ones and the threads' own ones, see
    `own_decoder_process`), if running (the shared ones are restarted on demand)."""
    with _WORKER_LOCK:
        workers = [*_SHARED.values(), *_OWN_WORKERS]
    for worker in workers:
        if worker is not None and worker.owner_pid == os.getpid():
            # a video left open by an abandoned stream holds the lock: stop its helper anyway (at exit, above all)
            locked = worker.lock.acquire(timeout=5)
            try:
                worker.stop()
            finally:
                if locked:
                    worker.lock.release()


atexit.register(shutdown_decoder_process)


def decode_video(
    source: str | os.PathLike,
    sample_indices_fn: Callable[[VideoMetadata], Any] | None = None,
    backend: str = "auto",
    isolate_decoder: bool = True,
    decode_timeout: float | None = 120.0,
    num_threads: int | None = None,
) -> tuple[np.ndarray, VideoMetadata]:
    """Decodes the frames chosen by `sample_indices_fn` from a video file or URL.

    Args:
        source (`str` or `os.PathLike`): path (or `file://`/http(s) URL) of the video.
        sample_indices_fn (`Callable[[VideoMetadata], indices]`, *optional*): receives the video's metadata
            (`total_num_frames`, `fps`, ...) and returns the frame indices to decode (repeats allowed, any order).
            All frames when `None`. It runs in this process (so this process' RNG and seeds apply).
        backend (`str`, defaults to `"auto"`): `"decord"`, `"pyav"`, or `"auto"` (decord when installed, and PyAV if
            decord is missing or fails on this file).
        isolate_decoder (`bool`, defaults to `True`): run the decoder, decord or PyAV alike, in a helper process
            (POSIX only; elsewhere decoding runs in process) so that a decoder crash or hang cannot take down the
            caller. The helper is started once per process and reused for every video.
        decode_timeout (`float`, *optional*, defaults to 120): the stall limit: an isolated decoder that makes no
            progress (opening the file, demuxing, decoding a frame) for this many seconds is killed
            (`VideoDecodingTimeoutError`, saying where it was). A decoder that makes progress is never stopped,
            however long the video. `None` waits forever.
        num_threads (`int`, *optional*): decoder threads; `None` or 0 lets the decoder choose.

    Returns:
        `(frames, metadata)`: `frames` is a uint8 `np.ndarray` `(len(indices), height, width, 3)` in RGB, in the order
        of the indices; `metadata` is a `VideoMetadata` with `frames_indices` set (so `metadata.timestamps` gives the
        sampled times in seconds when the frame rate is known).

    Raises:
        `FileNotFoundError`: the file does not exist (the message gives the path).
        `VideoDecodingError` (a `ValueError`): empty, truncated, corrupt or non-video file, no video stream, no
            decodable frame, or a decoder that crashed in the helper process. The message names the file and gives
            the decoder's reason.
        `VideoDecodingTimeoutError`: the isolated decoder made no progress for `decode_timeout` seconds.
    """
    if backend not in VIDEO_BACKENDS:
        raise ValueError(f"Unknown video_backend={backend!r}; use one of {VIDEO_BACKENDS}.")
    source = check_source(source)
    if sample_indices_fn is None:

        def sample_indices_fn(metadata: VideoMetadata) -> np.ndarray:
            return np.arange(metadata.total_num_frames)

    backends = backends_to_try(backend)
    failures: list[tuple[str, VideoDecodingError]] = []
    for name in backends:
        try:
            check_backend_installed(name)
            with VideoFrames(source, name, isolate_decoder, decode_timeout, num_threads) as video:
                return _sample_and_read(video, sample_indices_fn)
        except VideoDecodingError as exc:
            failures.append((name, exc))
            if len(backends) > 1:
                logger.info("%s could not decode %r (%s); trying the next backend.", name, source, exc.reason)
    raise combined_error(source, failures)


def backends_to_try(backend: str, order: tuple[str, ...] = tuple(DECODERS)) -> list[str]:
    """The decoders `backend` stands for, in the order to try them: ``"auto"`` is those of `order` (of `DECODERS`)
    that are installed (`ImportError` when none is), any other value itself (`ValueError` naming the allowed values for
    an unknown one)."""
    if backend not in VIDEO_BACKENDS:
        raise ValueError(f"Unknown video_backend={backend!r}; use one of {VIDEO_BACKENDS}.")
    if backend != "auto":
        return [backend]
    backends = [name for name in order if decoder_available(name)]
    if not backends:
        raise ImportError("Decoding video files needs " + " or ".join(d.label for d in DECODERS.values())
                          + f": `pip install {' '.join(d.package for d in DECODERS.values())}`.")
    return backends


def check_backend_installed(name: str) -> None:
    """Raises `ImportError` with the install command when the decoder `name` cannot be imported."""
    if not decoder_available(name):
        raise ImportError(f"{DECODERS[name].install_hint()}.")


def combined_error(source: str, failures: list[tuple[str, VideoDecodingError]]) -> VideoDecodingError:
    """The error of a video that every decoder tried failed on (``(decoder, error)`` pairs): the error itself for
    one decoder, else one naming each decoder's reason."""
    if len(failures) == 1:
        return failures[0][1]
    reasons = "; ".join(f"{name}: {exc.reason}" for name, exc in failures)
    error_class = (
        VideoDecodingTimeoutError
        if all(isinstance(exc, VideoDecodingTimeoutError) for _, exc in failures)
        else VideoDecodingError
    )
    error = error_class(source, f"no decoder could read it ({reasons})",
                        code=combined_code([exc.code for _, exc in failures]))
    error.__cause__ = failures[-1][1]
    return error


# When every decoder tried failed, the most specific of their codes names the failure.
_CODE_PRECEDENCE = ("no_frames", "decoder_crash", "empty")


def combined_code(codes: list[str]) -> str:
    """The code of a failure of several decoders: ``"timeout"`` when all timed out, else the first of
    `_CODE_PRECEDENCE` any of them gave, else ``"unreadable"``."""
    if codes and all(code == "timeout" for code in codes):
        return "timeout"
    return next((code for code in _CODE_PRECEDENCE if code in codes), "unreadable")


__all__ = [
    "DECODERS",
    "FRAME_SAMPLING_STRATEGIES",
    "STREAM_ORDER",
    "VIDEO_BACKENDS",
    "DecoderProcess",
    "VideoFrames",
    "backends_to_try",
    "check_backend_installed",
    "check_source",
    "combined_error",
    "format_time",
    "VideoDecodingError",
    "VideoDecodingTimeoutError",
    "check_frame_indices",
    "decode_video",
    "decoder_available",
    "frames_for_fps",
    "isolation_supported",
    "own_decoder_process",
    "sample_frame_indices",
    "shutdown_decoder_process",
]
