"""The one loop that encodes videos into an index or a store, for the retrieval pipeline (`encode_videos`, in memory
or into a store) and the training evaluation (one store shard per process).

`encode_videos` takes batches of decoded videos ``(indices, pixel_values or None, failures)`` from any source (the
pipeline's decode-ahead threads, a `DataLoader`), runs the video encoder once per batch, and hands the tokens, token
sizes and embeddings to a sink: an `InMemorySink` (what an in-memory `VideoIndex` holds) or a
`video_store.VideoStoreWriter` (an on-disk shard). It measures how long it waited for decoded videos and how long the
encoder took, so a user knows which of the two to scale.

This file is Hub remote code: flat relative imports only, absolute imports of installed packages only.
"""

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.utils import logging


DecodedBatch = tuple[list[int], "torch.Tensor | None", list[tuple[int, str, str]]]
"""``(indices, pixel_values (batch, frames, 3, H, W) or None, failures [(index, video, reason)])``: the videos of a
batch by their position in the collection, and the ones that could not be decoded."""


class Sink(Protocol):
    """Where encoded videos go (`InMemorySink`, `video_store.VideoStoreWriter`)."""

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None: ...

    def add_failure(self, index: int, video: str, reason: str) -> None: ...


@dataclass
class EncodingStats:
    """How fast a collection was encoded.

    Attributes:
        videos: videos handled (encoded or failed).
        seconds: wall time of the whole loop.
        decode_wait_seconds: time the encoder waited for decoded videos (all the decoding time without workers).
        encode_seconds: time in the encoder's forwards.
        num_workers: decoding workers.
    """

    videos: int
    seconds: float
    decode_wait_seconds: float
    encode_seconds: float
    num_workers: int = 0

    @property
    def videos_per_second(self) -> float:
        return self.videos / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {
            "videos": self.videos,
            "seconds": self.seconds,
            "videos_per_second": self.videos_per_second,
            "decode_wait_seconds": self.decode_wait_seconds,
            "encode_seconds": self.encode_seconds,
            "num_workers": self.num_workers,
        }


class InMemorySink:
    """Keeps encoded videos in memory, in collection order: embeddings (fp32, on the CPU) and, with
    ``store_tokens``, the tokens (in ``token_dtype``, default: the model's) and token sizes (fp32)."""

    def __init__(self, store_tokens: bool = True, token_dtype: torch.dtype | None = None):
        self.store_tokens, self.token_dtype = store_tokens, token_dtype
        self.embeddings: list[torch.Tensor] = []
        self.tokens: list[torch.Tensor] = []
        self.token_sizes: list[torch.Tensor] = []
        self.next_index = 0

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None:
        indices = list(indices)
        if indices != list(range(self.next_index, self.next_index + len(indices))):
            raise ValueError(f"InMemorySink takes videos in order: expected {self.next_index}, got {indices[:3]}.")
        self.next_index += len(indices)
        self.embeddings.append(embeddings.float().cpu())
        if self.store_tokens:
            self.tokens.append(tokens.detach().to("cpu", dtype=self.token_dtype or tokens.dtype))
            self.token_sizes.append(token_sizes.detach().float().cpu())

    def add_failure(self, index: int, video: str, reason: str) -> None:
        raise ValueError(f"Video {video!r} could not be encoded: {reason}")

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(embeddings, tokens or None, token_sizes or None)`` of every video added."""
        tokens = torch.cat(self.tokens) if self.store_tokens else None
        sizes = torch.cat(self.token_sizes) if self.store_tokens else None
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
) -> EncodingStats:
    """Encodes every batch once and hands the result to ``sink``.

    Args:
        model: a TESTA retrieval head (`get_video_tokens`, `get_video_features`).
        batches: decoded batches (`DecodedBatch`); failures go to ``sink.add_failure``.
        sink: `InMemorySink` or `VideoStoreWriter`.
        total: the number of videos, for the progress bar.
        progress_bar: show a tqdm bar: its rate is videos/s, its postfix the share of the time spent waiting for
            decoded videos.
        num_workers: reported in the stats (the decoding workers of ``batches``).
    """
    device, dtype = next(model.parameters()).device, getattr(model, "dtype", torch.float32)
    begin = time.perf_counter()
    waited = encoding = 0.0
    count = 0
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
            for index, video, reason in failures:
                sink.add_failure(index, video, reason)
            if pixel_values is not None:
                out = model.get_video_tokens(pixel_values.to(device, dtype=dtype))
                features = model.get_video_features(
                    video_tokens=out.last_hidden_state, video_token_sizes=out.token_sizes
                ).pooler_output
                encoding += time.perf_counter() - ready
                sink.add_batch(indices, out.last_hidden_state, out.token_sizes, features)
                del out, features, pixel_values  # the largest buffers of a step
            count += len(indices) + len(failures)
            bar.update(len(indices) + len(failures))
            elapsed = time.perf_counter() - begin
            bar.set_postfix_str(f"waiting for decoding {100 * waited / max(elapsed, 1e-9):.0f}%", refresh=False)
    return EncodingStats(count, time.perf_counter() - begin, waited, encoding, num_workers)


class DecodeAhead:
    """Decodes ``decode(i)`` for ``i in range(count)`` in ``num_workers`` threads, at most ``window`` items ahead of
    the next one asked for, in order; with ``num_workers=0``, decodes each item when it is asked for. A context
    manager: leaving it cancels what is pending and stops what ``thread_initializer`` started.

    Args:
        decode: ``i -> pixel_values``; its exceptions reach the caller of `get` for that item.
        count: the number of items.
        num_workers: decoding threads (0: decode in the calling thread).
        window: how far ahead of the item asked for the threads may decode.
        thread_initializer: called once in every thread (e.g. to give the thread a decoder process of its own);
            what it returns is stopped (``.stop()``) on exit, when not None.
    """

    def __init__(self, decode: Callable[[int], torch.Tensor], count: int, num_workers: int = 0, window: int = 1,
                 thread_initializer: Callable[[], Any] | None = None) -> None:
        self.decode, self.count = decode, count
        self.num_workers, self.window = num_workers, window
        self.thread_initializer = thread_initializer
        self.futures: dict[int, Any] = {}
        self.submitted = 0
        self.executor = None
        self.started: list[Any] = []

    def _initialize_thread(self) -> None:
        if self.thread_initializer is not None:
            started = self.thread_initializer()
            if started is not None:
                self.started.append(started)

    def __enter__(self) -> "DecodeAhead":
        if self.num_workers:
            self.executor = ThreadPoolExecutor(
                self.num_workers, thread_name_prefix="testa-decode", initializer=self._initialize_thread
            )
        return self

    def get(self, i: int) -> torch.Tensor:
        if self.executor is None:
            return self.decode(i)
        while self.submitted < min(self.count, i + 1 + self.window):
            self.futures[self.submitted] = self.executor.submit(self.decode, self.submitted)
            self.submitted += 1
        return self.futures.pop(i).result()

    def batches(self, batch_size: int) -> Iterable[DecodedBatch]:
        """The items in batches of ``batch_size``, as `encode_videos` takes them (a decoding error raises)."""
        for start in range(0, self.count, batch_size):
            indices = list(range(start, min(start + batch_size, self.count)))
            yield indices, torch.cat([self.get(i) for i in indices]), []

    def __exit__(self, *exc_info: Any) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
        for started in self.started:
            started.stop()


__all__ = ["DecodeAhead", "DecodedBatch", "EncodingStats", "InMemorySink", "Sink", "encode_videos"]
