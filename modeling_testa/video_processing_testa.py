"""Video processor for TESTA: decoding (decord or PyAV), frame sampling, resizing and CLIP normalisation.

`TestaVideoProcessor` turns video files, decoded arrays/tensors or lists of PIL frames into the `pixel_values` tensor
`(batch, frames, 3, height, width)` that [`TestaVisionModel`] consumes.

Differences from the original TESTA data pipeline (`data/video_dataset.py`), all deliberate:

* `uniform` sampling takes the **midpoint of each of `num_frames` equal segments of the whole video**. The original's
  `np.arange(0, vlen, vlen / N, dtype=int)` is a floor-stride prefix that never reaches the tail of the video, and
  returns frame 0 `N` times for videos shorter than `N` frames. Here, videos shorter than `num_frames` repeat their
  frames evenly and in order.
* Resizing is done by torchvision (bicubic, antialiased) after decoding. `resize_mode="square"` (the default) resizes
  every frame directly to `crop_size`, not keeping the aspect ratio, like the original's
  `decord.VideoReader(path, width=224, height=224)`; `resize_mode="shortest_edge"` keeps the aspect ratio and
  center-crops.
* Rescaling does not depend on the content: integer frames are divided by 255, and float frames are taken to be in
  [0, 1] unless their maximum exceeds 1 (then they are taken to be in [0, 255]). The original divided by 255 only when
  `max > 1`, so an all-dark uint8 clip was left unscaled.

Decoding uses decord by default and PyAV as the fallback. Both are C libraries around FFmpeg: decord has upstream
reports of segmentation faults and aborts on some corrupt files and of endless "rewind" loops, and the PyAV fallback
is typically asked to read the very file that just failed in decord. On POSIX systems **both** backends therefore run
in one long-lived helper process by default (`isolate_decoder=True`; the helper is the sibling module
`video_decoding_worker.py`, run by path), with a time limit per video (`decode_timeout`), so that a crash or a hang in
either decoder raises a `VideoDecodingError` naming the file in the caller instead of killing or blocking it. With
`isolate_decoder=False`, or where no helper process can be started (not POSIX), the same readers run in process.
"""

import atexit
import errno
import logging
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import numpy as np
import PIL.Image
import torch
from huggingface_hub.dataclasses import validate_typed_dict
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling, SizeDict, validate_kwargs
from transformers.processing_utils import Unpack, VideosKwargs
from transformers.video_processing_utils import BaseVideoProcessor
from transformers.video_utils import VideoMetadata

# `from .module import ...` (not `from . import module`): transformers exports the files named this way with the code
from .video_decoding_worker import DecodeFailure, TruncatedVideo, import_av, import_decord, open_reader


try:  # POSIX only; without it the decoders run in process
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


logger = logging.getLogger(__name__)

FRAME_SAMPLING_STRATEGIES = ("uniform", "random", "headtail")
RESIZE_MODES = ("square", "shortest_edge")
VIDEO_BACKENDS = ("auto", "decord", "pyav")
_URL_SCHEMES = ("http://", "https://", "rtsp://", "rtmp://", "ftp://")
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
}


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
    """

    def __init__(self, source: str, reason: str, backend: str | None = None) -> None:
        self.source = str(source)
        self.reason = reason
        self.backend = backend
        via = f" with {backend}" if backend else ""
        super().__init__(f"Could not decode video {self.source!r}{via}: {reason}")


class VideoDecodingTimeoutError(VideoDecodingError, TimeoutError):
    """Decoding took longer than `decode_timeout` seconds; the decoder process was killed."""


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


def _checked_indices(indices: Any, total_num_frames: int, source: str) -> np.ndarray:
    """Validates the output of a frame-sampling function."""
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


def _check_source(source: str | os.PathLike) -> str:
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
        raise VideoDecodingError(source, "the file is empty (0 bytes), so no decoder can read it")
    return source


def decord_available() -> bool:
    """Whether decord can be imported."""
    try:
        import_decord()
    except Exception:  # ImportError, or a broken shared library
        return False
    return True


def pyav_available() -> bool:
    """Whether PyAV (`av`) can be imported."""
    try:
        import_av()
    except Exception:
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


def _finish(
    frames_unique: np.ndarray, inverse: np.ndarray, indices: np.ndarray, metadata: VideoMetadata
) -> tuple[np.ndarray, VideoMetadata]:
    """Expands the decoded unique frames back to the requested (possibly repeated, unsorted) indices."""
    in_order = len(inverse) == len(frames_unique) and np.array_equal(inverse, np.arange(len(inverse)))
    frames = frames_unique if in_order else frames_unique[inverse]
    metadata.frames_indices = [int(i) for i in indices]
    metadata.height, metadata.width = int(frames.shape[1]), int(frames.shape[2])
    return np.ascontiguousarray(frames), metadata


def _sample_and_read(
    source: str,
    backend: str,
    info: dict[str, Any],
    sample_indices_fn: Callable[[VideoMetadata], Any],
    read: Callable[[np.ndarray], np.ndarray],
    close: Callable[[], None],
) -> tuple[np.ndarray, VideoMetadata]:
    """The part of decoding that runs in this process, whichever process runs the decoder.

    Builds the metadata from the opened video's `info`, samples the indices here (this process' RNG), and reads the
    frames with `read`. A PyAV file that turns out truncated (`TruncatedVideo`: fewer frames than declared) is sampled
    again over the frames that are really there. `close` releases the opened video when no read follows.
    """
    total, fps = int(info["total_num_frames"]), info["fps"]
    metadata = VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=info.get("width"),
        height=info.get("height"),
        duration=total / fps if fps else None,
        video_backend=backend,
    )
    if total <= 0:
        close()
        what = "no decodable frames" if backend == "decord" else "no frames"
        raise VideoDecodingError(source, f"the video stream contains {what}", backend)
    try:
        indices = _checked_indices(sample_indices_fn(metadata), total, source)
    except BaseException:
        close()
        raise
    unique, inverse = np.unique(indices, return_inverse=True)
    try:
        frames = read(unique)
    except TruncatedVideo as exc:
        logger.warning(
            "Only %d of the %d frames declared by %r could be decoded%s; sampling from those.",
            exc.decoded, total, source, f" (FFmpeg: {exc.error})" if exc.error else "",
        )
        metadata.total_num_frames = exc.decoded
        metadata.duration = exc.decoded / fps if fps else None
        try:
            indices = _checked_indices(sample_indices_fn(metadata), exc.decoded, source)
        except BaseException:
            close()
            raise
        unique, inverse = np.unique(indices, return_inverse=True)
        frames = read(unique)
    return _finish(frames, inverse, indices, metadata)


def _decode_in_process(
    source: str, backend: str, sample_indices_fn: Callable[[VideoMetadata], Any], num_threads: int | None
) -> tuple[np.ndarray, VideoMetadata]:
    """Decodes in this process (no protection against decoder crashes or hangs); decoder errors name the file."""

    def call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (ImportError, TruncatedVideo):
            raise
        except DecodeFailure as exc:
            raise VideoDecodingError(source, str(exc), backend) from exc
        except Exception as exc:  # DECORDError, av.FFmpegError, RuntimeError, ...
            raise VideoDecodingError(source, _clean_decoder_message(exc), backend) from exc

    reader = call(open_reader, backend, source, num_threads)
    return _sample_and_read(
        source, backend, reader.metadata, sample_indices_fn, lambda unique: call(reader.read, unique), lambda: None
    )


# --- the decoder helper process ---------------------------------------------------------------------------------------
#
# Both backends run in a long-lived helper process (`python video_decoding_worker.py`, a sibling module run by path,
# which imports only numpy and the decoder libraries) that talks to this process over pipes with length-prefixed
# pickles. If a decoder crashes (segfault, C++ abort) or hangs, only the helper dies or is killed; the caller gets a
# `VideoDecodingError` and the next call starts a new helper. Starting the helper costs ~0.2 s once per process; each
# video then costs only the pipe transfer of its frames.

_WORKER_SCRIPT = os.path.abspath(sys.modules[open_reader.__module__].__file__)
"""The helper's script (the `video_decoding_worker.py` next to this file, also in an exported Hub folder)."""


class _WorkerGone(Exception):
    """The decoder process closed its pipe (it exited or crashed)."""


def _read_into(fd: int, view: memoryview, deadline: float | None) -> None:
    """Fills `view` from `fd`; raises `_WorkerGone` on EOF and `TimeoutError` once `deadline` has passed."""
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(remaining, 0.0))[0] if remaining > 0 else []
            if not ready:
                raise TimeoutError
        n = os.readv(fd, [view])
        if n == 0:
            raise _WorkerGone
        view = view[n:]


def isolation_supported() -> bool:
    """Whether decoders can run in a helper process here (POSIX: needs `select` on pipes and a Python executable)."""
    return os.name == "posix" and fcntl is not None and bool(sys.executable) and os.path.isfile(_WORKER_SCRIPT)


class _DecoderWorker:
    """A helper process that decodes with decord or PyAV; one per Python process (re-created after `fork`),
    thread-safe (one video at a time)."""

    _LOG_LIMIT = 1 << 20  # truncate the captured decoder log beyond 1 MiB

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner_pid = os.getpid()
        self.process: subprocess.Popen | None = None
        self.log = None
        self.busy = False  # a request was sent and its reply not fully read: the protocol state is unknown

    # process management
    def _start(self, deadline: float | None) -> None:
        self.log = tempfile.TemporaryFile()
        flags = fcntl.fcntl(self.log.fileno(), fcntl.F_GETFL)
        fcntl.fcntl(self.log.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)  # the worker appends; we pread
        self.busy = False
        self.process = subprocess.Popen(
            [sys.executable, _WORKER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            bufsize=0,
            close_fds=True,
            start_new_session=True,  # Ctrl-C in a terminal goes to the caller only
        )
        message = self._receive(deadline)
        if message[0] != "ready":
            raise OSError(f"{message[1]}: {message[2]}")

    def stop(self) -> None:
        """Kills the helper process (if any) and forgets it."""
        process, self.process = self.process, None
        if process is not None:
            try:
                process.kill()
                process.wait(timeout=10)
            except Exception:
                pass
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except Exception:
                    pass
        if self.log is not None:
            self.log.close()
            self.log = None

    def _exit_description(self, backend: str) -> str:
        process = self.process
        try:
            code = process.wait(timeout=5)
        except Exception:
            return "the decoder process stopped responding"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the {backend} decoder crashed ({name})"
        return f"the decoder process exited unexpectedly (exit code {code})"

    # protocol
    def _send(self, obj: Any) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(struct.pack("<Q", len(payload)) + payload)
        fd = self.process.stdin.fileno()
        while data:
            data = data[os.write(fd, data):]

    def _receive(self, deadline: float | None) -> Any:
        fd = self.process.stdout.fileno()
        header = bytearray(8)
        _read_into(fd, memoryview(header), deadline)
        payload = bytearray(struct.unpack("<Q", header)[0])
        _read_into(fd, memoryview(payload), deadline)
        return pickle.loads(payload)

    def _log_size(self) -> int:
        size = os.fstat(self.log.fileno()).st_size
        if size > self._LOG_LIMIT:
            os.ftruncate(self.log.fileno(), 0)
            size = 0
        return size

    def _log_since(self, offset: int, max_lines: int = 3) -> str:
        try:
            size = os.fstat(self.log.fileno()).st_size
            text = os.pread(self.log.fileno(), max(size - offset, 0), offset).decode("utf-8", "replace")
        except Exception:
            return ""
        lines = [_FFMPEG_ADDRESS.sub("]", _DECORD_PREFIX.sub("", line.strip())) for line in text.splitlines()]
        return " | ".join([line for line in lines if line][-max_lines:])

    def _error(self, source: str, backend: str, message: tuple, log_offset: int) -> VideoDecodingError:
        _, kind, text, final = message
        reason = text if final else _clean_decoder_message(text)
        if kind == "ImportError":
            reason = f"the decoder process cannot import it: {reason}"
        tail = self._log_since(log_offset)
        if tail and tail not in reason:
            reason = f"{reason} (decoder log: {tail})"
        return VideoDecodingError(source, reason, backend)

    def decode(
        self,
        backend: str,
        source: str,
        sample_indices_fn: Callable[[VideoMetadata], Any],
        num_threads: int | None,
        timeout: float | None,
    ) -> tuple[np.ndarray, VideoMetadata]:
        """Opens `source` in the helper, samples indices here (this process' RNG), decodes them there."""
        with self.lock:
            deadline = time.monotonic() + timeout if timeout else None
            if self.process is None or self.process.poll() is not None or self.busy:
                self.stop()
                try:
                    self._start(deadline)
                except (_WorkerGone, TimeoutError, OSError, ValueError, pickle.UnpicklingError) as exc:
                    if self.process is not None and isinstance(exc, _WorkerGone):
                        description = self._exit_description(backend)
                    else:
                        description = str(exc) or type(exc).__name__
                    tail = self._log_since(0) if self.log is not None else ""
                    description += f"; decoder log: {tail}" if tail else ""
                    self.stop()
                    raise VideoDecodingError(
                        source, f"could not start the decoder process: {description}", backend
                    ) from None
            log_offset = self._log_size()

            def request(obj: tuple) -> tuple:
                self.busy = True
                self._send(obj)
                message = self._receive(deadline)
                if message[0] == "frames":
                    frames = np.empty(message[1], dtype=np.dtype(message[2]))
                    _read_into(self.process.stdout.fileno(), memoryview(frames).cast("B"), deadline)
                    message = (message[0], frames)
                self.busy = False
                if message[0] == "error":
                    raise self._error(source, backend, message, log_offset)
                return message

            def read(unique: np.ndarray) -> np.ndarray:
                message = request(("read", [int(i) for i in unique]))
                if message[0] == "truncated":
                    raise TruncatedVideo(message[1], message[2])
                return message[1]

            try:
                info = request(("open", backend, source, int(num_threads or 0)))[1]
                return _sample_and_read(source, backend, info, sample_indices_fn, read, lambda: request(("close",)))
            except VideoDecodingError:
                raise
            except (_WorkerGone, BrokenPipeError):
                description = self._exit_description(backend)
                tail = self._log_since(log_offset)
                self.stop()
                raise VideoDecodingError(
                    source, description + (f"; decoder log: {tail}" if tail else ""), backend
                ) from None
            except TimeoutError:
                self.stop()
                raise VideoDecodingTimeoutError(
                    source, f"decoding took longer than decode_timeout={timeout} s; the decoder process was killed",
                    backend,
                ) from None
            except BaseException:
                if self.busy:  # e.g. KeyboardInterrupt mid-request: the protocol state is unknown
                    self.stop()
                raise


_WORKER: _DecoderWorker | None = None
_WORKER_LOCK = threading.Lock()
_THREAD_WORKER = threading.local()
_OWN_WORKERS: "weakref.WeakSet[_DecoderWorker]" = weakref.WeakSet()


def own_decoder_process() -> _DecoderWorker:
    """Gives the calling thread a decoder helper process of its own, so that several threads decode in parallel
    (by default every thread of a process shares one helper, which decodes one video at a time). The helper starts at
    the thread's first isolated decode. Returns it: call its `stop()` when the thread is done decoding."""
    worker = _DecoderWorker()
    _THREAD_WORKER.worker = worker
    with _WORKER_LOCK:
        _OWN_WORKERS.add(worker)
    return worker


def _decoder_worker() -> _DecoderWorker:
    """The calling thread's own decoder helper (`own_decoder_process`), else this process' shared one (a new one
    after `fork`, e.g. in DataLoader workers)."""
    global _WORKER
    own = getattr(_THREAD_WORKER, "worker", None)
    if own is not None and own.owner_pid == os.getpid():
        return own
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.owner_pid != os.getpid():
            _WORKER = _DecoderWorker()
        return _WORKER


def shutdown_decoder_process() -> None:
    """Stops this process' decoder helper processes (the shared one and the threads' own ones, see
    `own_decoder_process`), if running (the shared one is restarted on demand)."""
    with _WORKER_LOCK:
        workers = [_WORKER, *_OWN_WORKERS]
    for worker in workers:
        if worker is not None and worker.owner_pid == os.getpid():
            with worker.lock:
                worker.stop()


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
        decode_timeout (`float`, *optional*, defaults to 120): seconds after which an isolated decode is killed
            (`VideoDecodingTimeoutError`); with `"auto"`, each backend tried gets this long. `None` waits forever.
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
        `VideoDecodingTimeoutError`: the isolated decoder exceeded `decode_timeout`.
    """
    if backend not in VIDEO_BACKENDS:
        raise ValueError(f"Unknown video_backend={backend!r}; use one of {VIDEO_BACKENDS}.")
    source = _check_source(source)
    if sample_indices_fn is None:

        def sample_indices_fn(metadata: VideoMetadata) -> np.ndarray:
            return np.arange(metadata.total_num_frames)

    if backend == "auto":
        backends = [b for b, ok in (("decord", decord_available()), ("pyav", pyav_available())) if ok]
        if not backends:
            raise ImportError("Decoding video files needs decord or PyAV: `pip install decord av`.")
    else:
        backends = [backend]

    isolate = isolate_decoder and isolation_supported()
    failures: list[tuple[str, VideoDecodingError]] = []
    for name in backends:
        try:
            if name == "decord" and not decord_available():
                raise ImportError("video_backend='decord' needs decord: `pip install decord`.")
            if name == "pyav" and not pyav_available():
                raise ImportError("video_backend='pyav' needs PyAV: `pip install av`.")
            if isolate:
                return _decoder_worker().decode(name, source, sample_indices_fn, num_threads, decode_timeout)
            return _decode_in_process(source, name, sample_indices_fn, num_threads)
        except VideoDecodingError as exc:
            failures.append((name, exc))
            if len(backends) > 1:
                logger.info("%s could not decode %r (%s); trying the next backend.", name, source, exc.reason)
    if len(failures) == 1:
        raise failures[0][1]
    reasons = "; ".join(f"{name}: {exc.reason}" for name, exc in failures)
    error_class = (
        VideoDecodingTimeoutError
        if all(isinstance(exc, VideoDecodingTimeoutError) for _, exc in failures)
        else VideoDecodingError
    )
    raise error_class(source, f"no decoder could read it ({reasons})") from failures[-1][1]


# ----------------------------------------------------------------------------------------------------------------------
# Array / frame-list inputs
# ----------------------------------------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, torch.Tensor))


def _is_frame(x: Any) -> bool:
    return isinstance(x, PIL.Image.Image) or (_is_array(x) and x.ndim in (2, 3))


def _flatten_video_inputs(videos: Any) -> list[tuple[str, Any]]:
    """Splits the accepted input layouts into a list of (label, video) pairs, one per video.

    A video is a path (str / PathLike), a 4-D array or tensor, or a list of frames (PIL images, or 2-D/3-D arrays).
    A batch is a list of videos or a 5-D array/tensor.
    """
    if videos is None:
        raise ValueError(
            "`videos` is None; pass a video path, a 4-D array/tensor, a list of frames, or a list of those."
        )
    if isinstance(videos, (str, os.PathLike)):
        return [(os.fspath(videos), videos)]
    if _is_array(videos):
        if videos.ndim == 5:
            if videos.shape[0] == 0:
                raise ValueError(f"`videos` is an empty batch (shape {tuple(videos.shape)}).")
            return [(f"videos[{i}]", v) for i, v in enumerate(videos)]
        if videos.ndim == 4:
            return [("videos", videos)]
        raise ValueError(
            f"`videos` is an array with {videos.ndim} dimensions (shape {tuple(videos.shape)}); a video must have 4 "
            "(frames, height, width, channels) or (frames, channels, height, width), and a batch 5. For a single "
            "frame pass `[frame]` or `frame[None]`."
        )
    if isinstance(videos, PIL.Image.Image):
        raise ValueError("`videos` is a single PIL image; pass a list of frames (`[image]`) for a one-frame video.")
    if not isinstance(videos, (list, tuple)):
        raise TypeError(f"`videos` has unsupported type {type(videos).__name__}.")
    if len(videos) == 0:
        raise ValueError("`videos` is an empty list; pass at least one video.")
    if all(_is_frame(x) for x in videos):
        return [("videos", list(videos))]

    flat = []
    for i, video in enumerate(videos):
        label = f"videos[{i}]"
        if isinstance(video, (str, os.PathLike)):
            flat.append((os.fspath(video), video))
        elif _is_array(video):
            if video.ndim != 4:
                raise ValueError(
                    f"{label} is an array with {video.ndim} dimensions (shape {tuple(video.shape)}); each video in a "
                    "batch must be 4-D: (frames, height, width, channels) or (frames, channels, height, width)."
                )
            flat.append((label, video))
        elif isinstance(video, (list, tuple)):
            if len(video) == 0:
                raise ValueError(f"{label} is an empty list of frames.")
            bad = [j for j, frame in enumerate(video) if not _is_frame(frame)]
            if bad:
                frame = video[bad[0]]
                what = f"an array of shape {tuple(frame.shape)}" if _is_array(frame) else type(frame).__name__
                raise ValueError(
                    f"{label}[{bad[0]}] is {what}; a frame must be a PIL image or a 2-D/3-D array "
                    "(height, width[, channels]) or (channels, height, width)."
                )
            flat.append((label, list(video)))
        elif isinstance(video, PIL.Image.Image):
            raise ValueError(
                f"{label} is a single PIL image inside a batch of videos; pass each video as a list of frames."
            )
        else:
            raise TypeError(f"{label} has unsupported type {type(video).__name__}.")
    return flat


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


def _video_to_tensor(label: str, video: Any, input_data_format: Any) -> torch.Tensor:
    """Converts a 4-D array/tensor or a list of frames to a (T, C, H, W) tensor, validating its layout."""
    if isinstance(video, list):
        if all(isinstance(frame, PIL.Image.Image) for frame in video):
            arrays = [np.asarray(frame.convert("RGB")) for frame in video]
        elif any(isinstance(frame, PIL.Image.Image) for frame in video):
            raise ValueError(f"{label} mixes PIL images and arrays; use one kind of frame per video.")
        else:
            arrays = [
                frame.detach().cpu().numpy() if isinstance(frame, torch.Tensor) else np.asarray(frame) for frame in video
            ]
            arrays = [a[..., None] if a.ndim == 2 else a for a in arrays]
        shapes = {a.shape for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"{label}: all frames must have the same shape, got {sorted(shapes)}.")
        video = np.stack(arrays)
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
        raise ValueError(f"{label} must be 4-D (frames, height, width, channels), got shape {tuple(video.shape)}.")
    shape = tuple(video.shape)
    if shape[0] == 0:
        raise ValueError(f"{label} has 0 frames (shape {shape}).")
    axis = _channel_axis(shape, label, input_data_format)
    if axis == "last":
        video = video.permute(0, 3, 1, 2)
    if video.shape[-1] == 0 or video.shape[-2] == 0:
        raise ValueError(f"{label} has empty frames (shape {shape}).")
    return video


# ----------------------------------------------------------------------------------------------------------------------
# The video processor
# ----------------------------------------------------------------------------------------------------------------------


class TestaVideoProcessorKwargs(VideosKwargs, total=False):
    """TESTA-specific video-processing keyword arguments (on top of `transformers.processing_utils.VideosKwargs`).

    frame_sampling (`str`): `"uniform"` (evaluation), `"random"` (training) or `"headtail"` (pretraining).
    resize_mode (`str`): `"square"` (resize straight to `crop_size`, like the original) or `"shortest_edge"` (resize
        the shortest edge to `size["shortest_edge"]`, keep the aspect ratio, center-crop to `crop_size`).
    video_backend (`str`): `"auto"`, `"decord"` or `"pyav"`.
    seed (`int`): seed for `"random"`/`"headtail"` sampling in this call; the global torch RNG when unset.
    dtype (`str` or `torch.dtype`): dtype of `pixel_values` (`"float32"`, `"bfloat16"`, `"float16"`, ...).
    isolate_decoder (`bool`): decode (decord or PyAV) in a crash-isolated helper process (POSIX).
    decode_timeout (`float`): seconds before an isolated decode is killed; `None` for no limit.
    decode_threads (`int`): decoder threads per video; `None`/0 lets the decoder choose.
    """

    frame_sampling: Literal["uniform", "random", "headtail"]
    resize_mode: Literal["square", "shortest_edge"]
    video_backend: Literal["auto", "decord", "pyav"]
    seed: int | None
    dtype: str | torch.dtype | None
    isolate_decoder: bool | None
    decode_timeout: int | float | None
    decode_threads: int | None


class TestaVideoProcessor(BaseVideoProcessor):
    r"""
    Video processor for TESTA: decodes videos, samples `num_frames` frames, resizes, rescales and normalises them.

    Inputs accepted by `__call__` (`videos=`): a path (`str` or `pathlib.Path`, also `file://` and http(s) URLs,
    which the decoders open directly); a decoded video as a 4-D `np.ndarray`/`torch.Tensor`, `(frames, height, width,
    channels)` or `(frames, channels, height, width)`, uint8 in [0, 255] or float; a list of frames (PIL images or
    2-D/3-D arrays); or a batch: a list of any of these, or a 5-D array/tensor. Grayscale (1 channel) and RGBA
    (4 channels; alpha dropped) frames are converted to RGB.

    Output: `BatchFeature` with `pixel_values` of shape `(batch, num_frames, 3, crop_size["height"],
    crop_size["width"])` in `dtype` (float32 by default); with `return_metadata=True` also `video_metadata`, one
    `VideoMetadata` per video whose `frames_indices` are the sampled frame indices and `timestamps` the matching times
    in seconds (when the frame rate is known; give it for arrays through `video_metadata=[{"fps": ...}]`).

    Args:
        num_frames (`int`, defaults to 32): frames per video.
        frame_sampling (`str`, defaults to `"uniform"`): see [`sample_frame_indices`].
        do_sample_frames (`bool`, defaults to `True`): sample `num_frames` frames; when `False`, all frames of a file
            are decoded and arrays are used as given.
        seed (`int`, *optional*): makes `"random"`/`"headtail"` sampling reproducible per call.
        resize_mode (`str`, defaults to `"square"`): `"square"` resizes every frame straight to `crop_size` (aspect
            ratio not kept, no crop), as the original TESTA data pipeline did; `"shortest_edge"` resizes the shortest
            edge to `size["shortest_edge"]` and center-crops to `crop_size`.
        size (`dict`, defaults to `{"shortest_edge": 224}`), crop_size (`dict`, defaults to
            `{"height": 224, "width": 224}`): see `resize_mode`.
        resample (defaults to `PILImageResampling.BICUBIC`): interpolation (antialiased).
        do_rescale (`bool`, defaults to `True`), rescale_factor (`float`, defaults to 1/255): integer frames are
            multiplied by `rescale_factor`; float frames are assumed to be in [0, 1] already unless their maximum is
            above 1.
        do_normalize (`bool`, defaults to `True`), image_mean / image_std (default: OpenAI CLIP mean and std).
        dtype (`str`, defaults to `"float32"`): dtype of `pixel_values`.
        video_backend (`str`, defaults to `"auto"`): `"decord"`, `"pyav"` or `"auto"` (decord when installed, PyAV
            when decord is missing or fails on a file).
        isolate_decoder (`bool`, defaults to `True`), decode_timeout (`float`, defaults to 120), decode_threads
            (`int`, *optional*): see [`decode_video`].
    """

    resample = PILImageResampling.BICUBIC
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    size = {"shortest_edge": 224}
    crop_size = {"height": 224, "width": 224}
    default_to_square = False
    do_resize = True
    do_center_crop = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    do_sample_frames = True
    num_frames = 32
    return_metadata = False
    return_tensors = "pt"
    frame_sampling = "uniform"
    resize_mode = "square"
    video_backend = "auto"
    seed = None
    dtype = "float32"
    isolate_decoder = True
    decode_timeout = 120.0
    decode_threads = None
    valid_kwargs = TestaVideoProcessorKwargs
    model_input_names = ["pixel_values"]

    def __init__(self, **kwargs: Unpack[TestaVideoProcessorKwargs]) -> None:
        if isinstance(kwargs.get("dtype"), torch.dtype):
            kwargs["dtype"] = _dtype_name(kwargs["dtype"])
        super().__init__(**kwargs)
        self._check_options(
            frame_sampling=self.frame_sampling,
            resize_mode=self.resize_mode,
            video_backend=self.video_backend,
            num_frames=self.num_frames,
            dtype=self.dtype,
        )

    # -- options ------------------------------------------------------------------------------------------------------

    @staticmethod
    def _check_options(
        frame_sampling: str | None = None,
        resize_mode: str | None = None,
        video_backend: str | None = None,
        num_frames: int | None = None,
        dtype: Any = None,
        fps: float | None = None,
        **_: Any,
    ) -> None:
        if frame_sampling is not None and frame_sampling not in FRAME_SAMPLING_STRATEGIES:
            raise ValueError(f"Unknown frame_sampling={frame_sampling!r}; use one of {FRAME_SAMPLING_STRATEGIES}.")
        if resize_mode is not None and resize_mode not in RESIZE_MODES:
            raise ValueError(f"Unknown resize_mode={resize_mode!r}; use one of {RESIZE_MODES}.")
        if video_backend is not None and video_backend not in VIDEO_BACKENDS:
            raise ValueError(f"Unknown video_backend={video_backend!r}; use one of {VIDEO_BACKENDS}.")
        if num_frames is not None and (isinstance(num_frames, bool) or int(num_frames) < 1):
            raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
        if dtype is not None:
            _resolve_dtype(dtype)
        if fps is not None:
            raise ValueError(
                "TestaVideoProcessor samples a fixed number of frames per video (`num_frames`); sampling by `fps` is "
                "not supported."
            )

    def sample_frames(
        self,
        metadata: VideoMetadata,
        num_frames: int | None = None,
        fps: int | float | None = None,
        frame_sampling: str | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """Frame indices for one video, using [`sample_frame_indices`] with this processor's settings.

        Args:
            metadata (`VideoMetadata`): needs `total_num_frames`.
            num_frames (`int`, *optional*): defaults to `self.num_frames`.
            fps: not supported (raises `ValueError` when set).
            frame_sampling (`str`, *optional*): defaults to `self.frame_sampling`.
            generator (`torch.Generator`, *optional*): random source for random strategies.
        """
        self._check_options(fps=fps)
        num_frames = self.num_frames if num_frames is None else num_frames
        strategy = self.frame_sampling if frame_sampling is None else frame_sampling
        return sample_frame_indices(metadata.total_num_frames, num_frames, strategy, generator)

    # -- decoding -----------------------------------------------------------------------------------------------------

    def fetch_videos(
        self,
        video_url_or_urls: str | os.PathLike | list,
        sample_indices_fn: Callable[..., Any] | None = None,
        video_backend: str | None = None,
        isolate_decoder: bool | None = None,
        decode_timeout: float | None = None,
        decode_threads: int | None = None,
    ) -> tuple[Any, Any]:
        """Decodes one path/URL, or a (nested) list of them, with decord or PyAV instead of the base class' torchcodec.

        Args:
            video_url_or_urls: a path or URL, or a list of them.
            sample_indices_fn (`Callable`, *optional*): called as `sample_indices_fn(metadata=VideoMetadata)`; returns
                the frame indices to decode. All frames when `None`.
            video_backend, isolate_decoder, decode_timeout, decode_threads: default to this processor's settings.

        Returns:
            For one source, `(frames, metadata)` with `frames` a uint8 `(T, H, W, 3)` array; for a list, a pair
            `(list_of_frames, list_of_metadata)`.
        """
        if isinstance(video_url_or_urls, (list, tuple)):
            results = [
                self.fetch_videos(
                    item,
                    sample_indices_fn=sample_indices_fn,
                    video_backend=video_backend,
                    isolate_decoder=isolate_decoder,
                    decode_timeout=decode_timeout,
                    decode_threads=decode_threads,
                )
                for item in video_url_or_urls
            ]
            return [r[0] for r in results], [r[1] for r in results]
        fn = None if sample_indices_fn is None else (lambda metadata: sample_indices_fn(metadata=metadata))
        return decode_video(
            video_url_or_urls,
            sample_indices_fn=fn,
            backend=self.video_backend if video_backend is None else video_backend,
            isolate_decoder=self.isolate_decoder if isolate_decoder is None else isolate_decoder,
            decode_timeout=self.decode_timeout if decode_timeout is None else decode_timeout,
            num_threads=self.decode_threads if decode_threads is None else decode_threads,
        )

    # -- main entry point ---------------------------------------------------------------------------------------------

    def preprocess(self, videos: Any, **kwargs: Unpack[TestaVideoProcessorKwargs]) -> BatchFeature:
        """Decodes (if needed), samples, resizes, rescales and normalises a video or a batch of videos.

        See the class docstring for the accepted inputs and the output. Every setting can be overridden per call,
        e.g. `processor(videos, num_frames=8, frame_sampling="random", seed=0)`.
        """
        validate_kwargs(captured_kwargs=kwargs.keys(), valid_processor_keys=list(self.valid_kwargs.__annotations__))
        self._check_options(**kwargs)  # clear ValueErrors for bad choices before the generic type validation
        validate_typed_dict(self.valid_kwargs, kwargs)
        for name in self.valid_kwargs.__annotations__:
            kwargs.setdefault(name, getattr(self, name, None))
        self._check_options(**kwargs)
        out_dtype = _resolve_dtype(kwargs["dtype"])

        items = _flatten_video_inputs(videos)
        metadata_in = _metadata_per_video(kwargs["video_metadata"], len(items))
        generator = torch.Generator().manual_seed(int(kwargs["seed"])) if kwargs["seed"] is not None else None
        sample_fn = None
        if kwargs["do_sample_frames"]:
            sample_fn = partial(
                self.sample_frames,
                num_frames=kwargs["num_frames"],
                frame_sampling=kwargs["frame_sampling"],
                generator=generator,
            )

        clips: list[torch.Tensor] = []
        metadata_out: list[VideoMetadata] = []
        for (label, video), given_metadata in zip(items, metadata_in):
            if isinstance(video, (str, os.PathLike)):
                frames, metadata = self.fetch_videos(
                    video,
                    sample_indices_fn=sample_fn,
                    video_backend=kwargs["video_backend"],
                    isolate_decoder=kwargs["isolate_decoder"],
                    decode_timeout=kwargs["decode_timeout"],
                    decode_threads=kwargs["decode_threads"],
                )
                clip = torch.from_numpy(frames).permute(0, 3, 1, 2)
            else:
                clip = _video_to_tensor(label, video, kwargs["input_data_format"])
                metadata = VideoMetadata(
                    total_num_frames=int(clip.shape[0]),
                    height=int(clip.shape[-2]),
                    width=int(clip.shape[-1]),
                )
                if given_metadata:
                    metadata.update({k: v for k, v in given_metadata.items() if k != "total_num_frames"})
                if metadata.fps and metadata.duration is None:
                    metadata.duration = metadata.total_num_frames / metadata.fps
                if sample_fn is not None:
                    indices = _checked_indices(sample_fn(metadata=metadata), metadata.total_num_frames, label)
                    clip = clip[torch.from_numpy(indices)]
                else:
                    indices = np.arange(metadata.total_num_frames)
                metadata.frames_indices = [int(i) for i in indices]
            clip = _to_rgb(clip, label, kwargs["do_convert_rgb"])
            if kwargs["device"] is not None:
                clip = clip.to(kwargs["device"])
            clips.append(clip)
            metadata_out.append(metadata)

        std_kwargs = self._standardize_kwargs(
            size=kwargs["size"],
            crop_size=kwargs["crop_size"],
            default_to_square=kwargs["default_to_square"],
            image_mean=kwargs["image_mean"],
            image_std=kwargs["image_std"],
        )
        settings = {k: kwargs[k] for k in ("do_resize", "resample", "do_center_crop", "do_rescale", "rescale_factor",
                                           "do_normalize", "resize_mode")}
        settings.update({k: std_kwargs[k] for k in ("size", "crop_size", "image_mean", "image_std")})
        self._validate_preprocess_kwargs(**{k: v for k, v in settings.items() if k != "resize_mode"})

        pixel_values = [self._transform(clip, **settings).to(out_dtype) for clip in clips]
        return_tensors = kwargs["return_tensors"]
        if return_tensors is not None:
            shapes = {tuple(p.shape) for p in pixel_values}
            if len(shapes) != 1:
                raise ValueError(
                    f"Cannot stack videos of different shapes {sorted(shapes)} into one tensor; keep "
                    "do_sample_frames=True and resize to a fixed crop_size, or pass return_tensors=None for a list."
                )
            stacked = torch.stack(pixel_values)
            data = {"pixel_values": stacked.numpy() if str(return_tensors) in ("np", "TensorType.NUMPY") else stacked}
        else:
            data = {"pixel_values": pixel_values}
        output = BatchFeature(data=data)
        if kwargs["return_metadata"]:
            output["video_metadata"] = metadata_out
        return output

    def _transform(
        self,
        video: torch.Tensor,
        do_resize: bool,
        size: SizeDict,
        resample: Any,
        resize_mode: str,
        do_center_crop: bool,
        crop_size: SizeDict,
        do_rescale: bool,
        rescale_factor: float,
        do_normalize: bool,
        image_mean: Any,
        image_std: Any,
    ) -> torch.Tensor:
        """Resize (+ crop), rescale and normalise one (T, 3, H, W) clip; returns float32."""
        rescale = do_rescale
        if video.is_floating_point():
            video = video.float()
            if do_rescale and float(video.max()) <= 1.0:
                rescale = False  # float frames already in [0, 1]
        if do_resize:
            if resize_mode == "square":
                video = self.resize(video, SizeDict(height=crop_size.height, width=crop_size.width), resample=resample)
            else:
                video = self.resize(video, size, resample=resample)
        if do_center_crop and resize_mode == "shortest_edge":
            video = self.center_crop(video, crop_size)
        if rescale or do_normalize:
            video = self.rescale_and_normalize(video, rescale, rescale_factor, do_normalize, image_mean, image_std)
        return video.float()

    def to_dict(self) -> dict[str, Any]:
        """Serialisable settings (written to `video_preprocessor_config.json`)."""
        output = super().to_dict()
        if isinstance(output.get("dtype"), torch.dtype):
            output["dtype"] = _dtype_name(output["dtype"])
        return output


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":  # "auto": what `pipeline()` / `from_pretrained` pass for the model's dtype
        return torch.float32
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"Unsupported dtype={dtype!r} for pixel_values; use one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


def _metadata_per_video(video_metadata: Any, count: int) -> list[dict[str, Any] | None]:
    """Normalises the optional `video_metadata` argument (for array inputs) to one dict (or None) per video."""
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


def _to_rgb(clip: torch.Tensor, label: str, do_convert_rgb: bool | None) -> torch.Tensor:
    """(T, C, H, W) with C in {1, 3, 4} -> (T, 3, H, W): grayscale is repeated, alpha dropped."""
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


TestaVideoProcessor.register_for_auto_class()

__all__ = [
    "TestaVideoProcessor",
    "TestaVideoProcessorKwargs",
    "VideoDecodingError",
    "VideoDecodingTimeoutError",
    "decode_video",
    "sample_frame_indices",
]
