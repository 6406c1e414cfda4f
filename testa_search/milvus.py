"""A video index in Milvus, through `pymilvus.MilvusClient`: the same code on an embedded Milvus Lite file
(``uri="videos.db"``), a ``milvus-lite server`` (``uri="http://127.0.0.1:19530"``), or a Milvus server or cluster.

Milvus holds each row's pooled embedding (L2-normalised: inner product = cosine) and a payload: the ``video``, the
moment's ``start``/``end`` (-1: the whole video), the ``dataset`` name and ``folder`` (the video's parent folder, to
filter by; `filters` gives filters the same exact meaning as for a `VideoIndex`). The primary key is the
row's key ``(video, start, end)``, so every write is an upsert: a resumed or repeated run never duplicates a row, and
the windows of one video are distinct rows. The collection records the settings its rows were built with, and refuses
rows or searches of other settings. Re-ranking tokens are not kept in Milvus: rows mirrored from a store name the
store and row of their tokens (`MilvusIndex` with `tokens_from_stores` re-ranks from there); otherwise an index
searched from Milvus ranks by cosine.

Milvus Lite (a ``.db`` file) is an embedded engine written in Python: one process at a time opens a file, and a
search loops over the rows in Python (0.5-1.4 s per query at 100k rows here, docs/inference.md). A Milvus server or
cluster is the home beyond one machine and one process.

`pymilvus` is optional: it is imported when a `MilvusHome` is made (``pip install pymilvus milvus-lite``).

This file is Hub remote code: flat relative imports only, absolute imports of installed packages only.
"""

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from testa_search.filters import FILTER_KEYS, matches, milvus_filter
from testa_search.homes import IndexEntry, InMemoryHome, NoLock, RowPlan
from testa_search.settings import IndexSettingsError, check_settings
from testa_search.encoding import Failure, NothingToClose

logger = logging.getLogger(__name__)

NO_TIME = -1.0
"""`start`/`end` of a whole video in Milvus (which has no null scalars in every deployment)."""
SETTINGS_PROPERTY = "testa.index_settings"
"""The collection property that records the settings its rows were built with (`settings.IndexInfo`)."""
FIELDS = ("key", "embedding", "video", "folder", "dataset", "start", "end", "store", "row")
"""The fields of a collection this module makes (another program's collection is refused)."""


NOT_IN_MILVUS = ("token_dtype", "segments", "scratch")
"""Settings of a store that its Milvus rows do not carry (the tokens stay in the store): neither recorded nor
compared."""


def milvus_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a collection records and compares (`NOT_IN_MILVUS` left out)."""
    return {key: value for key, value in settings.items() if key not in NOT_IN_MILVUS}


class MilvusHomeError(IndexSettingsError):
    """A Milvus home cannot be used: the server cannot be reached, the file is open in another process, or the
    collection is not one this module made for these settings. The message is one line naming the URI and the
    collection."""


def row_key(video: str, start: float | None, end: float | None) -> str:
    """The primary key of a row: the SHA-256 (hex) of its ``(video, start, end)`` as compact json (a digest, so that
    no path character reaches a Milvus expression)."""
    bounds = [None if value is None else float(value) for value in (start, end)]  # 25 and 25.0: one row
    return hashlib.sha256(json.dumps([str(video), *bounds], separators=(",", ":")).encode()).hexdigest()


def row_payload(video: str, start: float | None, end: float | None, dataset: str | None, vector: torch.Tensor,
                store: str = "", row: int = -1) -> dict[str, Any]:
    """One row as Milvus holds it (see the module docstring)."""
    return {"key": row_key(video, start, end), "embedding": vector.detach().float().tolist(), "video": str(video),
            "folder": os.path.dirname(str(video)), "dataset": dataset or "",
            "start": NO_TIME if start is None else float(start), "end": NO_TIME if end is None else float(end),
            "store": store, "row": int(row)}


def error_text(error: BaseException) -> str:
    """What a pymilvus error says (its `message`; ``str`` of a `MilvusException` is often empty), on one line."""
    text = str(getattr(error, "message", "") or error or type(error).__name__)
    return " ".join(text.split())


class MilvusWriter(NothingToClose):
    """The home writer of one shard (rows ``[start, stop)`` of the builder's entries) upserting into Milvus; each
    batch is one upsert. `done` holds the rows already in the collection (a resumed shard skips them)."""

    def __init__(self, home: "MilvusHome", entries: list[Any], start: int, stop: int, resume: bool = False):
        self.home, self.entries, self.start, self.stop = home, entries, start, stop
        self.failures: list[Failure] = []
        self.done: set[int] = set()
        if resume:  # the rows already there are not encoded again; without resume, every row is upserted again
            keys = {row_key(entries[i].name(i), entries[i].start, entries[i].end): i for i in range(start, stop)}
            self.done = {keys[key] for key in home.existing_keys(list(keys))}

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None:
        vectors = embeddings.detach().float().cpu()
        rows = [self.home.payload(self.entries, int(i), vectors[j]) for j, i in enumerate(indices)]
        self.home.upsert(rows)

    def add_failure(self, index: int, video: str, reason: str, code: str | None = None) -> None:
        entry = self.entries[int(index)]
        self.failures.append(Failure(str(video), code or "unknown", str(reason), int(index), entry.start, entry.end))


class MilvusHome:
    r"""
    A video index in a Milvus collection (see the module docstring): an `homes.IndexHome`, and the mirror of a
    store (`train.index --milvus`).

    The collection records the settings its rows were built with (collection property ``testa.index_settings``):
    rows of another model or other settings are refused (`check_settings`), as is a collection another program made,
    one of another embedding size, and a server that cannot be reached, each in one line naming the URI and the
    collection, before anything is encoded. Nothing connects before the first use: a process that never touches the
    home never opens its file (a Milvus Lite file takes one process at a time; `single_process`).

    Args:
        uri (`str`): a Milvus Lite file (``"videos.db"``), or ``"http://host:port"`` of a server or cluster.
        collection (`str`, defaults to ``"videos"``): the collection's name.
        dim (`int`, *optional*): the embedding size; needed to create the collection (the build's settings give it
            as ``projection_dim``).
        index_params (`dict`, *optional*): Milvus vector index (default: ``{"index_type": "HNSW", "params": {"M":
            32, "efConstruction": 200}}``; AUTOINDEX on a cluster is fine too). The metric is always inner product.
        search_params (`dict`, *optional*): per-search parameters (default ``{"ef": 256}``).
        token (`str`, *optional*): credentials of a secured server (``"user:password"`` or an API key).
    """

    def __init__(self, uri: str, collection: str = "videos", dim: int | None = None,
                 index_params: dict[str, Any] | None = None, search_params: dict[str, Any] | None = None,
                 token: str | None = None):
        try:
            import pymilvus  # optional: only a Milvus home needs it
        except ImportError as error:
            raise ImportError("A Milvus home needs pymilvus (pip install pymilvus milvus-lite).") from error
        self.pymilvus = pymilvus
        self.uri, self.collection, self.dim, self.token = str(uri), collection, dim, token or ""
        self.index_params = index_params or {"index_type": "HNSW", "params": {"M": 32, "efConstruction": 200}}
        self.search_params = search_params or {"ef": 256}
        self.failures: list[Failure] = []
        self.writers: list[MilvusWriter] = []
        self.settings: dict[str, Any] | None = None
        self.connected = None

    @property
    def location(self) -> str:
        return f"Milvus {self.uri} (collection {self.collection!r})"

    @property
    def single_process(self) -> bool:
        """Whether one process at a time may open it: a Milvus Lite file (a server takes any number)."""
        return not self.uri.startswith(("http://", "https://", "tcp://", "grpc://", "unix:"))

    @property
    def client(self) -> Any:
        """The `pymilvus.MilvusClient`, connected on first use; `MilvusHomeError` (one line) when it cannot be."""
        if self.connected is None:
            try:
                self.connected = self.pymilvus.MilvusClient(uri=self.uri, token=self.token)
            except Exception as error:  # noqa: BLE001  pymilvus raises bare MilvusException subclasses
                raise self.failure("cannot be opened", error) from None
        return self.connected

    def failure(self, doing: str, error: BaseException) -> MilvusHomeError:
        """The one-line error of a failed call (a Milvus Lite file another process holds is named as such)."""
        reason = error_text(error)
        if self.single_process and "Open local milvus failed" in reason and os.path.exists(self.uri):
            reason = ("the Milvus Lite file is open in another process (a Lite file takes one process at a time: "
                      "stop the other one, or serve the data with `milvus-lite server` or a Milvus server, which "
                      "take several processes)")
        return MilvusHomeError(self.location, f"{self.location} {doing}: {reason}")

    def call(self, doing: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.method(*args, **kwargs)``, its errors as `failure`."""
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except MilvusHomeError:
            raise
        except Exception as error:  # noqa: BLE001
            raise self.failure(doing, error) from None

    # -- the collection and its settings -----------------------------------------------------------------------------

    def recorded_settings(self) -> dict[str, Any] | None:
        """The settings the collection records (None: no collection yet). Raises `MilvusHomeError` for a collection
        this module did not make: other fields, or no recorded settings."""
        if not self.call("cannot be reached", "has_collection", self.collection):
            return None
        described = self.call("cannot be described", "describe_collection", self.collection)
        names = {f.get("name") for f in described.get("fields", [])}
        properties = described.get("properties") or {}
        if not set(FIELDS) <= names:
            raise MilvusHomeError(self.location, f"{self.location} was made by another program (fields "
                                                 f"{sorted(names)}): index into another collection.")
        if SETTINGS_PROPERTY not in properties:
            return {}  # this module's fields, written before collections recorded their settings
        vector = next(f for f in described["fields"] if f.get("name") == "embedding")
        dim = int((vector.get("params") or {}).get("dim", 0))
        settings = json.loads(properties[SETTINGS_PROPERTY])
        if dim and settings.get("projection_dim") not in (None, dim):
            raise MilvusHomeError(self.location, f"{self.location} holds {dim}-d vectors but records projection_dim "
                                                 f"{settings.get('projection_dim')}: it is damaged.")
        return {**settings, "projection_dim": dim or settings.get("projection_dim")}

    def check_settings(self, settings: dict[str, Any], replace: bool = False, create: bool = True) -> dict[str, Any]:
        """Refuses (one line each, `MilvusHomeError`) a server that cannot be reached, a file another process holds,
        a collection another program made or one of another embedding size, and rows built with other settings
        (naming every difference); creates the collection, recording `settings`, when there is none (unless
        `create` is False: the check alone). Returns the settings the collection holds (`settings` when it does not
        exist yet). Call it before anything is encoded."""
        settings = milvus_settings(settings)
        dim = settings.get("projection_dim") or self.dim
        recorded = self.recorded_settings()
        if recorded == {}:
            raise MilvusHomeError(self.location, f"{self.location} was written by an earlier version of this library, "
                                                 "which recorded no settings: the model of its rows is unknown, so "
                                                 "nothing is added to it. Index into another collection (this one is "
                                                 "still searched).")
        if recorded is None and not create:
            return dict(settings)
        if recorded is None:
            if not dim:
                raise MilvusHomeError(self.location, f"{self.location} does not exist and no embedding size was "
                                                     "given to create it.")
            try:
                self.create_collection(int(dim), settings)
                self.settings, self.dim = dict(settings), int(dim)
                return self.settings
            except MilvusHomeError:  # another writer created it meanwhile: its settings are checked below
                recorded = self.recorded_settings()
                if recorded is None:
                    raise
        if dim and int(dim) != int(recorded["projection_dim"]):
            raise MilvusHomeError(self.location, f"{self.location} holds {recorded['projection_dim']}-d embeddings; "
                                                 f"this model's are {dim}-d: use another collection.")
        check_settings(self.location, recorded, settings)
        self.settings, self.dim = {**settings, **recorded}, int(recorded["projection_dim"])
        return self.settings

    def create_collection(self, dim: int, settings: dict[str, Any]) -> None:
        """Creates the collection (key, embedding, payload) with `settings` recorded."""
        DataType = self.pymilvus.DataType  # noqa: N806
        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=int(dim))
        schema.add_field("video", DataType.VARCHAR, max_length=4096)
        schema.add_field("folder", DataType.VARCHAR, max_length=4096)
        schema.add_field("dataset", DataType.VARCHAR, max_length=512)
        schema.add_field("start", DataType.DOUBLE)
        schema.add_field("end", DataType.DOUBLE)
        schema.add_field("store", DataType.VARCHAR, max_length=4096)  # where the row's tokens are ("": none)
        schema.add_field("row", DataType.INT64)  # the row in that store
        index_params = self.client.prepare_index_params()
        index_params.add_index("embedding", metric_type="IP", **self.index_params)
        recorded = milvus_settings(settings)
        # the settings are part of the creation: no other writer ever sees the collection without them
        self.call("cannot create the collection", "create_collection", self.collection, schema=schema,
                  index_params=index_params,
                  properties={SETTINGS_PROPERTY: json.dumps({**recorded, "projection_dim": int(dim)})})

    # -- writing (an `homes.IndexHome`) ------------------------------------------------------------------------

    def lock(self, command: str) -> NoLock:
        return NoLock()  # every write is an upsert keyed by the row: writers cannot duplicate or lose a row

    def plan(self, entries: list[IndexEntry], shard_size: int | None = None, num_processes: int = 1) -> RowPlan:
        """Every given row, each once, in one shard, as a new in-memory index plans them; the rows the collection
        holds are skipped by its writer."""
        return InMemoryHome().plan(entries)

    def read_plan(self) -> RowPlan:
        raise RuntimeError("A Milvus home is written by one process per build (several builds may write it).")

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: list[Any] | None = None
               ) -> MilvusWriter:
        if entries is None:
            raise ValueError("A Milvus writer needs the build's rows (IndexBuild passes them).")
        if self.settings is None:
            raise RuntimeError(f"{self.location}: check_settings must pass before rows are written.")
        writer = MilvusWriter(self, entries, start, stop, resume)
        self.writers.append(writer)
        return writer

    def payload(self, entries: list[Any], i: int, vector: torch.Tensor, **tokens_at: Any) -> dict[str, Any]:
        """The payload of row `i` of `entries` (`tokens_at`: the ``store`` and ``row`` of its tokens)."""
        entry = entries[i]
        return row_payload(entry.name(i), entry.start, entry.end, entry.dataset, vector, **tokens_at)

    def upsert_store_shard(self, directory: str | os.PathLike, start: int, stop: int, shard: int,
                           entries: list[Any], chunk: int = 1000) -> int:
        """Upserts the encoded rows ``[start, stop)`` of a closed store shard (its embeddings, and the store and row
        where their tokens are), each with its `IndexEntry` of `entries` (the store's rows), after `check_settings`;
        returns how many. Idempotent: a repeated or resumed run rewrites the same rows."""
        from testa_search.store.video_store import open_safetensors, shard_file

        if self.settings is None:
            raise RuntimeError(f"{self.location}: check_settings must pass before rows are written.")
        directory = os.path.abspath(os.fspath(directory))
        tensors = open_safetensors(os.path.join(directory, shard_file("tensors", int(shard))))
        embeddings, rows = tensors["embeddings"], tensors["rows"]
        payloads = []
        for local in range(stop - start):
            if int(rows[local]) >= 0:  # a failed video (-1) is never a search result
                payloads.append(self.payload(entries, start + local, embeddings[local], store=directory,
                                             row=start + local))
        for begin in range(0, len(payloads), chunk):
            self.upsert(payloads[begin : begin + chunk])
        return len(payloads)

    def upsert(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.call("refused the rows", "upsert", self.collection, rows)

    def check_mirror_of(self, settings: dict[str, Any]) -> None:
        """Refuses (`MilvusHomeError`, one line) a mirror that does not exist or holds rows of other settings than a
        store's (`settings`, the store's recorded ones); then its rows may be rewritten from that store."""
        if self.recorded_settings() is None:
            raise MilvusHomeError(self.location, f"{self.location} does not exist: nothing to remove from it.")
        self.check_settings(settings, create=False)

    def remove_store_rows(self, directory: str | os.PathLike, keys: list[str], plan: RowPlan,
                          chunk: int = 512) -> int:
        """Mirrors a removal from a store (`StoreHome.remove_videos`), after `check_mirror_of`: deletes the rows of
        `keys` (`row_key` of each removed row), then upserts the store's remaining rows (`plan`, the store as it is
        now) again, since the removal renumbered the store rows their tokens are read from. Returns how many of
        `keys` the collection held."""
        held = self.existing_keys(keys)
        for begin in range(0, len(keys), chunk):
            self.call("refused the removal", "delete", self.collection, ids=keys[begin : begin + chunk])
        for shard, (start, stop) in enumerate(plan.shards):
            self.upsert_store_shard(directory, start, stop, shard, plan.rows)
        return len(held)

    def existing_keys(self, keys: list[str], chunk: int = 512) -> set[str]:
        """The given keys that the collection holds."""
        found: set[str] = set()
        if not self.call("cannot be reached", "has_collection", self.collection):
            return found
        for begin in range(0, len(keys), chunk):
            part = keys[begin : begin + chunk]
            rows = self.call("cannot be queried", "query", self.collection, filter=f"key in {json.dumps(part)}",
                             output_fields=["key"])
            found.update(row["key"] for row in rows)
        return found

    def finish(self, plan: RowPlan | None = None, settings: dict[str, Any] | None = None,
               stats: dict[str, Any] | None = None, **options: Any) -> "MilvusIndex":
        """Flushes and loads the collection; returns the searchable `MilvusIndex`."""
        self.failures = [f for writer in self.writers for f in writer.failures]
        index = self.open(settings)
        index.stats = dict(stats or {})
        return index

    def open(self, info: dict[str, Any] | None = None, tokens_from_stores: bool = False) -> "MilvusIndex":
        """The collection, searchable (`MilvusIndex`; `tokens_from_stores`: re-rank with the tokens of the stores
        its rows name). With `info` (the settings of the model or store that will search it), a collection built
        with other settings is refused, naming every difference."""
        recorded = self.recorded_settings()
        if recorded is None:
            raise MilvusHomeError(self.location, f"{self.location} does not exist: index into it first "
                                                 "(python -m train.index ... --milvus URI).")
        if recorded == {}:
            logger.warning("%s records no settings (written by an earlier version): searched as it is, with no check "
                           "that its rows come from the model that searches it.", self.location)
        elif info:
            check_settings(self.location, recorded, milvus_settings(info))
        self.call("cannot be flushed", "flush", self.collection)
        self.call("cannot be loaded", "load_collection", self.collection)
        count = int(self.call("cannot be counted", "get_collection_stats", self.collection)["row_count"])
        return MilvusIndex(self, {**recorded, **dict(info or {})}, list(self.failures), tokens_from_stores, count)


def search_params(params: dict[str, Any], k: int) -> dict[str, Any]:
    """A search's parameters for `k` results: an HNSW beam (``ef``) at least `k` wide (servers refuse a narrower
    one)."""
    return {**params, "ef": max(int(params["ef"]), k)} if "ef" in params else dict(params)


class _Gathered:
    """``view[rows]``: the vectors a `MilvusIndex` fetched with its last search's hits."""

    def __init__(self, index: "MilvusIndex"):
        self.index = index

    def __getitem__(self, rows: Any) -> torch.Tensor:
        rows = torch.as_tensor(rows, dtype=torch.long).flatten()
        return torch.stack([self.index.hit_vectors[int(r)] for r in rows]) if rows.numel() else \
            torch.zeros(0, self.index.dim)


class _StoredTokens:
    """``view[rows]``: the tokens (or token sizes) of hits, read from the store each hit names."""

    def __init__(self, index: "MilvusIndex", kind: str):
        self.index, self.kind = index, kind

    def __getitem__(self, rows: Any) -> torch.Tensor:
        rows = torch.as_tensor(rows, dtype=torch.long).flatten().tolist()
        parts = []
        for r in rows:
            hit = self.index.hits[int(r)]
            if not hit.get("store") or int(hit.get("row", -1)) < 0:
                raise ValueError(f"{hit['video']!r} has no tokens in Milvus' payload: this index ranks by cosine.")
            store = self.index.token_store(hit["store"])
            read = store.read_tokens if self.kind == "tokens" else store.read_token_sizes
            parts.append(read([int(hit["row"])]))
        return torch.cat(parts)


class MilvusIndex:
    """A Milvus collection searched like a `VideoIndex`. `nearest` returns rows into the hits of that search
    (``videos[row]``, ``entry(row)``, ``embeddings[row]``, ``tokens[row]``), valid until the next search. With
    `tokens_from_stores` (rows written from a store, `MilvusHome.upsert_store_shard`), the tokens are read from the
    store each row names, so search re-ranks; otherwise it ranks by cosine."""

    max_results = 16_384
    """The most hits one Milvus search returns (its `limit` bound): `pipe.search` asks for no more."""

    def __init__(self, home: MilvusHome, info: dict[str, Any], failures: list[Failure],
                 tokens_from_stores: bool = False, count: int = 0):
        self.home, self.info, self.failures, self.count = home, info, failures, int(count)
        self.has_tokens = bool(tokens_from_stores)
        self.tokens = _StoredTokens(self, "tokens") if tokens_from_stores else None
        self.token_sizes = _StoredTokens(self, "token_sizes") if tokens_from_stores else None
        self._stores: dict[str, Any] = {}
        self.hits: list[dict[str, Any]] = []
        self.hit_vectors: list[torch.Tensor] = []
        self.stats: dict[str, Any] = {}
        self.dim = int(info.get("projection_dim") or home.dim or 0)

    def token_store(self, directory: str) -> Any:
        """The `VideoTokenStore` in `directory`, opened once."""
        if directory not in self._stores:
            from testa_search.store.video_store import VideoTokenStore

            self._stores[directory] = VideoTokenStore(directory)
        return self._stores[directory]

    def __len__(self) -> int:
        """The rows when the collection was opened (counted once: Milvus counts them in O(rows))."""
        return self.count

    @property
    def videos(self) -> list[str]:
        return [hit["video"] for hit in self.hits]

    @property
    def embeddings(self) -> _Gathered:
        return _Gathered(self)

    def entry(self, row: int) -> dict[str, Any]:
        hit = self.hits[row]
        found = {"video": hit["video"]}
        for key in ("start", "end"):
            if hit.get(key, NO_TIME) != NO_TIME:
                found[key] = hit[key]
        if hit.get("dataset"):
            found["dataset"] = hit["dataset"]
        return found

    def all_rows(self, batch_size: int = 1000) -> list[dict[str, Any]]:
        """Every row's payload and embedding (for checks and exports)."""
        iterator = self.home.call("cannot be read", "query_iterator", self.home.collection, batch_size=batch_size,
                                  filter="", output_fields=["key", "video", "folder", "dataset", "start", "end",
                                                            "embedding"])
        rows = []
        while True:
            page = iterator.next()
            if not page:
                iterator.close()
                return rows
            rows.extend(page)

    def nearest(self, query_embeddings: torch.Tensor, k: int, use_faiss: bool | None = None,
                filters: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` nearest rows of each query by cosine (Milvus' inner product), passing `filters`
        (`milvus_filter`)."""
        queries = query_embeddings.detach().float().cpu()
        if queries.ndim != 2 or (self.dim and queries.shape[1] != self.dim):
            raise ValueError(f"The queries have shape {tuple(queries.shape)}, but this index holds {self.dim}-d "
                             "embeddings: search it with the model that encoded it.")
        results = self.home.call(
            "cannot be searched", "search", self.home.collection, data=queries.tolist(),
            limit=max(1, min(int(k), self.max_results)), filter=milvus_filter(filters),
            output_fields=["video", "dataset", "start", "end", "embedding", "store", "row"],
            search_params={"metric_type": "IP", "params": search_params(self.home.search_params, int(k))})
        self.hits, self.hit_vectors = [], []
        width = max((len(hits) for hits in results), default=0)
        scores = torch.full((len(results), width), float("-inf"))
        rows = torch.full((len(results), width), -1, dtype=torch.long)
        for q, hits in enumerate(results):  # the filter is exact (`filters.milvus_filter`): every hit passes
            for j, hit in enumerate(hits):
                entity = hit["entity"]
                rows[q, j] = len(self.hits)
                scores[q, j] = float(hit["distance"])
                self.hits.append(entity)
                self.hit_vectors.append(torch.tensor(entity["embedding"], dtype=torch.float32))
        return scores, rows


__all__ = ["FILTER_KEYS", "SETTINGS_PROPERTY", "MilvusHome", "MilvusHomeError", "MilvusIndex", "matches",
           "milvus_filter", "row_key", "row_payload"]
