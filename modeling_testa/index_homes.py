"""Where a video index lives, and the one builder that fills it.

`VideoIndexBuilder` is the only code that turns decoded videos into an index: the retrieval pipeline's
`encode_videos`, `python -m train.index` and the training evaluation all call it. It runs the one encode loop
(`indexing.encode_videos`) into a *home*:

- `InMemoryHome`: tensors in this process; `finish` returns an in-memory `VideoIndex`.
- `StoreHome`: the on-disk video store (`video_store.py`), written by 1 to N processes, one shard each, resumably;
  `finish` writes the store's index and first stage and returns a store-backed `VideoIndex`. A store grows by
  appending shards (`StoreHome.append`), from the pipeline as from `train.index`.
- `milvus_home.MilvusHome`: the embeddings and a payload in a Milvus collection (embedded Milvus Lite file, a
  `milvus-lite server`, or a Milvus server or cluster), the re-ranking tokens in a store directory.

Every row of an index is an `IndexEntry`: a video and, for a moment of it, `start`/`end` in seconds (None: the whole
video), optionally the name of the `dataset` it belongs to. ``(video, start, end)`` is a row's key: the windows of
one video are distinct rows, and a row already in an index is never added twice.

This file is Hub remote code: flat relative imports only, absolute imports of installed packages only.
"""

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .indexing import SUMMARY_FAILURES, DecodedBatch, EncodingStats, Failure, InMemorySink, encode_videos
from .moments import plan_window_rows
from .video_index import ROW_FIELDS, IndexInfo, VideoIndex, segments_tensor, video_name
from .video_store import (
    PLAN_FILE,
    VideoStoreWriter,
    finalize_store,
    is_video_store,
    missing_shards,
    read_json_file,
    store_metadata,
)



@dataclass(frozen=True)
class IndexEntry:
    """One row of an index: a video (a path, or an in-memory video) or a moment of it.

    Attributes:
        video: the path (or array / frame list).
        start, end: the moment's bounds in seconds; None for the whole video.
        dataset: a name to filter search by (e.g. the dataset or collection the video comes from), or None.
    """

    video: Any
    start: float | None = None
    end: float | None = None
    dataset: str | None = None

    def name(self, position: int) -> str:
        """The video's name in an index (its path, or ``videos[position]`` for an in-memory video)."""
        return video_name(self.video, position)

    def key(self, position: int) -> tuple[str, float | None, float | None]:
        """``(name, start, end)``: what tells two rows apart."""
        return (self.name(position), self.start, self.end)


def as_entries(items: Iterable[Any]) -> list[IndexEntry]:
    """`IndexEntry` rows from entries, or from plain videos (whole videos)."""
    return [item if isinstance(item, IndexEntry) else IndexEntry(item) for item in items]


def row_fields_of(entries: list[IndexEntry]) -> dict[str, list[Any]]:
    """The per-row fields (`ROW_FIELDS`) the entries set, one list per field any entry sets (None where unset)."""
    return {key: [getattr(entry, key) for entry in entries] for key in ROW_FIELDS
            if any(getattr(entry, key) is not None for entry in entries)}


def window_entries(videos: list[str], window: float, stride: float | None,
                   datasets: dict[str, str | None] | None = None,
                   duration: Callable[[str], float] | None = None) -> list[IndexEntry]:
    """The rows of an index of moments over the video files `videos`: every video's windows, planned from its
    duration (`moments.plan_window_rows`; a video whose duration cannot be read is one whole-video row, whose decoding
    then fails and says why), each with the video's `dataset` (``datasets[video]``). ``duration`` (default: probe the
    file, `moments.probe_duration`) gives a video's duration or raises why it cannot."""
    kwargs = {} if duration is None else {"duration": duration}
    names, segments, _ = plan_window_rows(list(videos), window, stride, **kwargs)
    return [IndexEntry(name, *(segment or (None, None)), dataset=(datasets or {}).get(name))
            for name, segment in zip(names, segments)]


def segments_of(entries: list[IndexEntry]) -> list[list[float] | None] | None:
    """The entries' ``[start, end]`` (None for a whole video), as a store keeps them (its info's and its plan's
    ``"segments"``, read back by `video_index.segments_tensor`); None when every entry is a whole video."""
    if all(entry.start is None for entry in entries):
        return None
    return [None if entry.start is None else [float(entry.start), float(entry.end)] for entry in entries]


def shard_ranges(names: list[str], first: int, size: int) -> list[list[int]]:
    """Shards ``[start, stop)`` over the rows ``first, first + 1, ...`` named `names`: a shard closes once it holds
    `size` rows or more and the next row is another video, so that a video's moments are decoded once, in one shard
    (whole videos: shards of exactly `size`)."""
    shards, begin = [], 0
    for i in range(len(names)):
        if i + 1 == len(names) or (i + 1 - begin >= size and names[i + 1] != names[i]):
            shards.append([first + begin, first + i + 1])
            begin = i + 1
    return shards


class _InMemoryWriter(InMemorySink):
    """An `InMemorySink` with the writer protocol of the homes (a context manager with `done`)."""

    done: set[int] = frozenset()

    def __enter__(self) -> "_InMemoryWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pass


class InMemoryHome:
    """An index in this process' memory: embeddings (fp32) and, with `store_tokens`, tokens (in `token_dtype`,
    default the model's) and token sizes. One writer (shard 0) per build."""

    def __init__(self, store_tokens: bool = True, token_dtype: torch.dtype | None = None):
        self.store_tokens, self.token_dtype = store_tokens, token_dtype
        self.sink: _InMemoryWriter | None = None

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: Any = None) -> _InMemoryWriter:
        self.sink = _InMemoryWriter(self.store_tokens, self.token_dtype)
        return self.sink

    def failures(self) -> list[Failure]:
        """The failures of the build (`index` None: an in-memory index has no rows for them)."""
        return [dataclasses.replace(f, index=None) for f in self.sink.failures] if self.sink is not None else []

    def finish(self, entries: list[IndexEntry], info: dict[str, Any], num_shards: int = 1,
               stats: dict[str, Any] | None = None) -> VideoIndex:
        """The in-memory `VideoIndex` of the encoded entries (raises ValueError when none was encoded)."""
        sink = self.sink
        embeddings, tokens, sizes = sink.result()
        kept = [entries[i] for i in sink.indices]
        return VideoIndex(videos=[entry.video for entry in kept], embeddings=embeddings, tokens=tokens,
                          token_sizes=sizes, info=info, stats=dict(stats or {}), failures=self.failures(),
                          row_fields=row_fields_of(kept), segments=segments_tensor(segments_of(kept)))


class StoreHome:
    """An on-disk video store (`video_store.py`) in `directory`: shard `s` holds the rows ``plan["shards"][s]``.

    Written by any number of processes, one shard each (`writer`, resumable: a writer continues after the last
    journaled batch), then finished once (`finish`) on one process. `append` plans new rows as new shards after the
    store's own, so a store grows from the pipeline and from `train.index` alike; until the grown store is finished,
    its previous index stays readable."""

    def __init__(self, directory: str | os.PathLike, token_dtype: torch.dtype | str = torch.float16):
        self.directory, self.token_dtype = Path(directory), token_dtype

    def reset(self) -> None:
        """Forgets what a directory reused for a new store planned and finished (the writers remove the rest)."""
        for name in (PLAN_FILE, "video_store.json"):
            (self.directory / name).unlink(missing_ok=True)

    def plan(self) -> dict[str, Any]:
        """``{"videos", "shards": [[start, stop], ...], "row_fields", "segments"}`` of the store (from its plan file,
        else from its finished index; empty for a new store). ``segments``: every row's ``[start, end]`` (None: a
        whole video), or None when every row is a whole video; the store's info keeps them once finished."""
        path = self.directory / PLAN_FILE
        if path.is_file():
            return read_json_file(path)  # DamagedStoreError naming it when damaged
        if is_video_store(self.directory):
            meta = store_metadata(self.directory)
            shards = sorted(meta["shards"], key=lambda shard: shard["shard"])
            return {"videos": list(meta["videos"]), "shards": [[shard["start"], shard["stop"]] for shard in shards],
                    "row_fields": dict(meta.get("row_fields") or {}),
                    "segments": (meta.get("info") or {}).get("segments")}
        return {"videos": [], "shards": [], "row_fields": {}, "segments": None}

    @staticmethod
    def entries(plan: dict[str, Any]) -> list[IndexEntry]:
        """The planned rows as `IndexEntry` rows (video, its moment, its per-row fields)."""
        segments = plan.get("segments") or [None] * len(plan["videos"])
        fields = plan.get("row_fields") or {}
        return [IndexEntry(video, *(segments[i] or (None, None)),
                           **{key: values[i] for key, values in fields.items() if key in ROW_FIELDS})
                for i, video in enumerate(plan["videos"])]

    def keys(self, plan: dict[str, Any] | None = None) -> set[tuple]:
        """The keys ``(video, start, end)`` of every planned row (failed ones included)."""
        plan = self.plan() if plan is None else plan
        return {entry.key(i) for i, entry in enumerate(self.entries(plan))}

    def append(self, entries: list[IndexEntry], shard_size: int | None = None) -> tuple[dict[str, Any], list[int]]:
        """Plans the entries the store lacks (by key) as new shards of `shard_size` rows (default: one shard) after
        its own (`shard_ranges`: a video's moments stay in one shard), writes the plan, and returns it with the new
        rows' positions in `entries`."""
        plan = self.plan()
        known = self.keys(plan)
        new = []
        for i, entry in enumerate(entries):
            key = entry.key(i)
            if key not in known:
                known.add(key)
                new.append(i)
        if not new and (self.directory / PLAN_FILE).is_file():
            return plan, new
        first = len(plan["videos"])
        size = max(1, int(shard_size or len(new) or 1))
        names = [entries[i].name(i) for i in new]
        shards = shard_ranges(names, first, size)
        old_fields = plan.get("row_fields") or {}
        added_fields = row_fields_of([entries[i] for i in new])
        fields = {key: list(old_fields.get(key) or [None] * first) + list(added_fields.get(key) or [None] * len(new))
                  for key in set(old_fields) | set(added_fields)}
        old_segments, added_segments = plan.get("segments"), segments_of([entries[i] for i in new])
        segments = None
        if old_segments is not None or added_segments is not None:
            segments = list(old_segments or [None] * first) + list(added_segments or [None] * len(new))
        plan = {"videos": plan["videos"] + names, "shards": plan["shards"] + shards, "row_fields": fields,
                "segments": segments}
        self.directory.mkdir(parents=True, exist_ok=True)
        write_json_atomically(self.directory / PLAN_FILE, plan)
        return plan, new

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: Any = None
               ) -> VideoStoreWriter:
        return VideoStoreWriter(self.directory, shard, start, stop, token_dtype=self.token_dtype, resume=resume)

    def closed_shards(self, num_shards: int) -> set[int]:
        return set(range(num_shards)) - set(missing_shards(self.directory, num_shards))

    def finish(self, entries: list[IndexEntry] | None, info: dict[str, Any], num_shards: int | None = None,
               stats: dict[str, Any] | None = None, first_stage: bool = True,
               require_encoded: bool = True) -> VideoIndex:
        """Writes the store's index (`finalize_store`: every shard must be closed; the rows are the plan's, or
        `entries` for a store written without one) and, with `first_stage`, its first stage; returns the
        store-backed `VideoIndex`. With `require_encoded`, raises ValueError (naming the reasons, and leaving no
        readable store) when no row could be encoded."""
        if (self.directory / PLAN_FILE).is_file() or entries is None:
            plan = self.plan()
        else:
            plan = {"videos": [entry.name(i) for i, entry in enumerate(entries)], "shards": None,
                    "row_fields": row_fields_of(entries), "segments": segments_of(entries)}
        num_shards = len(plan["shards"]) if num_shards is None else num_shards
        info = {key: value for key, value in info.items() if key != "segments"}
        if plan.get("segments") is not None:  # every row's (start, end): VideoIndex.from_store reads them
            info["segments"] = plan["segments"]
        finalize_store(self.directory, plan["videos"], num_shards, info, row_fields=plan.get("row_fields") or None)
        index = VideoIndex.from_store(self.directory, first_stage=False)
        if require_encoded and index.num_encoded == 0:
            (self.directory / "video_store.json").unlink()
            reasons = "\n".join(f"  {f.video}: {str(f)[:300]}" for f in index.failures[:SUMMARY_FAILURES])
            raise ValueError(f"None of the {len(index)} videos could be read:\n{reasons}")
        if first_stage:
            index.save_first_stage(self.directory)
            index.load_first_stage(self.directory)
        index.stats = dict(stats or {})
        return index


def write_json_atomically(path: Path, value: Any) -> None:
    """Writes `value` to a temporary file and renames it: a reader sees the old file or the new one."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=1), encoding="utf-8")
    temporary.replace(path)


Decoder = Callable[[list[IndexEntry], list[int]], Iterable[DecodedBatch]]
"""``decode(entries, positions)``: the decoded batches of ``entries[p] for p in positions``, each batch naming its
rows by their collection positions (`DecodedBatch`). A failure's `index` is its position."""


class VideoIndexBuilder:
    r"""
    The one builder of video indexes: encodes `IndexEntry` rows with a retrieval model into a home (`InMemoryHome`,
    `StoreHome`, `milvus_home.MilvusHome`) and finishes it into a searchable index.

    Usage (one process)::

        builder = VideoIndexBuilder(model, StoreHome("store"), IndexInfo.from_model(model, num_frames=8))
        entries = [IndexEntry("a.mp4"), IndexEntry("long.mp4", start=0.0, end=10.0),
                   IndexEntry("long.mp4", start=10.0, end=20.0, dataset="lectures")]
        index = builder.build(entries, decode)

    `decode(entries, positions)` yields `DecodedBatch`\ es (for windows: decode the moment ``[start, end)`` of the
    video). With several processes, each calls `encode(entries, decode, shard=s, ...)` for its shards, and one calls
    `finish` after all are done. A row that cannot be decoded is a `Failure` (its code set where its error was
    raised), recorded by the home and never returned by search.

    Args:
        model: a TESTA retrieval head (`get_video_tokens`, `get_video_features`).
        home: where the rows go.
        info (`IndexInfo` or `dict`): the settings the index is built with (saved as its `info`; extra keys kept).
    """

    def __init__(self, model: Any, home: Any, info: IndexInfo | dict[str, Any]):
        self.model, self.home = model, home
        self.info = info.as_dict() if isinstance(info, IndexInfo) else dict(info)

    def encode(self, entries: list[IndexEntry], decode: Decoder, shard: int = 0, start: int = 0,
               stop: int | None = None, resume: bool = False, progress_bar: bool = False, num_workers: int = 0,
               summary: bool = True, description: str = "Encoding videos") -> tuple[EncodingStats, int]:
        """Encodes the rows ``[start, stop)`` of `entries` (all by default) into shard `shard` of the home, skipping
        what a resumed shard already holds. Returns the encode loop's stats and how many rows were already there."""
        stop = len(entries) if stop is None else stop
        with self.home.writer(shard, start, stop, resume=resume, entries=entries) as writer:
            done = set(writer.done)
            todo = [i for i in range(start, stop) if i not in done]
            batches = decode(entries, todo) if todo else iter(())
            stats = encode_videos(self.model, batches, writer, total=len(todo), progress_bar=progress_bar,
                                  description=description, num_workers=num_workers, summary=summary)
        return stats, len(done)

    @staticmethod
    def _positioned(batches: Iterable[DecodedBatch]) -> Iterable[DecodedBatch]:
        for indices, pixels, failures in batches:
            yield indices, pixels, [f if f.index is not None else dataclasses.replace(f, index=-1) for f in failures]

    def finish(self, entries: list[IndexEntry] | None = None, num_shards: int | None = None,
               stats: EncodingStats | None = None, **options: Any) -> Any:
        """The finished, searchable index of the home (see each home's `finish` and its `options`); call it on one
        process, once every shard is written."""
        return self.home.finish(entries, self.info, num_shards, stats=stats.as_dict() if stats else None, **options)

    def build(self, entries: list[IndexEntry], decode: Decoder, progress_bar: bool = False, num_workers: int = 0,
              start: int = 0, shard: int = 0, num_shards: int | None = None) -> Any:
        """`encode` everything from `start` as one shard, then `finish`."""
        stats, _ = self.encode(entries, decode, shard=shard, start=start, progress_bar=progress_bar,
                               num_workers=num_workers)
        return self.finish(entries, num_shards, stats)


__all__ = ["PLAN_FILE", "IndexEntry", "InMemoryHome", "StoreHome", "VideoIndexBuilder", "as_entries",
           "row_fields_of", "segments_of", "shard_ranges", "window_entries", "write_json_atomically"]
