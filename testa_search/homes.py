"""Where a video index lives (its *home*), what a searchable index offers, and the rows both are made of.

Two interfaces, declared as `typing.Protocol`s as HF datasets' `BaseIndex` declares its indexes:

- `IndexHome`: where a build writes rows. `build.IndexBuild`, the one code that runs a build, calls its
  methods in this order: `lock`, `check_settings`, `plan` (or `read_plan` on the other processes), `writer` per shard,
  `finish`. Homes: `InMemoryHome` (tensors in this process), `StoreHome` (the on-disk video store of
  `video_store.py`, written by 1 to N processes, resumably) and `milvus.MilvusHome` (a Milvus collection).
- `SearchableIndex`: what search reads (`VideoTextRetrievalPipeline.search`): `nearest`, `entry`, `videos`,
  `embeddings`, `tokens`. `index.VideoIndex` (in memory or store-backed) and `milvus.MilvusIndex` are
  searchable indexes.

Every row of an index is an `IndexEntry`: a video and, for a moment of it, `start`/`end` in seconds (None: the whole
video), optionally the name of the `dataset` it belongs to. ``(video, start, end)`` is a row's key: the windows of
one video are distinct rows, and a home never plans a row it already holds (except a store built with ``replace``,
which holds exactly the rows it is given, in order: the training evaluation's).
"""

import dataclasses
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from testa_search.settings import (SCRATCH_KEY, IndexSettingsError, check_settings, check_store_folder,
                                   recorded_store_settings, write_json_atomically)
from testa_search.encoding import DecodedBatch, Failure, InMemorySink, NoReadableVideoError, Sink
from testa_search.store.lock import LOCK_FILE, StoreLock
from testa_search.index import ROW_FIELDS, VideoIndex, segments_tensor, video_name
from testa_search.store.video_store import (
    PLAN_FILE,
    STORE_INFO_FILE,
    TOKEN_DTYPES,
    VideoStoreWriter,
    finalize_store,
    is_video_store,
    missing_shards,
    read_json_file,
    rewrite_shard,
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


def segments_of(entries: list[IndexEntry]) -> list[list[float] | None] | None:
    """The entries' ``[start, end]`` (None for a whole video), as a store keeps them (its info's and its plan's
    ``"segments"``, read back by `index.segments_tensor`); None when every entry is a whole video."""
    if all(entry.start is None for entry in entries):
        return None
    return [None if entry.start is None else [float(entry.start), float(entry.end)] for entry in entries]


def new_rows(entries: list[IndexEntry], known: set[tuple]) -> list[int]:
    """The positions of the entries whose key is not in `known`, each key once, in order (linear in the entries)."""
    seen, new = set(known), []
    for i, entry in enumerate(entries):
        key = entry.key(i)
        if key not in seen:
            seen.add(key)
            new.append(i)
    return new


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


def default_shard_size(count: int, num_processes: int) -> int:
    """Rows per shard when the caller sets none: one shard per process."""
    return max(1, math.ceil(count / max(1, num_processes)))


@dataclass
class RowPlan:
    """What a build writes into its home.

    Attributes:
        rows: the rows the home holds once the build is done, in order (an in-memory home: the new rows only; they
            join its index at `finish`).
        shards: ``[start, stop)`` of every shard of `rows`; shard ``s`` is written by process ``s % num_processes``.
        open_shards: the shards still to write: this build's new ones, and any a killed build left open.
        added: the positions, in the entries the build was given, of the rows it planned (the others were there).
    """

    rows: list[IndexEntry]
    shards: list[list[int]]
    open_shards: list[int]
    added: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- the interfaces


@runtime_checkable
class IndexHome(Protocol):
    """Where a build writes its rows. `build.IndexBuild` calls, in this order:

    1. `lock(command)`: the home's writer lock (a no-op where the home has no other writer); the main process holds
       it for the whole build.
    2. `check_settings(settings, replace)`: refuses, naming every difference (`IndexSettingsError`), rows built with
       other settings than the home holds, and changes nothing then; records the settings in a new home. Returns the
       settings the home holds from now on. Nothing is encoded before it passed.
    3. `plan(entries, shard_size, num_processes)` on the main process (`read_plan()` on the others): the `RowPlan`.
    4. `writer(shard, start, stop, resume, entries)` for each open shard, on the process that writes it.
    5. `finish(plan, settings, stats, **options)` on the main process, once every shard is written: the searchable
       index.
    """

    location: str
    """Where the home is, for messages: ``"memory"``, a folder, a Milvus URI and collection."""

    def lock(self, command: str) -> Any: ...

    def check_settings(self, settings: dict[str, Any], replace: bool = False) -> dict[str, Any]: ...

    def plan(self, entries: list[IndexEntry], shard_size: int | None = None, num_processes: int = 1) -> RowPlan: ...

    def read_plan(self) -> RowPlan: ...

    def writer(self, shard: int, start: int, stop: int, resume: bool = False,
               entries: list[IndexEntry] | None = None) -> Sink: ...

    def finish(self, plan: RowPlan, settings: dict[str, Any], stats: dict[str, Any] | None = None,
               **options: Any) -> "SearchableIndex": ...


@runtime_checkable
class SearchableIndex(Protocol):
    """What search reads (`VideoTextRetrievalPipeline.search`): an `index.VideoIndex` or a
    `milvus.MilvusIndex`.

    `nearest(queries, k, filters=...)` returns ``(scores, rows)`` by decreasing cosine (rows ``-1`` past the last
    match); `entry(row)` what a result says of a row (``video``, and ``start``/``end``/``dataset`` where set);
    `embeddings[rows]` and, when `has_tokens`, `tokens[rows]` / `token_sizes[rows]` what re-ranking reads; `info`
    the settings it was built with (`settings.IndexInfo`), `failures` the rows that could not be encoded."""

    info: dict[str, Any]
    failures: list[Failure]
    has_tokens: bool

    def __len__(self) -> int: ...

    @property
    def videos(self) -> list[Any]: ...

    @property
    def embeddings(self) -> Any: ...

    @property
    def tokens(self) -> Any: ...

    def entry(self, row: int) -> dict[str, Any]: ...

    def nearest(self, query_embeddings: torch.Tensor, k: int, use_faiss: bool | None = None,
                filters: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


Decoder = Callable[[list[IndexEntry], list[int]], Iterable[DecodedBatch]]
"""``decode(entries, positions)``: the decoded batches of ``entries[p] for p in positions``, each batch naming its
rows by their collection positions (`DecodedBatch`). A failure's `index` is its position."""


class NoLock:
    """The lock of a home that no other writer shares (in memory): taking it always succeeds."""

    token = None
    taken_over = None

    def acquire(self) -> "NoLock":
        return self

    def verify(self) -> None:
        pass

    def release(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- in memory


class InMemoryHome:
    """An index in this process' memory: embeddings (fp32) and, with `store_tokens`, tokens (in `token_dtype`,
    default the model's) and token sizes. With `index`, a build grows that `VideoIndex` in place by the rows it
    lacks (and returns it); without, it makes a new one. One process, one shard."""

    location = "memory"

    def __init__(self, store_tokens: bool = True, token_dtype: torch.dtype | None = None,
                 index: VideoIndex | None = None):
        self.store_tokens, self.token_dtype, self.index = store_tokens, token_dtype, index
        self.sink: InMemorySink | None = None
        self.retried: set[str] = set()  # videos whose failed rows `plan` plans again

    def lock(self, command: str) -> NoLock:
        return NoLock()

    def check_settings(self, settings: dict[str, Any], replace: bool = False) -> dict[str, Any]:
        if self.index is None:
            return dict(settings)
        holds = self.index.has_tokens
        if self.store_tokens != holds:
            raise IndexSettingsError("The index", f"The index {'holds' if holds else 'does not hold'} tokens; encode "
                                                  f"with store_tokens={holds} to grow it.")
        if holds and self.token_dtype is not None and self.index.tokens.dtype != self.token_dtype:
            raise IndexSettingsError("The index", f"The index holds {self.index.tokens.dtype} tokens; grow it with "
                                                  f"token_dtype={self.index.tokens.dtype} (or leave it unset).")
        check_settings("The index", self.index.info, settings)
        return {**settings, **self.index.info}

    def held_videos(self) -> set[str]:
        """The videos of the index none of whose rows failed (a moment build does not plan them again)."""
        if self.index is None:
            return set()
        return set(self.index.names) - {failure.video for failure in self.index.failures}

    def retry_failures(self, entries: list[IndexEntry]) -> int:
        """Lets `plan` plan again the failed rows of the given entries' videos (a failure is not a permanent
        verdict); the index changes only at `finish`, where a row now encoded leaves its failures (`VideoIndex.add`).
        Returns how many failed rows are retried."""
        names = {entry.name(i) for i, entry in enumerate(entries)}
        failed = [] if self.index is None else [f for f in self.index.failures if f.video in names]
        self.retried = {failure.video for failure in failed}
        return len(failed)

    def plan(self, entries: list[IndexEntry], shard_size: int | None = None, num_processes: int = 1) -> RowPlan:
        known = set() if self.index is None else (set(self.index.row_keys()) | {
            failure.key for failure in self.index.failures if failure.video not in self.retried})
        added = new_rows(entries, known)
        rows = [entries[i] for i in added]
        return RowPlan(rows, [[0, len(rows)]] if rows else [], [0] if rows else [], added)

    def read_plan(self) -> RowPlan:
        raise RuntimeError("An in-memory index is built by one process.")

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: Any = None) -> InMemorySink:
        self.sink = InMemorySink(self.store_tokens, self.token_dtype)
        return self.sink

    def failures(self, plan: RowPlan) -> list[Failure]:
        """The failures of the build, each with its row's moment (`index` None: an in-memory index has no rows for
        them)."""
        return [dataclasses.replace(f, index=None, start=plan.rows[f.index].start, end=plan.rows[f.index].end)
                for f in self.sink.failures] if self.sink is not None else []

    def finish(self, plan: RowPlan, settings: dict[str, Any], stats: dict[str, Any] | None = None,
               **options: Any) -> VideoIndex:
        """The new index of the encoded rows, or the grown `index`. Raises `NoReadableVideoError` when a new index
        would hold no encoded row; a grown index takes the failures."""
        stats = dict(stats or {})
        if not plan.rows:
            return self.index
        failures = self.failures(plan)
        sink = self.sink
        if not sink.indices and self.index is None:
            raise NoReadableVideoError(failures)
        if sink.indices:
            embeddings, tokens, sizes = sink.result()
            kept = [plan.rows[i] for i in sink.indices]
            built = VideoIndex(videos=[entry.video for entry in kept], embeddings=embeddings, tokens=tokens,
                               token_sizes=sizes, info=settings, stats=stats, failures=failures,
                               row_fields=row_fields_of(kept), segments=segments_tensor(segments_of(kept)))
        else:  # nothing could be read: the grown index takes the failures
            built = failures_only(self.index, failures)
        if self.index is None:
            return built
        self.index.add(built)
        self.index.stats = stats
        return self.index


def failures_only(index: VideoIndex, failures: list[Failure]) -> VideoIndex:
    """An in-memory index with no row and these failures, that `index.add` takes (a growth where nothing could be
    read)."""
    empty = {name: None if getattr(index, name) is None else getattr(index, name)[:0]
             for name in ("tokens", "token_sizes")}
    return VideoIndex(videos=[], embeddings=index.embeddings[:0], failures=failures, info=index.info, **empty)


# ---------------------------------------------------------------------------------------------------- on disk


class StoreHome:
    """An on-disk video store (`video_store.py`) in `directory`: shard `s` holds the rows ``plan["shards"][s]``.

    Its settings are checked (or recorded) by `settings.check_store_folder`; `plan` appends the rows it lacks
    as new shards after its own (``index_plan.json``), so a store grows from the pipeline and from `train.index`
    alike, and a killed build's open shards are resumed (a writer continues after the last journaled batch). Until
    the grown store is finished, its previous index stays readable.

    Args:
        directory: the store's folder.
        token_dtype: the dtype of the tokens of a new store (default float16); a store keeps its own.
    """

    def __init__(self, directory: str | os.PathLike, token_dtype: torch.dtype | str | None = None):
        self.directory = Path(directory)
        self.token_dtype = token_dtype
        self.replace = False
        self.new = False  # whether the folder held no store when the build checked it (`check_settings`)

    @property
    def location(self) -> str:
        return str(self.directory)

    def lock(self, command: str) -> StoreLock:
        return StoreLock(self.directory, command=command)

    def check_settings(self, settings: dict[str, Any], replace: bool = False) -> dict[str, Any]:
        self.new = recorded_store_settings(self.directory) is None
        if replace or self.new:  # a new store records its token dtype
            dtype = settings.get("token_dtype") or self.token_dtype or "float16"
            settings = {**settings, "token_dtype": str(dtype).replace("torch.", "")}
        held = check_store_folder(self.directory, settings, replace=replace)
        self.replace = replace
        self.token_dtype = held.get("token_dtype") or self.token_dtype or "float16"
        return held

    # -- the plan ----------------------------------------------------------------------------------------------------

    def stored_plan(self) -> dict[str, Any]:
        """``{"videos", "shards": [[start, stop], ...], "row_fields", "segments"}`` of the store (from its plan file,
        else from its finished index; empty for a new store). ``segments``: every row's ``[start, end]`` (None: a
        whole video), or None when every row is a whole video."""
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

    def keys(self) -> set[tuple]:
        """The keys ``(video, start, end)`` of every planned row (failed ones included)."""
        return {entry.key(i) for i, entry in enumerate(self.entries(self.stored_plan()))}

    def plan(self, entries: list[IndexEntry], shard_size: int | None = None, num_processes: int = 1) -> RowPlan:
        """Plans the rows the store lacks (by key) as new shards after its own (`shard_ranges`: a video's moments
        stay in one shard; `shard_size` default: one shard per process); with ``replace``, exactly `entries`. Writes
        the plan (and the settings the build added) when it changed."""
        old = {"videos": [], "shards": [], "row_fields": {}, "segments": None} if self.replace else self.stored_plan()
        first = len(old["videos"])
        added = list(range(len(entries))) if self.replace else new_rows(entries, self.keys())
        if added:
            names = [entries[i].name(i) for i in added]
            size = int(shard_size or default_shard_size(len(added), num_processes))
            fresh = [entries[i] for i in added]
            old_fields, added_fields = old.get("row_fields") or {}, row_fields_of(fresh)
            old_segments, added_segments = old.get("segments"), segments_of(fresh)
            segments = None
            if old_segments is not None or added_segments is not None:
                segments = list(old_segments or [None] * first) + list(added_segments or [None] * len(added))
            old = {"videos": old["videos"] + names, "shards": old["shards"] + shard_ranges(names, first, size),
                   "row_fields": {key: list(old_fields.get(key) or [None] * first)
                                  + list(added_fields.get(key) or [None] * len(added))
                                  for key in set(old_fields) | set(added_fields)},
                   "segments": segments}
            write_json_atomically(self.directory / PLAN_FILE, old)
        plan = self.row_plan(old)
        plan.added = added
        return plan

    def read_plan(self) -> RowPlan:
        """The plan (and the settings) the main process wrote: the other processes of a build read them after it
        checked and planned."""
        held = recorded_store_settings(self.directory) or {}
        self.token_dtype = held.get("token_dtype") or self.token_dtype or "float16"
        self.replace = bool(held.get(SCRATCH_KEY))
        return self.row_plan(self.stored_plan())

    def row_plan(self, stored: dict[str, Any]) -> RowPlan:
        shards = [list(shard) for shard in stored["shards"]]
        closed = set(range(len(shards))) - set(missing_shards(self.directory, len(shards)))
        return RowPlan(self.entries(stored), shards, [s for s in range(len(shards)) if s not in closed])

    def discard(self) -> None:
        """Deletes what this build wrote into a folder that held no store: every file but the lock's, which its owner
        releases (and a folder the lock made is removed with it)."""
        for path in self.directory.iterdir():
            if path.is_file() and LOCK_FILE not in path.name:
                path.unlink()

    # -- removing rows -----------------------------------------------------------------------------------------------

    def held_videos(self) -> set[str]:
        """The videos of the store's plan none of whose rows failed in its finished index (a moment build does not
        plan them again; the failed ones it does, and the build retries their failed rows)."""
        failed = {str(f["video"]) for f in store_metadata(self.directory)["failures"]} \
            if is_video_store(self.directory) else set()
        return set(self.stored_plan()["videos"]) - failed

    def retry_failures(self, entries: list[IndexEntry]) -> int:
        """Removes the failed rows of the given entries' videos from a finished store, so that `plan` plans them
        again: a failure is never a permanent verdict (the file may have been repaired, copied in full, or a
        decoder crash may not recur). The caller holds the lock; returns how many rows were removed. A store
        still being written (a killed build) is resumed as it is first; its failures are retried by the next
        build."""
        if not is_video_store(self.directory) or self.row_plan(self.stored_plan()).open_shards:
            return 0
        names = {entry.name(i) for i, entry in enumerate(entries)}
        failed = [int(f["index"]) for f in store_metadata(self.directory)["failures"] if str(f["video"]) in names]
        return self.remove_rows(failed)

    def remove_videos(self, videos: Iterable[str], command: str = "StoreHome.remove_videos") -> list[str]:
        """Takes the store's lock and removes every row (each moment, encoded or failed) of `videos`; returns the
        videos that had rows. The one way rows leave a store (`python -m train.index --remove`)."""
        wanted = {os.fspath(video) for video in videos}
        lock = self.lock(command)
        lock.acquire()
        try:
            plan = self.stored_plan()
            found = [i for i, name in enumerate(plan["videos"]) if name in wanted]
            self.remove_rows(found)
            lock.verify()
        finally:
            lock.release()
        return sorted({plan["videos"][i] for i in found})

    def remove_rows(self, positions: Iterable[int]) -> int:
        """Removes these rows (positions in the store) from a finished store, the caller holding its lock: the shards
        that hold them are rewritten (`video_store.rewrite_shard`), the later ones renumbered, then the plan, the
        index and the first stage are written anew. Refused, changing nothing, on a store still being written or
        when no encoded row would be left. Its index is removed first, so that a removal killed halfway leaves a
        store that says it is unfinished (and is refused as damaged), never a wrong index. Returns how many."""
        drop = set(int(p) for p in positions)
        if not drop:
            return 0
        stored = self.stored_plan()
        if not is_video_store(self.directory) or self.row_plan(stored).open_shards:
            raise ValueError(f"The store {self.location!r} is being written (a build was interrupted): run the build "
                             "again to finish it, then remove rows.")
        meta = store_metadata(self.directory)
        failed = {int(f["index"]) for f in meta["failures"]}
        if all(i in drop or i in failed for i in range(len(stored["videos"]))):
            raise ValueError(f"Removing these rows would leave no encoded video in {self.location!r}: delete the "
                             "folder instead.")
        settings = dict(meta.get("info") or {})
        (self.directory / STORE_INFO_FILE).unlink()
        shards, position = [], 0
        for shard, (start, stop) in enumerate(stored["shards"]):
            keep = [i - start for i in range(start, stop) if i not in drop]
            if position != start or len(keep) != stop - start:
                rewrite_shard(self.directory, shard, keep, position)
            shards.append([position, position + len(keep)])
            position += len(keep)
        kept = [i for i in range(len(stored["videos"])) if i not in drop]
        segments = stored.get("segments")
        remaining = {"videos": [stored["videos"][i] for i in kept], "shards": shards,
                     "row_fields": {key: [values[i] for i in kept] for key, values in
                                    (stored.get("row_fields") or {}).items()},
                     "segments": None if segments is None else [segments[i] for i in kept]}
        write_json_atomically(self.directory / PLAN_FILE, remaining)
        self.finish(self.row_plan(remaining), settings)
        return len(drop)

    # -- writing and finishing ---------------------------------------------------------------------------------------

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: Any = None
               ) -> VideoStoreWriter:
        return VideoStoreWriter(self.directory, shard, start, stop, token_dtype=self.token_dtype, resume=resume)

    def finished(self, plan: RowPlan) -> bool:
        """Whether the store's index is written and holds every row of `plan` (nothing left to finish)."""
        return not plan.open_shards and is_video_store(self.directory) and \
            store_metadata(self.directory)["num_videos"] == len(plan.rows)

    def finish(self, plan: RowPlan, settings: dict[str, Any], stats: dict[str, Any] | None = None,
               first_stage: bool = True, require_encoded: bool = True) -> VideoIndex:
        """Writes the store's index (`finalize_store`: every shard must be closed) and, with `first_stage`, its first
        stage; returns the store-backed `VideoIndex`. With `require_encoded`, raises `NoReadableVideoError` (naming
        the reasons, and leaving no readable store) when no row could be encoded."""
        if self.finished(plan):  # nothing was written: the store as it is
            return VideoIndex.load(self.directory, first_stage=first_stage)
        info = {key: value for key, value in settings.items() if key != "segments"}
        segments = segments_of(plan.rows)
        if segments is not None:  # every row's (start, end): VideoIndex.from_store reads them
            info["segments"] = segments
        finalize_store(self.directory, [entry.name(i) for i, entry in enumerate(plan.rows)], len(plan.shards), info,
                       row_fields=row_fields_of(plan.rows) or None)
        index = VideoIndex.from_store(self.directory, first_stage=False)
        if require_encoded and index.num_encoded == 0:
            failures = list(index.failures)
            del index
            (self.directory / STORE_INFO_FILE).unlink()
            if self.new:  # nothing indexed: nothing written (the folder held no store; only the lock stays, for now)
                self.discard()
            raise NoReadableVideoError(failures, "; nothing was written")
        if first_stage:
            index.save_first_stage(self.directory)
            index.load_first_stage(self.directory)
        index.stats = dict(stats or {})
        return index


def open_index(store: str | os.PathLike, milvus: str | None = None, collection: str = "videos",
               token: str | None = None) -> Any:
    """The searchable index of a store written by `train.index`: its `VideoIndex`, or with `milvus` (a Milvus Lite
    file or a server's URI) the `MilvusIndex` of its collection `collection`, logged in with `token` (a secured
    server's credentials). The collection takes its settings from the store, which it must share, and its re-ranking
    tokens from the stores its rows name. The one opener behind ``python -m train.search`` and the app's ``--index``."""
    index = VideoIndex.load(store, first_stage=milvus is None)
    if milvus is None:
        return index
    from testa_search.milvus import MilvusHome  # milvus.py builds on this module: imported when asked for

    return MilvusHome(milvus, collection, dim=index.dim, token=token).open(index.info,
                                                                           tokens_from_stores=index.has_tokens)


__all__ = ["PLAN_FILE", "TOKEN_DTYPES", "Decoder", "IndexEntry", "IndexHome", "InMemoryHome", "NoLock",
           "RowPlan", "SearchableIndex", "StoreHome", "as_entries", "default_shard_size", "new_rows", "row_fields_of",
           "segments_of", "shard_ranges", "open_index"]
