"""A video index in Milvus, through `pymilvus.MilvusClient`: the same code on an embedded Milvus Lite file
(``uri="videos.db"``), a ``milvus-lite server`` (``uri="http://127.0.0.1:19530"``), or a Milvus server or cluster.

Milvus holds each row's pooled embedding (L2-normalised: inner product = cosine) and a payload: the ``video``, the
moment's ``start``/``end`` (-1: the whole video), the ``dataset`` name and ``folder`` (the video's parent folder, to
filter by). The primary key is the row's key ``(video, start, end)``, so every write is an upsert: a resumed or
repeated run never duplicates a row, and the windows of one video are distinct rows. Re-ranking tokens are not kept
in Milvus; an index searched from Milvus ranks by cosine.

`pymilvus` is optional: it is imported when a `MilvusHome` is made (``pip install pymilvus milvus-lite``).

This file is Hub remote code: flat relative imports only, absolute imports of installed packages only.
"""

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from .indexing import Failure

NO_TIME = -1.0
"""`start`/`end` of a whole video in Milvus (which has no null scalars in every deployment)."""
FILTER_KEYS = ("video", "folder", "dataset")
"""The payload fields a search filter may name."""


def row_key(video: str, start: float | None, end: float | None) -> str:
    """The primary key of a row: the SHA-256 (hex) of its ``(video, start, end)`` as compact json (a digest, so that
    no path character reaches a Milvus expression)."""
    bounds = [None if value is None else float(value) for value in (start, end)]  # 25 and 25.0: one row
    return hashlib.sha256(json.dumps([str(video), *bounds], separators=(",", ":")).encode()).hexdigest()


def milvus_filter(filters: dict[str, Any] | None) -> str:
    """A Milvus boolean expression from ``{field: value or [values]}`` (fields of `FILTER_KEYS`; ``folder`` matches
    the videos under that folder, subfolders included). Raises ValueError naming an unknown field."""
    clauses = []
    for key, value in (filters or {}).items():
        if key not in FILTER_KEYS:
            raise ValueError(f"Unknown search filter {key!r}; use one of {FILTER_KEYS}.")
        values = [value] if isinstance(value, str) else list(value)
        if key == "folder":
            parts = [f"video like {json.dumps(folder_prefix(v) + '%', ensure_ascii=False)}" for v in values]
            clauses.append("(" + " or ".join(parts) + ")")
        else:
            clauses.append(f"{key} in {json.dumps([str(v) for v in values], ensure_ascii=False)}")
    return " and ".join(clauses)


def folder_prefix(folder: str) -> str:
    """A folder as the prefix of the paths under it (one trailing separator)."""
    return str(folder).rstrip("/\\") + "/"


def matches(entry: dict[str, Any], filters: dict[str, Any] | None) -> bool:
    """Whether a row's payload passes the filters (the same meaning as `milvus_filter`, in Python)."""
    for key, value in (filters or {}).items():
        if key not in FILTER_KEYS:
            raise ValueError(f"Unknown search filter {key!r}; use one of {FILTER_KEYS}.")
        values = [value] if isinstance(value, str) else list(value)
        if key == "folder":
            if not any(str(entry.get("video", "")).startswith(folder_prefix(v)) for v in values):
                return False
        elif str(entry.get(key)) not in [str(v) for v in values]:
            return False
    return True


def row_payload(video: str, start: float | None, end: float | None, dataset: str | None, vector: torch.Tensor,
                store: str = "", row: int = -1) -> dict[str, Any]:
    """One row as Milvus holds it (see the module docstring)."""
    return {"key": row_key(video, start, end), "embedding": vector.detach().float().tolist(), "video": str(video),
            "folder": os.path.dirname(str(video)), "dataset": dataset or "",
            "start": NO_TIME if start is None else float(start), "end": NO_TIME if end is None else float(end),
            "store": store, "row": int(row)}


class MilvusWriter:
    """The home writer of one shard (rows ``[start, stop)`` of the builder's entries) upserting into Milvus; each
    batch is one upsert. `done` holds the rows already in the collection (a resumed shard skips them)."""

    def __init__(self, home: "MilvusHome", entries: list[Any], start: int, stop: int, resume: bool = False):
        self.home, self.entries, self.start, self.stop = home, entries, start, stop
        self.failures: list[Failure] = []
        self.done: set[int] = set()
        if resume:  # the rows already there are not encoded again; without resume, every row is upserted again
            keys = {row_key(home.name_of(entries, i), entries[i].start, entries[i].end): i for i in range(start, stop)}
            self.done = {keys[key] for key in home.existing_keys(list(keys))}

    def __enter__(self) -> "MilvusWriter":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        pass

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
    A video index in a Milvus collection (see the module docstring).

    Args:
        uri (`str`): a Milvus Lite file (``"videos.db"``), or ``"http://host:port"`` of a server or cluster.
        collection (`str`, defaults to ``"videos"``): the collection's name.
        dim (`int`, *optional*): the embedding size; needed to create the collection (the builder's `info` gives
            it as ``projection_dim``).
        index_params (`dict`, *optional*): Milvus vector index (default: ``{"index_type": "HNSW", "params": {"M":
            32, "efConstruction": 200}}``; AUTOINDEX on a cluster is fine too). The metric is always inner product.
        search_params (`dict`, *optional*): per-search parameters (default ``{"ef": 256}``).
        token (`str`, *optional*): credentials of a secured server (``"user:password"``).
    """

    def __init__(self, uri: str, collection: str = "videos", dim: int | None = None,
                 index_params: dict[str, Any] | None = None, search_params: dict[str, Any] | None = None,
                 token: str | None = None):
        try:
            import pymilvus  # optional: only a Milvus home needs it
        except ImportError as error:
            raise ImportError("A Milvus home needs pymilvus (pip install pymilvus milvus-lite).") from error
        self.pymilvus = pymilvus
        self.uri, self.collection, self.dim = str(uri), collection, dim
        self.index_params = index_params or {"index_type": "HNSW", "params": {"M": 32, "efConstruction": 200}}
        self.search_params = search_params or {"ef": 256}
        self.client = pymilvus.MilvusClient(uri=self.uri, token=token or "")
        self.failures: list[Failure] = []

    # -- writing -----------------------------------------------------------------------------------------------------

    @staticmethod
    def name_of(entries: list[Any], i: int) -> str:
        return entries[i].name(i)

    def ensure_collection(self, dim: int) -> None:
        """Creates the collection (key, embedding, payload) unless it exists."""
        DataType = self.pymilvus.DataType  # noqa: N806

        if self.client.has_collection(self.collection):
            return
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
        try:
            self.client.create_collection(self.collection, schema=schema, index_params=index_params)
        except Exception:  # noqa: BLE001  another writer (a process of the same launch) may have created it first
            if not self.client.has_collection(self.collection):
                raise

    def writer(self, shard: int, start: int, stop: int, resume: bool = False, entries: list[Any] | None = None
               ) -> MilvusWriter:
        if entries is None:
            raise ValueError("A Milvus writer needs the builder's entries (VideoIndexBuilder passes them).")
        self.ensure_collection(self.dim)
        writer = MilvusWriter(self, entries, start, stop, resume)
        self._writers = getattr(self, "_writers", []) + [writer]
        return writer

    def payload(self, entries: list[Any], i: int, vector: torch.Tensor) -> dict[str, Any]:
        entry, name = entries[i], self.name_of(entries, i)
        return row_payload(name, entry.start, entry.end, entry.dataset, vector)

    def upsert_store_shard(self, directory: str | os.PathLike, start: int, stop: int, shard: int,
                           entries: list[Any], chunk: int = 1000) -> int:
        """Upserts the encoded rows ``[start, stop)`` of a closed store shard (its embeddings, and the store and row
        where their tokens are), each with its `IndexEntry` of `entries` (the store's rows: `StoreHome.entries`,
        their moments from the plan's segments); returns how many. Idempotent: a repeated or resumed run rewrites
        the same rows."""
        from .video_store import open_safetensors

        directory = os.path.abspath(os.fspath(directory))
        tensors = open_safetensors(os.path.join(directory, f"shard-{int(shard):05d}.safetensors"))
        embeddings, rows = tensors["embeddings"], tensors["rows"]
        self.ensure_collection(self.dim or int(embeddings.shape[1]))
        payloads = []
        for local in range(stop - start):
            if int(rows[local]) < 0:  # a failed video: never a search result
                continue
            i = start + local
            entry = entries[i]
            payloads.append(row_payload(entry.name(i), entry.start, entry.end, entry.dataset, embeddings[local],
                                        store=directory, row=i))
        for begin in range(0, len(payloads), chunk):
            self.upsert(payloads[begin : begin + chunk])
        return len(payloads)

    def upsert(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.client.upsert(self.collection, rows)

    def existing_keys(self, keys: list[str], chunk: int = 512) -> set[str]:
        """The given keys that the collection holds."""
        found: set[str] = set()
        if not self.client.has_collection(self.collection):
            return found
        for begin in range(0, len(keys), chunk):
            part = keys[begin : begin + chunk]
            rows = self.client.query(self.collection, filter=f"key in {json.dumps(part)}", output_fields=["key"])
            found.update(row["key"] for row in rows)
        return found

    def finish(self, entries: Any, info: dict[str, Any], num_shards: int | None = None,
               stats: dict[str, Any] | None = None, **options: Any) -> "MilvusIndex":
        """Flushes and loads the collection; returns the searchable `MilvusIndex`."""
        self.ensure_collection(self.dim or int(info.get("projection_dim") or 0))
        self.client.flush(self.collection)
        self.failures = [f for writer in getattr(self, "_writers", []) for f in writer.failures]
        index = self.open(info)
        index.stats = dict(stats or {})
        return index

    def open(self, info: dict[str, Any] | None = None, tokens_from_stores: bool = False) -> "MilvusIndex":
        """The collection, searchable (`MilvusIndex`; `tokens_from_stores`: re-rank with the tokens of the stores
        its rows name)."""
        self.client.flush(self.collection)
        self.client.load_collection(self.collection)
        return MilvusIndex(self, dict(info or {}), list(self.failures), tokens_from_stores)


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
                 tokens_from_stores: bool = False):
        self.home, self.info, self.failures = home, info, failures
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
            from .video_store import VideoTokenStore

            self._stores[directory] = VideoTokenStore(directory)
        return self._stores[directory]

    def __len__(self) -> int:
        return int(self.home.client.get_collection_stats(self.home.collection)["row_count"])

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
        iterator = self.home.client.query_iterator(self.home.collection, batch_size=batch_size, filter="",
                                                   output_fields=["key", "video", "folder", "dataset", "start", "end",
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
        results = self.home.client.search(
            self.home.collection, data=queries.tolist(), limit=max(1, int(k)), filter=milvus_filter(filters),
            output_fields=["video", "dataset", "start", "end", "embedding", "store", "row"],
            search_params={"metric_type": "IP", "params": self.home.search_params})
        self.hits, self.hit_vectors = [], []
        width = max((len(hits) for hits in results), default=0)
        scores = torch.full((len(results), width), float("-inf"))
        rows = torch.full((len(results), width), -1, dtype=torch.long)
        for q, hits in enumerate(results):
            # `like` treats `_` and `%` in a folder's name as wildcards: Milvus' hits are a superset, kept exact here
            hits = [hit for hit in hits if matches(hit["entity"], filters)]
            for j, hit in enumerate(hits):
                entity = hit["entity"]
                rows[q, j] = len(self.hits)
                scores[q, j] = float(hit["distance"])
                self.hits.append(entity)
                self.hit_vectors.append(torch.tensor(entity["embedding"], dtype=torch.float32))
        return scores, rows


__all__ = ["FILTER_KEYS", "MilvusHome", "MilvusIndex", "matches", "milvus_filter", "row_key"]
