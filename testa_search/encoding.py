"""The one loop that encodes videos into an index or a store, for the retrieval pipeline (`encode_videos`, in memory
or into a store) and the training evaluation (one store shard per process).

`encode_videos` takes batches of decoded videos ``(indices, pixel_values or None, failures)`` from any source (the
pipeline's decode-ahead threads `DecodeAhead`, a `DataLoader` collating with `DecodeVideos`), runs the video encoder
once per batch, and hands the tokens, token sizes and embeddings to a sink: an `InMemorySink` (what an in-memory
`VideoIndex` holds) or a `video_store.VideoStoreWriter` (an on-disk shard). It measures how long it waited for decoded
videos and how long the encoder took, so a user knows which of the two to scale.

**Bad files are data.** A video that cannot be read (`is_media_error`: a missing file, or the decoder's
`VideoDecodingError`) is a failure, not an exception: the decoders here (`DecodeEach`, `DecodeVideos`) turn it into a
`Failure` record and go on, the sink records it, the progress bar counts it, and a warning at the end lists
the first `SUMMARY_FAILURES`. ``on_error="raise"`` (`ON_ERROR`) raises the decoder's own error instead. A failure's
`code` (`FAILURE_CODES`) is set where the error was raised (`VideoDecodingError.code`) or told by the file's first
bytes (`failure_code`); it is never read from a message.
"""

import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from transformers.utils import logging

from modeling_testa.ranking import encode_video_batch


logger = logging.get_logger(__name__)

ON_ERROR = ("skip", "raise")
"""What the encode loop does with a video it cannot read: record it as a failure and go on, or raise."""

FAILURE_CODES = {
    "missing": "the file does not exist",
    "empty": "the file is empty (0 bytes)",
    "not_a_video": "the file does not start like any video container (e.g. a text file named .mp4)",
    "truncated": "a video container that ends before its last box (an interrupted download or copy)",
    "no_frames": "the video stream holds no decodable frame",
    "decoder_crash": "the decoder process crashed or stopped",
    "timeout": "the decoder made no progress for decode_timeout seconds (a stall); the decoder process was killed",
    "unreadable": "any other reason the decoders give (corrupt data, no video stream, no permission)",
    "unknown": "recorded by an earlier version, which kept the reason but not its code",
}
"""The stable first word of every failure reason, and what it means."""

SUMMARY_FAILURES = 10
"""Failures listed by name in the warning at the end of an encode run (all are counted)."""


def check_on_error(on_error: str) -> str:
    """Returns ``on_error`` when it is one of `ON_ERROR`; raises `ValueError` naming the allowed values otherwise."""
    if on_error not in ON_ERROR:
        raise ValueError(f"`on_error` must be one of {', '.join(repr(v) for v in ON_ERROR)}, got {on_error!r}.")
    return on_error


def is_media_error(error: BaseException) -> bool:
    """Whether ``error`` says that one video file cannot be read (and the next one may be fine): an `OSError`
    (missing file, no permission, a directory) or a `VideoDecodingError` (from any copy of `video_decoding`, e.g.
    the Hub's remote code, hence the check by name)."""
    return isinstance(error, OSError) or any(c.__name__ == "VideoDecodingError" for c in type(error).__mro__)


# the first bytes of the containers FFmpeg reads video from: anything else is not a video file
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid")
_SIGNATURES = (
    (0, b"\x1a\x45\xdf\xa3"),  # Matroska / WebM (EBML)
    (0, b"RIFF"),  # AVI
    (0, b"FLV"),
    (0, b"OggS"),
    (0, b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"),  # ASF / WMV
    (0, b"\x00\x00\x01\xba"),  # MPEG program stream
    (0, b"\x00\x00\x01\xb3"),  # MPEG-1/2 elementary stream
)


def looks_like_video(head: bytes) -> bool:
    """Whether the first bytes of a file (at least 12, more for MPEG-TS) start a container that holds video."""
    if head[4:8] in _MP4_BOXES:  # MP4 / MOV / 3GP
        return True
    if len(head) > 188 and head[0] == head[188] == 0x47:  # MPEG transport stream: sync byte every 188 bytes
        return True
    return any(head[offset : offset + len(magic)] == magic for offset, magic in _SIGNATURES)


def mp4_is_truncated(path: str | os.PathLike) -> bool:
    """Whether an MP4/MOV file ends inside one of its top-level boxes, or ends with no ``moov`` box (the box a
    player needs, which most writers put last): what an interrupted download or copy leaves."""
    size = os.path.getsize(path)
    offset, seen = 0, set()
    with open(path, "rb") as handle:
        while offset + 8 <= size:
            handle.seek(offset)
            header = handle.read(16)
            box_size, kind = struct.unpack(">I4s", header[:8])
            if box_size == 1 and len(header) == 16:
                box_size = struct.unpack(">Q", header[8:16])[0]
            elif box_size == 0:  # the box runs to the end of the file
                box_size = size - offset
            if box_size < 8:
                return False  # not a box structure we can follow; leave it to the decoder's reason
            seen.add(kind)
            if offset + box_size > size:
                return True
            offset += box_size
    return b"moov" not in seen


def failure_code(error: BaseException, source: str | os.PathLike | None = None) -> str:
    """The `FAILURE_CODES` code of why ``source`` could not be read: ``"missing"`` for a missing file, the `code`
    the decoder set where it raised (`VideoDecodingError.code`), refined by the file's first bytes (``"empty"``,
    ``"not_a_video"``, ``"truncated"``) unless the decoder timed out. Never read from the error's message."""
    if isinstance(error, FileNotFoundError):
        return "missing"
    code = getattr(error, "code", None)
    code = code if isinstance(code, str) and code in FAILURE_CODES else "unreadable"
    if code == "timeout":
        return code
    path = Path(source) if isinstance(source, (str, os.PathLike)) else None
    if path is not None and path.is_file():
        try:
            with open(path, "rb") as handle:
                head = handle.read(200)
            if not head:
                return "empty"
            if not looks_like_video(head):
                return "not_a_video"
            if head[4:8] in _MP4_BOXES and mp4_is_truncated(path):
                return "truncated"
        except OSError:
            return "unreadable"
    return code


@dataclass(frozen=True)
class Failure:
    """A video (or a moment of one: `start`/`end` in seconds) that could not be encoded: the one record of a failure,
    in memory (`VideoIndex.failures`), in a store (``video_store.json``, via `as_dict`) and in reports.

    Attributes:
        video: the video's name (its path, or ``videos[i]``).
        code: a `FAILURE_CODES` word, set where the error was raised (`failure_code`).
        reason: ``"<ErrorType>: <message>"``, for people.
        index: the video's position in the collection being encoded, when known (a store's row).
        start, end: the moment's bounds in seconds, None for a whole video.
    """

    video: str
    code: str
    reason: str
    index: int | None = None
    start: float | None = None
    end: float | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"

    @property
    def key(self) -> tuple[str, float | None, float | None]:
        """``(video, start, end)``: what tells two rows of an index apart."""
        return (self.video, self.start, self.end)

    def as_dict(self) -> dict[str, Any]:
        """A json-ready dict (`start`/`end`/`index` only when set)."""
        record = {"index": self.index, "video": self.video, "code": self.code, "reason": self.reason,
                  "start": self.start, "end": self.end}
        return {key: value for key, value in record.items() if value is not None}

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "Failure":
        """The record `as_dict` wrote; one written before codes were stored gets the code ``"unknown"``."""
        return cls(str(record["video"]), str(record.get("code", "unknown")), str(record["reason"]),
                   record.get("index"), record.get("start"), record.get("end"))

    @classmethod
    def from_error(cls, error: BaseException, video: str, index: int | None = None,
                   source: str | os.PathLike | None = None, start: float | None = None,
                   end: float | None = None) -> "Failure":
        """The failure `error` says ``video`` (read from `source`, default: `video`) had."""
        source = video if source is None else source
        return cls(str(video), failure_code(error, source), f"{type(error).__name__}: {error}", index, start, end)


class NoReadableVideoError(ValueError):
    """No row of a build could be read, so no index was made (nothing written): ``failures`` holds every row's
    `Failure`, so a caller can say why without decoding the videos again; the message lists the first
    `SUMMARY_FAILURES` of them."""

    def __init__(self, failures: Iterable[Failure], note: str = ""):
        self.failures, self.note = list(failures), note
        super().__init__(f"None of the {len(self.failures)} videos could be read{note}:\n"
                         + failure_lines(self.failures))

    def __reduce__(self):  # pickled with its failures (e.g. across processes), not with its message
        return type(self), (self.failures, self.note)


DecodedBatch = tuple[list[int], "torch.Tensor | None", list[Failure]]
"""``(indices, pixel_values (batch, frames, 3, H, W) or None, failures)``: the videos of a batch by their position in
the collection, and the ones that could not be decoded (`Failure` records with their `index`)."""


@runtime_checkable
class Sink(Protocol):
    """Where encoded videos go, the one writer protocol (`InMemorySink`, `video_store.VideoStoreWriter`, a Milvus
    writer; what an index home's `writer` returns for one shard): a context manager; `done` holds the rows already
    written (a resumed shard skips them), `failures` what `add_failure` was given, in order (`Failure` records or,
    for a store writer, their `Failure.as_dict` form)."""

    done: set[int]
    failures: list[Any]

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None: ...

    def add_failure(self, index: int, video: str, reason: str, code: str | None = None) -> None: ...

    def __enter__(self) -> "Sink": ...

    def __exit__(self, *exc_info: Any) -> Any: ...


@dataclass
class EncodingStats:
    """How fast a collection was encoded.

    Attributes:
        videos: videos handled (encoded or failed).
        seconds: wall time of the whole loop.
        failed: videos that could not be read (recorded by the sink; see `ON_ERROR`).
        decode_wait_seconds: time the encoder waited for decoded videos (all the decoding time without workers).
        encode_seconds: time in the encoder's forwards.
        num_workers: decoding workers.
    """

    videos: int
    seconds: float
    decode_wait_seconds: float
    encode_seconds: float
    num_workers: int = 0
    failed: int = 0

    @property
    def videos_per_second(self) -> float:
        return self.videos / self.seconds if self.seconds > 0 else float("inf")

    def merged(self, other: "EncodingStats") -> "EncodingStats":
        """The stats of this run followed by `other` (times and counts add up; the workers are the larger number)."""
        added = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        return EncodingStats(**{**added, "num_workers": max(self.num_workers, other.num_workers)})

    def as_dict(self) -> dict[str, Any]:
        """Every field, and `videos_per_second` after `seconds`."""
        return {"videos": self.videos, "seconds": self.seconds, "videos_per_second": self.videos_per_second,
                **asdict(self)}


class NothingToClose:
    """The context manager of a sink that holds no file (`InMemorySink`, the Milvus writer): it closes nothing."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pass


class InMemorySink(NothingToClose):
    """Keeps encoded videos in memory, in collection order: embeddings (fp32, on the CPU) and, with
    ``store_tokens``, the tokens (in ``token_dtype``, default: the model's) and token sizes (fp32). Videos that
    failed are left out: `indices` lists the encoded ones, `failures` maps a failed video to its reason."""

    def __init__(self, store_tokens: bool = True, token_dtype: torch.dtype | None = None):
        self.store_tokens, self.token_dtype = store_tokens, token_dtype
        self.embeddings: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.token_sizes: list[torch.Tensor] = []
        self.indices: list[int] = []
        self.failures: list[Failure] = []
        self.next_index = 0

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None:
        indices = [int(i) for i in indices]
        if indices != sorted(set(indices)) or (indices and indices[0] < self.next_index):
            raise ValueError(f"InMemorySink takes videos in order: expected {self.next_index} or later, got "
                             f"{indices[:3]}.")
        if indices:
            self.next_index = indices[-1] + 1
        self.indices += indices
        self.embeddings.append(embeddings.float().cpu())
        if self.store_tokens:
            self.tokens.append(tokens.detach().to("cpu", dtype=self.token_dtype or tokens.dtype))
            if token_sizes is not None:  # an encoder that reports no token sizes (every token one patch) has none
                self.token_sizes.append(token_sizes.detach().float().cpu())

    def add_failure(self, index: int, video: str, reason: str, code: str | None = None) -> None:
        self.failures.append(Failure(str(video), code or "unknown", str(reason), int(index)))

    done: set[int] = frozenset()  # a sink in memory is never resumed

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(embeddings, tokens or None, token_sizes or None)`` of every video encoded (`indices`), at least one."""
        if not self.embeddings:
            raise ValueError("No video was encoded.")
        tokens = torch.cat(self.tokens) if self.store_tokens else None
        sizes = torch.cat(self.token_sizes) if self.store_tokens and self.token_sizes else None
        return torch.cat(self.embeddings), tokens, sizes


@torch.no_grad()
def encode_videos(
    model: Any,
    batches: Iterable[DecodedBatch],
    sink: Sink,
    total: int | None = None,
    progress_bar: bool = False,
    description: str = "Encoding videos",
    num_workers: int = 0,
    summary: bool = True,
) -> EncodingStats:
    """Encodes every batch once and hands the result to ``sink``.

    Args:
        model: a TESTA retrieval head (`get_video_tokens`, `get_video_features`).
        batches: decoded batches (`DecodedBatch`); failures go to ``sink.add_failure``.
        sink: `InMemorySink` or `VideoStoreWriter`.
        total: the number of videos, for the progress bar.
        progress_bar: show a tqdm bar: its rate is videos/s, its postfix the share of the time spent waiting for
            decoded videos and the failures so far.
        num_workers: reported in the stats (the decoding workers of ``batches``).
        summary: at the end, log a warning with the number of failures and the first `SUMMARY_FAILURES` of them.
    """
    device, dtype = next(model.parameters()).device, getattr(model, "dtype", torch.float32)
    begin = time.perf_counter()
    waited = encoding = 0.0
    count = 0
    failed: list[Failure] = []
    iterator = iter(batches)
    with logging.tqdm(total=total, desc=description, unit="video", disable=not progress_bar) as bar:
        while True:
            started = time.perf_counter()
            try:
                indices, pixel_values, failures = next(iterator)
            except StopIteration:
                break
            ready = time.perf_counter()
            waited += ready - started
            for failure in failures:
                sink.add_failure(failure.index, failure.video, failure.reason, code=failure.code)
                failed.append(failure)
            if pixel_values is not None:
                tokens, token_sizes, features = encode_video_batch(model, pixel_values.to(device, dtype=dtype))
                encoding += time.perf_counter() - ready
                sink.add_batch(indices, tokens, token_sizes, features)
                del tokens, token_sizes, features, pixel_values  # the largest buffers of a step
            count += len(indices) + len(failures)
            bar.update(len(indices) + len(failures))
            elapsed = time.perf_counter() - begin
            bar.set_postfix_str(f"waiting for decoding {100 * waited / max(elapsed, 1e-9):.0f}%"
                                + (f", failed {len(failed)}" if failed else ""), refresh=False)
    if summary and failed:
        logger.warning(failure_summary(failed, count))
    return EncodingStats(count, time.perf_counter() - begin, waited, encoding, num_workers, len(failed))


def failure_lines(failures: list[Failure], limit: int = SUMMARY_FAILURES) -> str:
    """The first ``limit`` failures as ``  video: code: reason`` lines, and how many more there are."""
    lines = [f"  {failure.video}: {str(failure)[:300]}" for failure in failures[:limit]]
    if len(failures) > limit:
        lines.append(f"  ... and {len(failures) - limit} more")
    return "\n".join(lines)


def failure_summary(failures: list[Failure], total: int, limit: int = SUMMARY_FAILURES) -> str:
    """``"F of N videos could not be read and were skipped:"`` and the `failure_lines`."""
    return f"{len(failures)} of {total} videos could not be read and were skipped:\n" + failure_lines(failures, limit)


class DecodeEach:
    """Collation for indexing a collection: decodes each video on its own with ``decode(video, position)``, so that a
    file that cannot be read fails alone. Takes ``[(position, video), ...]`` and returns a `DecodedBatch`: ``(indices,
    pixel_values or None, failures)``, failures as `Failure` records; with ``on_error="raise"`` the decoder's error
    propagates."""

    def __init__(self, decode: Callable[[Any, int], torch.Tensor], on_error: str = "skip"):
        self.decode_one = decode
        self.on_error = check_on_error(on_error)

    def __call__(self, batch: list[tuple[int, Any]]) -> DecodedBatch:
        indices, pixels, failures = [], [], []
        for index, video in batch:
            try:
                pixels.append(self.decode_one(video, index))
            except Exception as error:  # a media error (`is_media_error`) is the video's failure with "skip"
                if self.on_error == "raise" or not is_media_error(error):
                    raise
                failures.append(Failure.from_error(error, str(video), index))
                continue
            indices.append(index)
        return indices, (torch.cat(pixels) if pixels else None), failures


class DecodeVideos(DecodeEach):
    """`DecodeEach` with the video processor (``uniform`` sampling of `num_frames`): the collation of `train.index`
    and the training evaluation (a DataLoader's `collate_fn`)."""

    def __init__(self, video_processor: Any, num_frames: int, on_error: str = "skip"):
        super().__init__(self.decode_at, on_error)  # a bound method, not a lambda: DataLoader workers unpickle it
        self.video_processor, self.num_frames = video_processor, num_frames

    def decode_at(self, path: str, position: int) -> torch.Tensor:
        return self.decode(path)

    def decode(self, path: str) -> torch.Tensor:
        """``(1, frames, 3, H, W)`` pixel values of one video file."""
        return self.video_processor(videos=[path], num_frames=self.num_frames, frame_sampling="uniform")["pixel_values"]


class _Channel:
    """One stream's way from its thread to the consumer: at most `size` items wait in it; its end (or its error)
    never waits, so a finished stream never holds its thread."""

    ITEM, END, ERROR = range(3)

    def __init__(self, size: int) -> None:
        self.entries: queue.SimpleQueue = queue.SimpleQueue()
        self.room = threading.Semaphore(size)

    def put(self, item: Any, stopped: threading.Event) -> bool:
        """Waits for room (checking `stopped` every 0.1 s) and puts `item`; False when stopped first."""
        while not stopped.is_set():
            if self.room.acquire(timeout=0.1):
                self.entries.put((self.ITEM, item))
                return True
        return False

    def end(self, error: BaseException | None = None) -> None:
        self.entries.put((self.END, None) if error is None else (self.ERROR, error))

    def __iter__(self) -> Iterator[Any]:
        while True:
            kind, item = self.entries.get()
            if kind == self.ERROR:
                raise item
            if kind == self.END:
                return
            self.room.release()
            yield item


class DecodeAhead:
    """Decoding ahead of the encoder, in threads, in order: the one kit behind the pipeline's decoding threads
    (`build.FileDecoder`) and `moments.WindowRowDecoder` (each thread streaming one video's windows).

    Runs ``decode(i)`` for ``i in range(count)`` in ``num_workers`` threads and hands the results out in order
    (`get`, iteration). An item: at most ``window`` items are decoded ahead of the one asked for. A stream
    (``max_items`` set: ``decode(i)`` returns an iterable, e.g. the windows of one video): every item of stream 0,
    then of stream 1, ...; while one is consumed the next ``num_workers - 1`` run ahead, one a thread, each at most
    ``max_items`` items ahead (memory stays bounded: ``num_workers x max_items`` items and what each stream holds).
    With ``num_workers=0``, each is decoded in the calling thread when its turn comes.

    An exception in ``decode(i)`` is raised where its item is asked for (`get` of a failed item raises, the next
    `get` goes on). A context manager: leaving it stops the streams (their generators are closed), cancels what is
    pending and stops what ``thread_initializer`` started.

    Args:
        decode: ``i -> item`` (``i -> iterable of items`` with ``max_items``).
        count: the number of items (streams).
        num_workers: decoding threads (0: decode in the calling thread).
        window: how many items past the one asked for the threads may decode (items only: a stream waiting for
            room holds its thread, so streams run one a thread).
        thread_initializer: called once in every thread (e.g. to give the thread a decoder process of its own);
            what it returns is stopped (``.stop()``) on exit, when not None.
        max_items: streams: the items each may hold ahead of the consumer.
    """

    def __init__(self, decode: Callable[[int], Any], count: int, num_workers: int = 0, window: int = 1,
                 thread_initializer: Callable[[], Any] | None = None, max_items: int | None = None) -> None:
        self.decode, self.count, self.num_workers = decode, count, num_workers
        self.streams = max_items is not None
        self.ahead = max(num_workers - 1, 0) if self.streams else window
        self.max_items = max(1, max_items or 1)
        self.thread_initializer = thread_initializer
        self.channels: dict[int, _Channel] = {}
        self.submitted = 0
        self.executor: ThreadPoolExecutor | None = None
        self.stopped = threading.Event()
        self.started: list[Any] = []

    def _initialize_thread(self) -> None:
        if self.thread_initializer is not None:
            started = self.thread_initializer()
            if started is not None:
                self.started.append(started)

    def __enter__(self) -> "DecodeAhead":
        if self.num_workers:
            self.executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="testa-decode",
                                               initializer=self._initialize_thread)
        return self

    def _items_of(self, i: int) -> Iterable[Any]:
        return self.decode(i) if self.streams else (self.decode(i),)

    def _produce(self, i: int, channel: _Channel) -> None:
        stream = None
        try:
            stream = self._items_of(i)
            for item in stream:
                if not channel.put(item, self.stopped):
                    return
            channel.end()
        except BaseException as error:  # noqa: BLE001 - raised in the consumer
            channel.end(error)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def stream(self, i: int) -> Iterator[Any]:
        """The items of ``i`` (asked for in order: ``i = 0, 1, ...``, each consumed before the next)."""
        if self.executor is None:
            yield from self._items_of(i)
            return
        while self.submitted < min(self.count, i + 1 + self.ahead):
            self.channels[self.submitted] = _Channel(self.max_items)
            self.executor.submit(self._produce, self.submitted, self.channels[self.submitted])
            self.submitted += 1
        yield from self.channels.pop(i)

    def get(self, i: int) -> Any:
        """Item ``i`` (asked for in order); its decoding error is raised here."""
        (item,) = self.stream(i)
        return item

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.count):
            yield from self.stream(i)

    def __exit__(self, *exc_info: Any) -> None:
        self.stopped.set()
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        for started in self.started:
            started.stop()


__all__ = [
    "FAILURE_CODES", "ON_ERROR", "SUMMARY_FAILURES", "DecodeAhead", "DecodeEach", "DecodeVideos", "DecodedBatch",
    "EncodingStats", "Failure", "InMemorySink", "NoReadableVideoError", "NothingToClose", "Sink", "check_on_error",
    "encode_videos", "failure_code", "failure_lines", "failure_summary", "is_media_error", "looks_like_video",
    "mp4_is_truncated",
]
