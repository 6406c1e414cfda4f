"""Video decoding: `decode_video` (decord or PyAV, isolated in a helper process), frame sampling and its errors.

* `sample_frame_indices` chooses which frames to decode (uniform segment midpoints, random per segment, head/tail),
  and `frames_for_fps` how many frames a frame rate asks for.
* `decode_video` opens a file or URL, lets a caller's function choose the frame indices from the video's metadata, and
  decodes them with decord or PyAV (`backend="auto"`: decord, then PyAV if decord is missing or fails on the file).
* `VideoDecodingError` (a `ValueError`) and `VideoDecodingTimeoutError` name the file and give the decoder's reason.

Decord and PyAV are C libraries around FFmpeg: decord has upstream reports of segmentation faults and aborts on some
corrupt files and of endless "rewind" loops, and the PyAV fallback is typically asked to read the very file that just
failed in decord. On POSIX systems **both** backends therefore run in one long-lived helper process by default
(`isolate_decoder=True`; the helper is the sibling script `video_decoding_worker.py`, run by path), with a time limit
per video (`decode_timeout`), so that a crash or a hang in either decoder raises a `VideoDecodingError` naming the file
in the caller instead of killing or blocking it. With `isolate_decoder=False`, or where no helper process can be
started (not POSIX), the same readers run in process. `own_decoder_process` gives a thread a helper of its own (parallel
decoding); `shutdown_decoder_process` stops the helpers.

This file is Hub remote code (exported with `video_processing_testa.py`): sibling-relative imports only.
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
from typing import Any

import numpy as np
import torch
from transformers.video_utils import VideoMetadata

# `from .module import ...` (not `from . import module`): transformers exports the files named this way with the code
from .video_decoding_worker import DecodeFailure, TruncatedVideo, import_av, import_decord, open_reader


try:  # POSIX only; without it the decoders run in process
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


logger = logging.getLogger(__name__)

FRAME_SAMPLING_STRATEGIES = ("uniform", "random", "headtail")
"""The frame-sampling strategies of `sample_frame_indices`."""

VIDEO_BACKENDS = ("auto", "decord", "pyav")
"""The values of `decode_video(backend=...)`."""

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
        code (`str`): why, as a stable word set where the error is raised (`indexing.FAILURE_CODES`): `"empty"`,
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
    """Decoding took longer than `decode_timeout` seconds; the decoder process was killed."""

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
        raise VideoDecodingError(source, "the file is empty (0 bytes), so no decoder can read it", code="empty")
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
        raise VideoDecodingError(source, f"the video stream contains {what}", backend, code="no_frames")
    try:
        indices = check_frame_indices(sample_indices_fn(metadata), total, source)
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
            indices = check_frame_indices(sample_indices_fn(metadata), exc.decoded, source)
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
            raise VideoDecodingError(source, str(exc), backend, code=exc.code) from exc
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


class DecoderProcess:
    """The client side of one decoder helper process (`video_decoding_worker.py`), which decodes with decord or PyAV.

    By default every thread of a Python process shares one (re-created after `fork`); `own_decoder_process` gives a
    thread one of its own. Thread-safe: one video at a time. The helper starts at the first `decode` and is started
    again after a crash, a hang or `stop()`.
    """

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
            # Run by path, the script's folder (this package, or a Hub code folder) would come first on the helper's
            # import path, where a sibling file could shadow a module that numpy, decord or PyAV import; Python 3.11+
            # leaves it out with PYTHONSAFEPATH.
            env={**os.environ, "PYTHONSAFEPATH": "1"},
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
        _, kind, text, final, code = message
        reason = text if final else _clean_decoder_message(text)
        if kind == "ImportError":
            reason = f"the decoder process cannot import it: {reason}"
        tail = self._log_since(log_offset)
        if tail and tail not in reason:
            reason = f"{reason} (decoder log: {tail})"
        return VideoDecodingError(source, reason, backend, code=code)

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
                        source, f"could not start the decoder process: {description}", backend, code="decoder_crash"
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
                    source, description + (f"; decoder log: {tail}" if tail else ""), backend, code="decoder_crash"
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


_WORKER: DecoderProcess | None = None
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


def decoder_process() -> DecoderProcess:
    """The calling thread's own decoder helper (`own_decoder_process`), else this process' shared one (a new one
    after `fork`, e.g. in DataLoader workers)."""
    global _WORKER
    own = getattr(_THREAD_WORKER, "worker", None)
    if own is not None and own.owner_pid == os.getpid():
        return own
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.owner_pid != os.getpid():
            _WORKER = DecoderProcess()
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
                return decoder_process().decode(name, source, sample_indices_fn, num_threads, decode_timeout)
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
    raise error_class(source, f"no decoder could read it ({reasons})",
                      code=combined_code([exc.code for _, exc in failures])) from failures[-1][1]


# When every decoder tried failed, the most specific of their codes names the failure.
_CODE_PRECEDENCE = ("no_frames", "decoder_crash", "empty")


def combined_code(codes: list[str]) -> str:
    """The code of a failure of several decoders: ``"timeout"`` when all timed out, else the first of
    `_CODE_PRECEDENCE` any of them gave, else ``"unreadable"``."""
    if codes and all(code == "timeout" for code in codes):
        return "timeout"
    return next((code for code in _CODE_PRECEDENCE if code in codes), "unreadable")


__all__ = [
    "FRAME_SAMPLING_STRATEGIES",
    "VIDEO_BACKENDS",
    "DecoderProcess",
    "VideoDecodingError",
    "VideoDecodingTimeoutError",
    "check_frame_indices",
    "decode_video",
    "decord_available",
    "frames_for_fps",
    "isolation_supported",
    "own_decoder_process",
    "pyav_available",
    "sample_frame_indices",
    "shutdown_decoder_process",
]
