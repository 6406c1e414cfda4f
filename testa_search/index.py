"""An encoded video collection, searched without decoding again: `VideoIndex`, and its first-stage search
(`nearest`: a FAISS index built once, kept and saved beside the embeddings; exact torch search without FAISS).

An index holds the L2-normalised contrastive embedding of every video (the first stage) and, optionally, the
aggregated tokens the matching head cross-attends to (the second stage). It lives in memory, or is backed by an
on-disk video store (`video_store.py`), which `VideoTextRetrievalPipeline.encode_videos(..., store_dir=...)` and the
training evaluation write (both through `encoding.encode_videos`). Two-stage search is
`VideoTextRetrievalPipeline.search`.

FAISS is optional: imported where a first stage needs it (`faiss_module`).
"""

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from testa_search.filters import matches
from testa_search.settings import (
    IndexSettingsError,
    check_settings,
    check_store_folder,
    recorded_store_settings,
    write_json_atomically,
)
from testa_search.encoding import Failure
from testa_search.store.lock import StoreLock
from testa_search.store.video_store import (
    PLAN_FILE,
    STORE_INFO_FILE,
    DamagedStoreError,
    VideoStoreWriter,
    VideoTokenStore,
    finalize_store,
    is_video_store,
    load_safetensors,
    read_json_file,
    replace_file,
)


INDEX_TENSORS_FILE = "video_index.safetensors"
INDEX_INFO_FILE = "video_index.json"
FIRST_STAGE_FILE = "first_stage.faiss"
FIRST_STAGE_INFO_FILE = "first_stage.json"

logger = logging.getLogger(__name__)


def video_name(item: Any, index: int) -> str:
    """How a video of a collection is named in an index: its path, or ``videos[i]`` for an in-memory video."""
    return os.fspath(item) if isinstance(item, (str, os.PathLike)) else f"videos[{index}]"


def faiss_module() -> Any:
    """The `faiss` module when installed, else None."""
    try:
        import faiss  # optional dependency
    except ImportError:
        return None
    return faiss


# ---------------------------------------------------------------------------------------------------- first stage

# Up to this many encoded videos the first stage is exact (`IndexFlatIP`: one pass over the fp32 embeddings per
# query, about 1 KB per 256-d video); above it, approximate (see `FirstStage`).
EXACT_MAX_VIDEOS = 50_000
APPROXIMATE_KIND = "pq"
FIRST_STAGE_KINDS = ("flat", "pq", "hnsw", "ivf")
# PQ: dimensions per 4-bit sub-quantizer (2: 1 byte for 4 dims that take 16 bytes in fp32), training
# sample; HNSW: graph degree, build and search beam; IVF: lists (times sqrt(count)) and lists probed.
DEFAULT_PARAMETERS = {
    "flat": {},
    "pq": {"dims_per_subquantizer": 2, "train_size": 65_536},
    "hnsw": {"M": 32, "ef_construction": 80, "ef_search": 256},
    "ivf": {"nlist_per_sqrt": 4, "nprobe": 256},
}
# An approximate stage fetches this many times `k` candidates (at least `MIN_CANDIDATES`) and re-scores them exactly.
CANDIDATE_MULTIPLE = 16
MIN_CANDIDATES = 1024


_warned_exact_fallback = False


def warn_exact_fallback(count: int) -> None:
    """Warns once per process when an index of more than `EXACT_MAX_VIDEOS` videos is searched without FAISS: exact
    torch top-k reads every embedding per query (measured: 75 ms per query at 1M 256-d videos, against 5.8 ms with
    FAISS; docs/inference.md)."""
    global _warned_exact_fallback
    if count > EXACT_MAX_VIDEOS and not _warned_exact_fallback:
        _warned_exact_fallback = True
        logger.warning("Searching %d videos without faiss: exact torch top-k reads every embedding for each query "
                       "(about 75 ms per query at 1M 256-d videos, 13x the faiss first stage). Install it: "
                       "pip install faiss-cpu (or the package's `faiss` extra).", count)


def first_stage_kind(count: int, exact_max_videos: int = EXACT_MAX_VIDEOS) -> str:
    """The first stage for `count` encoded videos: ``"flat"`` (exact) up to `exact_max_videos`, else approximate."""
    return "flat" if count <= exact_max_videos else APPROXIMATE_KIND


def pq_subquantizers(dim: int, dims_per_subquantizer: int) -> int:
    """Sub-quantizers of a 4-bit fast-scan PQ over `dim`-d vectors: about ``dim / dims_per_subquantizer``, even (what
    the fast-scan kernels need) and dividing `dim`; raises ValueError when `dim` has no even divisor."""
    target = max(2, dim // max(1, int(dims_per_subquantizer)))
    divisors = [m for m in range(2, dim + 1, 2) if dim % m == 0]
    if not divisors:
        raise ValueError(f"A PQ first stage needs an even embedding size, got {dim}; use kind='hnsw' or 'flat'.")
    return min(divisors, key=lambda m: (abs(m - target), -m))


def candidate_count(k: int, count: int) -> int:
    """Candidates an approximate first stage fetches for `k` results: ``max(k * CANDIDATE_MULTIPLE,
    MIN_CANDIDATES)``, capped at `count`."""
    return min(count, max(k * CANDIDATE_MULTIPLE, MIN_CANDIDATES))


def embeddings_fingerprint(embeddings: torch.Tensor, rows: torch.Tensor | None) -> str:
    """SHA-256 of up to 16 evenly spaced encoded rows (and their positions): tells a saved first stage built from
    other embeddings of the same shape, without reading the collection."""
    count = embeddings.shape[0] if rows is None else rows.numel()
    digest = hashlib.sha256(f"{count}:{embeddings.shape[1]};".encode())
    for position in sorted({count * j // 16 for j in range(16)} & set(range(count))):
        row = position if rows is None else int(rows[position])
        digest.update(f"{row};".encode())
        digest.update(embeddings[row].detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def as_float32_array(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous float32 numpy view of a CPU tensor (a copy only when its dtype or layout differ)."""
    return np.ascontiguousarray(tensor.detach().cpu().float().numpy(), dtype=np.float32)


def exact_nearest(queries: torch.Tensor, embeddings: torch.Tensor, rows: torch.Tensor | None,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-`k` by inner product in torch over the given `rows` of `embeddings` (all for None)."""
    database = embeddings.float() if rows is None else embeddings[rows].float()
    scores, indices = (queries @ database.T).topk(k, dim=1)
    return scores, (indices if rows is None else rows[indices])


def gather_rows(embeddings: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``embeddings[rows]`` as float32. A float32 CPU tensor is gathered by numpy: a few hundred rows are a small
    copy, which torch's index kernel would split over its threads (costly when the cores are busy)."""
    if embeddings.dtype == torch.float32 and embeddings.device.type == "cpu":
        return torch.from_numpy(embeddings.detach().numpy()[rows.numpy()])
    return embeddings[rows].float()


def rescore(queries: torch.Tensor, embeddings: torch.Tensor, candidates: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact cosines of each query's candidate rows (``-1``: none), and the `k` best: ``(scores, rows)``, the
    scores ``-inf`` and rows ``-1`` where a query had fewer than `k` candidates."""
    found = candidates >= 0
    safe = candidates.clamp(min=0)
    vectors = gather_rows(embeddings, safe.flatten()).view(*safe.shape, -1)
    exact = (vectors @ queries.unsqueeze(-1)).squeeze(-1).masked_fill(~found, float("-inf"))
    scores, order = exact.topk(min(k, exact.shape[1]), dim=1)
    rows = safe.gather(1, order).masked_fill(~torch.isfinite(scores), -1)
    return scores, rows


def build_faiss_index(faiss: Any, vectors: np.ndarray, kind: str, parameters: dict[str, Any],
                      progress_bar: bool = False) -> Any:
    """A FAISS inner-product index of `kind` over `vectors` ``(count, dim)`` float32 (added in chunks, with a
    progress bar when asked)."""
    count, dim = vectors.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "pq":
        index = faiss.IndexPQFastScan(dim, pq_subquantizers(dim, parameters["dims_per_subquantizer"]), 4,
                                      faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(0).choice(count, size=min(count, int(parameters["train_size"])),
                                                 replace=False)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)  # 128 tiny k-means: thousands of parallel regions, each too short to share
        try:
            index.train(vectors[np.sort(sample)])
        finally:
            faiss.omp_set_num_threads(threads)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(parameters["M"]), faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = int(parameters["ef_construction"])
        index.hnsw.efSearch = int(parameters["ef_search"])
    elif kind == "ivf":
        nlist = max(1, min(count, int(parameters["nlist_per_sqrt"] * count**0.5)))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
        sample = np.random.default_rng(0).choice(count, size=min(count, 64 * nlist), replace=False)
        index.train(vectors[np.sort(sample)])
        index.nprobe = min(nlist, int(parameters["nprobe"]))
    else:
        raise ValueError(f"Unknown first-stage kind {kind!r}; use one of {FIRST_STAGE_KINDS}.")
    chunk = 50_000
    starts = range(0, count, chunk)
    if progress_bar and count > chunk:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"first stage ({kind})", unit="chunk")
    for start in starts:
        index.add(vectors[start : start + chunk])
    return index


class FirstStage:
    r"""
    The first stage of a [`VideoIndex`]: a FAISS inner-product index over its encoded videos (a failed row of a
    store is left out, and FAISS ids are mapped back to index rows), built once, kept, saved beside the embeddings
    (`first_stage.faiss` and `first_stage.json`) and reloaded with them.

    - ``"flat"`` (`IndexFlatIP`, exact) up to `EXACT_MAX_VIDEOS` encoded videos.
    - ``"pq"`` above: a 4-bit product quantizer scanned with FAISS's fast-scan kernels (`IndexPQFastScan`, one
      sub-quantizer per 2 dimensions: 64 bytes per 256-d video instead of 1 KB), whose candidates are re-scored
      exactly. Chosen by measurement (`benchmarks/search_scale.py`, numbers in docs/inference.md) on random unit
      vectors, the worst case for approximate search (random points have no clusters or neighbourhoods for a
      sub-linear index to exploit), neither of the two usual sub-linear indexes came near recall@10 0.99. At
      100k (2 threads), HNSW (M=32, efSearch 1024) reached recall 0.90 in 34 ms per query after a 333 s build, IVF
      (nlist = 4 sqrt(N), nprobe 256) 0.54 in 4.7 ms, the PQ scan 1.00 in 0.8 ms after a 5 s build. It reads 16x
      fewer bytes than the exact scan, its ranking errors are small enough that the true top 10 lie among its first
      1024 candidates, and it is small (saved and reopened with the index). It is still a scan: its time grows
      linearly with the collection.
    - ``"hnsw"`` (`IndexHNSWFlat`) and ``"ivf"`` (`IndexIVFFlat`) are kept for comparison
      (`VideoIndex.build_first_stage(kind=...)`); on real, clustered embeddings they may be the better choice.

    An approximate stage fetches `candidate_count(k)` candidates and re-scores them exactly by dot product with the
    stored embeddings, so the returned scores are cosines and the order is the exact order of the candidates.
    Per query, what follows the FAISS search (re-scoring, results) is O(k + candidates); the FAISS search itself
    scans every video for ``"flat"`` and ``"pq"`` (16x fewer bytes for the latter) and only HNSW/IVF are
    sub-linear.

    Attributes:
        index: the FAISS index; kind (`str`); parameters (`dict`); rows (`torch.LongTensor` or None): the index row
        of each FAISS id (None: the id is the row); num_videos (`int`): rows of the `VideoIndex` it was built for.
    """

    def __init__(self, index: Any, kind: str, parameters: dict[str, Any], rows: torch.Tensor | None,
                 num_videos: int, fingerprint: str):
        self.index, self.kind, self.parameters = index, kind, dict(parameters)
        self.rows, self.num_videos, self.fingerprint = rows, int(num_videos), fingerprint

    @property
    def count(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @classmethod
    def build(cls, faiss: Any, embeddings: torch.Tensor, rows: torch.Tensor | None, kind: str,
              parameters: dict[str, Any] | None = None, progress_bar: bool = False) -> "FirstStage":
        """Builds the stage of `kind` over `rows` of `embeddings` (all for None)."""
        if kind not in FIRST_STAGE_KINDS:
            raise ValueError(f"Unknown first-stage kind {kind!r}; use one of {FIRST_STAGE_KINDS}.")
        parameters = {**DEFAULT_PARAMETERS[kind], **(parameters or {})}
        vectors = as_float32_array(embeddings if rows is None else embeddings[rows])
        index = build_faiss_index(faiss, vectors, kind, parameters, progress_bar)
        return cls(index, kind, parameters, rows, embeddings.shape[0], embeddings_fingerprint(embeddings, rows))

    def search(self, faiss: Any, queries: torch.Tensor, k: int,
               embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` (at most `count`) best rows per query and their cosines; approximate kinds re-score their
        candidates exactly. Rows are ``-1`` (scores ``-inf``) where an approximate stage found fewer than `k`."""
        array = as_float32_array(queries)
        if self.kind == "flat":
            scores, ids = self.index.search(array, k)
            return torch.from_numpy(scores), self.to_rows(torch.from_numpy(ids).long())
        fetch = candidate_count(k, self.count)
        if self.kind == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(int(self.parameters["ef_search"]), fetch))
        elif self.kind == "ivf":
            params = faiss.SearchParametersIVF(nprobe=self.index.nprobe)
        else:
            params = None
        _, ids = self.index.search(array, fetch, params=params)
        return rescore(queries, embeddings, self.to_rows(torch.from_numpy(ids).long()), k)

    def to_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """FAISS ids to index rows (``-1`` stays ``-1``)."""
        if self.rows is None:
            return ids
        return torch.where(ids >= 0, self.rows[ids.clamp(min=0)], ids)

    def add(self, embeddings: torch.Tensor, first_row: int, all_embeddings: torch.Tensor) -> None:
        """Appends vectors for the index rows ``first_row, first_row + 1, ...`` (an in-memory index's `add`)."""
        self.index.add(as_float32_array(embeddings))
        if self.rows is not None:
            self.rows = torch.cat([self.rows, torch.arange(first_row, first_row + embeddings.shape[0])])
        self.num_videos = all_embeddings.shape[0]
        self.fingerprint = embeddings_fingerprint(all_embeddings, self.rows)

    def save(self, faiss: Any, directory: str | os.PathLike) -> None:
        """Writes `first_stage.faiss` and `first_stage.json` (kind, count, dim, parameters, what it was built
        from) into `directory`."""
        directory = Path(directory)
        # Written beside and renamed into place: a reader that memory-mapped the old file (`load`) keeps its own
        # copy instead of crashing (SIGBUS) on a file truncated under it; the json goes last, and a reader that
        # meets a new json with the old index sees the count differ and rebuilds.
        partial = directory / f".{FIRST_STAGE_FILE}.partial"
        faiss.write_index(self.index, str(partial))
        os.replace(partial, directory / FIRST_STAGE_FILE)
        meta = {"kind": self.kind, "count": self.count, "dim": self.dim, "num_videos": self.num_videos,
                "parameters": self.parameters, "fingerprint": self.fingerprint}
        replace_file(directory / FIRST_STAGE_INFO_FILE, json.dumps(meta, indent=1))

    @classmethod
    def load(cls, faiss: Any, directory: str | os.PathLike, embeddings: torch.Tensor,
             rows: torch.Tensor | None) -> "FirstStage | None":
        """The stage saved in `directory`, or None when there is none, it is stale (built from other embeddings:
        another count, dim or fingerprint) or a file of it is damaged; it is then rebuilt (a warning names the file),
        never used. The FAISS file is memory-mapped where FAISS can (`IO_FLAG_MMAP`), else read once."""
        directory = Path(directory)
        meta_path, path = directory / FIRST_STAGE_INFO_FILE, directory / FIRST_STAGE_FILE
        if not (meta_path.is_file() and path.is_file()):
            return None
        try:  # unreadable (damaged): rebuilt, as a stale or unreadable FAISS file is (the first stage is derived)
            meta = read_json_file(meta_path)
            if not isinstance(meta, dict):
                raise DamagedStoreError(meta_path, "not a JSON object")
        except DamagedStoreError as error:
            logger.warning("Ignoring the unreadable first stage %s (%s); it will be rebuilt.", meta_path, error.reason)
            return None
        count = embeddings.shape[0] if rows is None else rows.numel()
        expected = {"count": count, "dim": int(embeddings.shape[1]), "num_videos": int(embeddings.shape[0])}
        stale = {key: (meta.get(key), value) for key, value in expected.items() if meta.get(key) != value}
        if not stale and meta.get("fingerprint") != embeddings_fingerprint(embeddings, rows):
            stale["fingerprint"] = ("saved", "current")
        if stale or meta.get("kind") not in FIRST_STAGE_KINDS:
            logger.warning("Ignoring the stale first stage in %s (saved vs current: %s); it will be rebuilt.",
                           directory, stale or {"kind": meta.get("kind")})
            return None
        try:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP)
        except RuntimeError:
            try:
                index = faiss.read_index(str(path))
            except RuntimeError as error:  # unreadable (torn by a crash): rebuilt, as a stale one
                logger.warning("Ignoring the unreadable first stage %s (%s); it will be rebuilt.", path, error)
                return None
        if int(index.ntotal) != count or int(index.d) != expected["dim"]:
            logger.warning("Ignoring the stale first stage in %s (it holds %d vectors of dim %d).", directory,
                           index.ntotal, index.d)
            return None
        return cls(index, meta["kind"], meta.get("parameters", {}), rows, embeddings.shape[0], meta["fingerprint"])


ROW_FIELDS = ("dataset",)
"""Optional per-row fields of an index (`VideoIndex.row_fields`), carried by every home and into search results. A
row's `start`/`end` are not among them: they live in `VideoIndex.segments`."""


def segments_tensor(segments: list[Any] | None) -> torch.Tensor | None:
    """`VideoIndex.segments` from a list of ``[start, end]`` or None (a whole video) per row, as a store's info and
    a store plan keep them; None for None."""
    if segments is None:
        return None
    return torch.tensor([pair if pair is not None else [float("nan")] * 2 for pair in segments],
                        dtype=torch.float64).reshape(-1, 2)


def failure_moment(failure: Failure, segments: torch.Tensor) -> Failure:
    """`failure` with the `start`/`end` of its row (`failure.index`) in `segments` (NaN: a whole video)."""
    if failure.index is None or not 0 <= failure.index < segments.shape[0] or failure.start is not None:
        return failure
    start, end = segments[failure.index].tolist()
    if start != start:  # NaN
        return failure
    return dataclasses.replace(failure, start=float(start), end=float(end))


def as_failures(failures: Any) -> list[Failure]:
    """`Failure` records from a list of records or of their dicts (`Failure.as_dict`), or from the
    ``{video: reason}`` dict an earlier version kept (code ``"unknown"``)."""
    if isinstance(failures, dict):
        return [Failure(str(video), "unknown", str(reason)) for video, reason in failures.items()]
    return [f if isinstance(f, Failure) else Failure.from_dict(f) for f in failures or []]


@dataclass
class VideoIndex:
    r"""
    A collection of videos encoded once by [`VideoTextRetrievalPipeline.encode_videos`].

    Two forms, searched the same way by [`VideoTextRetrievalPipeline.search`]:

    - in memory (default): `tokens` and `token_sizes` are tensors; every video in it was encoded (the ones that
      could not be are listed in `failures`). `add` appends another in-memory index.
    - backed by an on-disk video store (`encode_videos(..., store_dir=DIR)` or `VideoIndex.load(DIR)` of a store, see
      `video_store.py`, the format the training evaluation writes too): `embeddings` are memory-mapped, while
      `tokens` and `token_sizes` are lazy tensor-likes whose indexing (`index.tokens[candidates]`) reads only those
      videos from disk; a video that could not be encoded keeps its row but is never returned (`valid`). A
      collection is indexed once and searched many times with memory bounded by the candidates.

    The first stage (`nearest`) is a FAISS index built once (`build_first_stage`, or on the first search), kept,
    saved beside the embeddings by `save` and reloaded by `load` (see `FirstStage`).

    Args:
        videos (`list`): the videos as given (paths, or arrays for in-memory videos); after `load`, their names.
        embeddings (`torch.FloatTensor` of shape `(num_videos, projection_dim)`): L2-normalised contrastive video
            embeddings (`model.get_video_features`), used for the first stage.
        tokens (`torch.Tensor` of shape `(num_videos, tokens, hidden_size)`, *optional*): the aggregated video tokens
            the matching head cross-attends to, for the second (re-ranking) stage (lazy when store-backed).
        token_sizes (`torch.FloatTensor` of shape `(num_videos, tokens)`, *optional*): input patches per token.
        info (`dict`): how the index was built (model class, frames, ...); saved with it.
        store (`VideoTokenStore`, *optional*): the on-disk store backing `tokens`, when there is one.
        failures (`list[Failure]`): the videos (or moments) that could not be encoded, each with its code and reason,
            in the order met; saved with the index.
        row_fields (`dict[str, list]`): optional per-row fields (`ROW_FIELDS`), each a list of `len(videos)`
            values (None: absent): ``dataset`` (a name to filter by). Saved with the index; search results carry
            them. A moment's `start`/`end` are in `segments`.
        stats (`dict`): how fast `encode_videos` built it (not saved): `videos`, `seconds` (wall time),
            `videos_per_second`, `decode_wait_seconds` (time the encoder waited for decoded videos; all the decoding
            time without workers), `encode_seconds` (encoder forwards) and `num_workers`.
        exact_max_videos (`int`, defaults to `EXACT_MAX_VIDEOS`): up to this many encoded videos the first stage is
            exact, above it approximate (not saved).
        segments (`torch.Tensor` of shape `(num_videos, 2)`, *optional*): for an index of moments
            (`encode_videos(..., window=)`), the `(start, end)` seconds of every row in its video (`videos[i]` names
            the video); NaN for a row that is a whole video; `None` when every row is a whole video. Saved with the
            index (either format), and the one place a row's start and end live (`moment`, `row_key`, `entry`).

    Attributes:
        skipped (`list[str]`): the videos the last `add` left out because the index already held them.
    """

    videos: list[Any]
    embeddings: torch.Tensor
    tokens: Any = None
    token_sizes: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    store: VideoTokenStore | None = None
    failures: list[Failure] = field(default_factory=list)
    row_fields: dict[str, list[Any]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    exact_max_videos: int = field(default=EXACT_MAX_VIDEOS, compare=False, repr=False)
    segments: torch.Tensor | None = None
    skipped: list[str] = field(default_factory=list, init=False, compare=False, repr=False)
    first_stage: FirstStage | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.videos)
        if self.embeddings.ndim != 2 or self.embeddings.shape[0] != n:
            raise ValueError(f"`embeddings` must be ({n}, dim) for {n} videos, got {tuple(self.embeddings.shape)}.")
        for name in ("tokens", "token_sizes"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise ValueError(f"`{name}` has {value.shape[0]} rows for {n} videos.")
        self.failures = as_failures(self.failures)
        self.row_fields = {key: list(values) for key, values in (self.row_fields or {}).items()}
        for key, values in self.row_fields.items():
            if key not in ROW_FIELDS or len(values) != n:
                raise ValueError(f"`row_fields[{key!r}]` must be one of {ROW_FIELDS} with {n} values, got "
                                 f"{len(values)} values.")
        if self.segments is not None:
            self.segments = torch.as_tensor(self.segments, dtype=torch.float64)
            if tuple(self.segments.shape) != (n, 2):
                raise ValueError(f"`segments` must be ({n}, 2) (start, end) seconds for {n} rows, got "
                                 f"{tuple(self.segments.shape)}.")

    def __len__(self) -> int:
        return len(self.videos)

    def moment(self, row: int) -> tuple[float | None, float | None]:
        """`(start, end)` seconds of a row in its video; `(None, None)` for a whole video."""
        if self.segments is None or bool(torch.isnan(self.segments[row]).any()):
            return None, None
        start, end = self.segments[row].tolist()
        return float(start), float(end)

    def row_keys(self) -> list[tuple[str, float | None, float | None]]:
        """`(video name, start, end)` of every row: what tells two rows apart (a video's moments share its name)."""
        return [self.row_key(i) for i in range(len(self))]

    @property
    def names(self) -> list[str]:
        """The videos' paths (or `videos[i]` for in-memory videos), as saved in the json file."""
        return [video_name(item, i) for i, item in enumerate(self.videos)]

    def row_field(self, key: str, row: int) -> Any:
        """The per-row field `key` (`ROW_FIELDS`) of `row`, None when absent."""
        values = self.row_fields.get(key)
        return None if values is None else values[row]

    def entry(self, row: int) -> dict[str, Any]:
        """What a search result says of `row`: ``{"video"}``, ``start`` and ``end`` in an index of moments (None for
        a whole video among them, `moment`), and ``dataset`` when set."""
        found = {"video": self.videos[row]}
        if self.segments is not None:
            found["start"], found["end"] = self.moment(row)
        for key in ROW_FIELDS:
            value = self.row_field(key, row)
            if value is not None:
                found[key] = value
        return found

    def row_key(self, row: int) -> tuple[str, float | None, float | None]:
        """``(name, start, end)``: what tells two rows apart (the windows of one video are distinct rows)."""
        return (video_name(self.videos[row], row), *self.moment(row))

    @property
    def dim(self) -> int:
        """The embedding size (the model's `projection_dim`)."""
        return int(self.embeddings.shape[1])

    @property
    def has_tokens(self) -> bool:
        """Whether the aggregated tokens are stored, i.e. whether search can re-rank with the matching head."""
        return self.tokens is not None

    @property
    def valid(self) -> torch.Tensor:
        """`(num_videos,)` bool: the videos that were encoded (a store may hold videos that could not be decoded;
        they are never returned by `nearest`)."""
        return self.store.valid if self.store is not None else torch.ones(len(self), dtype=torch.bool)

    @property
    def num_encoded(self) -> int:
        """How many videos can be returned (`valid` ones)."""
        return len(self) if self.store is None else self.store.num_valid

    def encoded_rows(self) -> torch.Tensor | None:
        """The rows of the encoded videos, or None when all are (the common case, no tensor allocated)."""
        return None if self.num_encoded == len(self) else self.valid.nonzero().flatten()

    @classmethod
    def from_store(cls, store: "VideoTokenStore | str | os.PathLike", first_stage: bool = True) -> "VideoIndex":
        """An index over an on-disk video store (a `VideoTokenStore` or its directory); its saved first stage is
        opened when FAISS is installed, it is current and `first_stage` is True."""
        if not isinstance(store, VideoTokenStore):
            store = VideoTokenStore(store)
        info = dict(store.info)
        # an index of moments (train.index --window) keeps its rows' (start, end) in the store's info
        segments = segments_tensor(info.pop("segments", None))
        failures = [Failure.from_dict(f) for f in store.failures]
        if segments is not None:  # a failed row's moment, from the row's segment
            failures = [failure_moment(f, segments) for f in failures]
        index = cls(videos=list(store.videos), embeddings=store.embeddings, tokens=store.tokens,
                    token_sizes=store.token_sizes, info=info, store=store, failures=failures,
                    row_fields=dict(store.meta.get("row_fields") or {}), segments=segments)
        if first_stage:
            index.load_first_stage(store.directory)
        return index

    # -- the first stage ---------------------------------------------------------------------------------------------

    def build_first_stage(self, kind: str | None = None, parameters: dict[str, Any] | None = None,
                          progress_bar: bool | None = None) -> FirstStage:
        """Builds the FAISS first stage (exact ``"flat"`` up to `exact_max_videos` encoded videos, else
        `APPROXIMATE_KIND`; or the given `kind` and `parameters`, see `FirstStage`) and keeps it. Requires faiss."""
        faiss = faiss_module()
        if faiss is None:
            raise ImportError("The first stage needs `faiss` (pip install faiss-cpu).")
        kind = first_stage_kind(self.num_encoded, self.exact_max_videos) if kind is None else kind
        show = self.num_encoded > EXACT_MAX_VIDEOS if progress_bar is None else bool(progress_bar)
        self.first_stage = FirstStage.build(faiss, self.embeddings, self.encoded_rows(), kind, parameters, show)
        return self.first_stage

    def load_first_stage(self, directory: str | os.PathLike) -> FirstStage | None:
        """Opens the first stage saved in `directory` when FAISS is installed and the file is current (a stale one
        is ignored: `nearest` rebuilds it); keeps it and returns it (None when none was opened)."""
        faiss = faiss_module()
        stage = None if faiss is None else FirstStage.load(faiss, directory, self.embeddings, self.encoded_rows())
        if stage is not None:
            self.first_stage = stage
        return stage

    def save_first_stage(self, directory: str | os.PathLike | None = None) -> Path | None:
        """Writes an approximate first stage (built now if it is not yet) as `first_stage.faiss` and
        `first_stage.json` into `directory` (default: the store's directory). Returns the FAISS file, or None when
        there is nothing to write: without FAISS, or when the first stage is exact (`IndexFlatIP` holds a copy of
        the embeddings and is rebuilt from them in one pass on the first search; saving it would store them twice),
        in which case saved first-stage files left in `directory` by a larger collection are removed."""
        faiss = faiss_module()
        if faiss is None:
            return None
        if directory is None:
            if self.store is None:
                raise ValueError("save_first_stage needs a directory for an index that is not backed by a store.")
            directory = self.store.directory
        directory = Path(directory)
        stage = self.current_first_stage()
        if stage is None and first_stage_kind(self.num_encoded, self.exact_max_videos) != "flat":
            stage = self.build_first_stage()
        if stage is None or stage.kind == "flat":
            for name in (FIRST_STAGE_FILE, FIRST_STAGE_INFO_FILE):
                (directory / name).unlink(missing_ok=True)
            return None
        stage.save(faiss, directory)
        return directory / FIRST_STAGE_FILE

    def current_first_stage(self) -> FirstStage | None:
        """The kept first stage if it still describes the embeddings (count and dim), else None."""
        stage = self.first_stage
        if stage is None or stage.count != self.num_encoded or stage.dim != self.dim or stage.num_videos != len(self):
            return None
        return stage

    # -- growing an in-memory index ----------------------------------------------------------------------------------

    def add(self, other: "VideoIndex") -> "VideoIndex":
        """Appends the rows of `other` (in place; returns `self`). A row whose key (`row_key`: the video's path
        and its `start`/`end`) the index already holds is skipped and listed in `skipped`; in-memory videos
        (arrays) are always appended. `other`'s failures are merged, and a row that failed before and is now encoded
        leaves `failures`. The first stage, when built, grows with the new vectors (or is rebuilt on the next search
        when the collection crosses `exact_max_videos`).

        Raises:
            ValueError: when the two indexes disagree on the embedding size, on having tokens or token sizes, on
                the token shape or dtypes, or on a setting of `info` (`settings.IndexInfo`); the message names the field and
                both values. Also for a store-backed index, which grows on disk:
                ``pipe.encode_videos(more, index=index)`` or ``python -m train.index --store DIR --videos MORE``.
        """
        if self.store is not None:
            raise ValueError(
                f"This index is backed by the video store {str(self.store.directory)!r}, which grows on disk: "
                f"`pipe.encode_videos(more, index=index)` or `python -m train.index --store "
                f"{self.store.directory} --videos MORE`."
            )
        self.check_compatible(other)
        known = {key for item, key in zip(self.videos, self.row_keys()) if isinstance(item, (str, os.PathLike))}
        take, skipped = [], []
        for i, (item, key) in enumerate(zip(other.videos, other.row_keys())):
            if not bool(other.valid[i]):
                continue
            if isinstance(item, (str, os.PathLike)) and key in known:
                skipped.append(key[0])
                continue
            take.append(i)
            known.add(key)
        rows = torch.tensor(take, dtype=torch.long)
        first_new = len(self)
        for key in set(self.row_fields) | set(other.row_fields):
            self.row_fields[key] = ([self.row_field(key, i) for i in range(first_new)]
                                    + [other.row_field(key, i) for i in take])
        if self.segments is not None or other.segments is not None:  # whole videos are NaN rows among moments
            whole = lambda count: torch.full((count, 2), float("nan"), dtype=torch.float64)  # noqa: E731
            mine = self.segments if self.segments is not None else whole(len(self))
            theirs = other.segments[rows] if other.segments is not None else whole(len(take))
            self.segments = torch.cat([mine, theirs])
        self.videos = self.videos + [other.videos[i] for i in take]
        new_embeddings = other.embeddings[rows].to(self.embeddings.dtype)
        self.embeddings = torch.cat([self.embeddings, new_embeddings])
        if self.tokens is not None:
            self.tokens = torch.cat([self.tokens, other.tokens[rows].to(self.tokens.dtype)])
        if self.token_sizes is not None:
            self.token_sizes = torch.cat([self.token_sizes, other.token_sizes[rows].to(self.token_sizes.dtype)])
        encoded = {self.row_key(i) for i, item in enumerate(self.videos) if isinstance(item, (str, os.PathLike))}
        merged: dict[tuple, Failure] = {}
        for failure in [*self.failures, *other.failures]:
            merged.pop(failure.key, None)  # the later record of a key wins, in the order met
            merged[failure.key] = failure
        self.failures = [failure for key, failure in merged.items() if key not in encoded]
        self.skipped = skipped
        self.grow_first_stage(new_embeddings, first_new)
        return self

    def check_compatible(self, other: "VideoIndex") -> None:
        """Raises ValueError naming the first field in which `other` cannot join this index (see `add`)."""
        fields = {
            "embedding dim": (self.dim, other.dim),
            "embeddings dtype": (self.embeddings.dtype, other.embeddings.dtype),
            "has tokens": (self.has_tokens, other.has_tokens),
            "has token_sizes": (self.token_sizes is not None, other.token_sizes is not None),
        }
        if self.has_tokens and other.has_tokens:
            fields["token shape"] = (tuple(self.tokens.shape[1:]), tuple(other.tokens.shape[1:]))
            fields["tokens dtype"] = (self.tokens.dtype, other.tokens.dtype)
        for name, (mine, theirs) in fields.items():
            if mine != theirs:
                raise ValueError(f"Cannot add an index with {name} {theirs} to one with {name} {mine}.")
        check_settings("The index", self.info, other.info)  # the one comparison of settings

    def grow_first_stage(self, new_embeddings: torch.Tensor, first_row: int) -> None:
        """After `add`: adds the new vectors to the kept first stage, or drops it (rebuilt on the next search) when
        its kind no longer fits the collection's size or FAISS cannot add to it (e.g. a memory-mapped file)."""
        stage = self.first_stage
        if stage is None or new_embeddings.shape[0] == 0:
            return
        default_kind = first_stage_kind(stage.count, self.exact_max_videos)
        if stage.kind == default_kind and first_stage_kind(self.num_encoded, self.exact_max_videos) != stage.kind:
            self.first_stage = None
            return
        try:
            stage.add(new_embeddings, first_row, self.embeddings)
        except RuntimeError:
            self.first_stage = None

    # -- saving and loading ------------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, as_store: bool | None = None) -> Path:
        """Saves the index into `directory` (created if needed), with its first stage when FAISS is installed and
        the stage is approximate (`first_stage.faiss` and `first_stage.json`, built now if needed; see
        `save_first_stage`). Returns the directory.

        Args:
            as_store (`bool`, *optional*): write the on-disk video store format (`video_store.json` and shards; the
                tokens keep their dtype, which must be float16, bfloat16 or float32; `failures` of an in-memory
                index become failed rows after its videos). Defaults to `True` for a store-backed index and to
                `False` otherwise, which writes the single-file format of earlier versions
                (`video_index.safetensors` with embeddings, tokens and token sizes, and `video_index.json`; a
                store-backed index written so keeps its encoded videos only). `load` reads both.

        Raises:
            `settings.IndexSettingsError`: `directory` holds a video store (other than this index's own), or
                (`as_store`) files that are not one: nothing there is written over.
        """
        directory = Path(directory)
        as_store = self.store is not None if as_store is None else as_store
        here = self.store is not None and directory.exists() and \
            Path(self.store.directory).resolve() == directory.resolve()
        if not here and recorded_store_settings(directory) is not None:  # never written over: it may be in use
            raise IndexSettingsError(directory, f"{str(directory)!r} holds a video store: save into a new or empty "
                                                "folder (a store grows with pipe.encode_videos(videos, store_dir=...)).")
        if as_store:
            if not self.has_tokens:
                raise ValueError("The video store format holds tokens; this index has none (save it with "
                                 "as_store=False, or encode with store_tokens=True).")
            with StoreLock(directory, command="VideoIndex.save"):  # one writer per store
                if not here:
                    dtype = self.tokens.dtype if self.tokens.dtype in (torch.float16, torch.bfloat16) else torch.float32
                    check_store_folder(directory, {**self.info, "token_dtype": str(dtype).replace("torch.", "")})
                    self._write_store(directory, dtype)
                # the rows are the same unless failures of an in-memory index became rows
                same_rows = self.store is not None or not self.failures
                (self if same_rows else VideoIndex.from_store(directory, first_stage=False)).save_first_stage(directory)
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        rows = self.encoded_rows()
        kept = slice(None) if rows is None else rows  # a store's lazy tokens read every row for [:]
        tensors = {"embeddings": self.embeddings[kept].detach().cpu().contiguous()}
        if self.segments is not None:
            tensors["segments"] = self.segments[kept].contiguous()
        for name in ("tokens", "token_sizes"):
            value = getattr(self, name)
            if value is not None:
                tensors[name] = value[kept].detach().cpu().contiguous()
        save_file(tensors, str(directory / INDEX_TENSORS_FILE), metadata={"format": "pt"})
        names = self.names if rows is None else [self.names[int(i)] for i in rows]
        info = {"format_version": 1, "videos": names, "info": self.info,
                "failures": [failure.as_dict() for failure in self.failures]}
        if self.row_fields:
            info["row_fields"] = {key: values if rows is None else [values[int(i)] for i in rows]
                                  for key, values in self.row_fields.items()}
        (directory / INDEX_INFO_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
        # a store-backed index saved so keeps its encoded rows only: the first stage of those
        (self if rows is None else VideoIndex.load(directory, first_stage=False)).save_first_stage(directory)
        return directory

    def _write_store(self, directory: Path, dtype: torch.dtype, chunk: int = 64) -> None:
        valid = self.valid
        extra = self.failures if self.store is None else []  # failed rows after the videos
        keys = self.row_keys() + [failure.key for failure in extra]
        row_fields = {key: values + [getattr(failure, key, None) for failure in extra]
                      for key, values in self.row_fields.items()}
        segments = None
        if any(start is not None for _, start, _ in keys):  # rows' (start, end), None for whole videos
            segments = [None if start is None else [start, end] for _, start, end in keys]
        # the rows' plan first, as every store build writes it: a save killed halfway is resumed by the next build
        # (`homes.StoreHome`) with these rows, in this order, never with others under these row numbers
        write_json_atomically(directory / PLAN_FILE, {"videos": [key[0] for key in keys], "shards": [[0, len(keys)]],
                                                      "row_fields": row_fields, "segments": segments})
        writer = VideoStoreWriter(directory, 0, 0, len(keys), token_dtype=dtype)
        failures = {failure.index: failure for failure in self.failures} if self.store is not None else {}
        for start in range(0, len(self), chunk):
            rows = [i for i in range(start, min(start + chunk, len(self))) if valid[i]]
            for i in range(start, min(start + chunk, len(self))):
                if not valid[i]:
                    writer.add_failure(i, failures[i].video, failures[i].reason, code=failures[i].code)
            if rows:
                index = torch.tensor(rows)
                sizes = self.token_sizes[index] if self.token_sizes is not None else None
                writer.add_batch(rows, self.tokens[index], sizes, self.embeddings[index])
        for j, failure in enumerate(extra):
            writer.add_failure(len(self) + j, failure.video, failure.reason, code=failure.code)
        writer.close()
        info = dict(self.info, **({"segments": segments} if segments is not None else {}))
        finalize_store(directory, [key[0] for key in keys], 1, info, row_fields=row_fields or None)

    @classmethod
    def load(cls, directory: str | os.PathLike, first_stage: bool = True) -> "VideoIndex":
        """Reads an index written by `save` (either format) or any video store (e.g. the one the training
        evaluation writes with `eval.store_dir`); `videos` then holds the saved names. Nothing is read twice: the
        embeddings are memory-mapped (a store's tokens stay on disk and are read when indexed) and the saved first
        stage is opened (`first_stage=False` skips it; a stale one is ignored and rebuilt on the first search)."""
        directory = Path(directory)
        if is_video_store(directory):
            return cls.from_store(directory, first_stage=first_stage)
        for name in (INDEX_TENSORS_FILE, INDEX_INFO_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(
                    f"No video index in {str(directory)!r}: it holds neither a video store ({STORE_INFO_FILE}) nor "
                    f"the single-file index ({name} is missing)."
                )
        tensors = load_safetensors(directory / INDEX_TENSORS_FILE)  # DamagedStoreError naming a damaged file
        info = read_json_file(directory / INDEX_INFO_FILE)
        version = info.get("format_version") if isinstance(info, dict) else f"(not a JSON object: {info!r:.40})"
        if version != 1:
            raise ValueError(f"Unknown video index format_version {version!r} in "
                             f"{str(directory / INDEX_INFO_FILE)!r}; this version reads 1 and video stores.")
        index = cls(
            videos=list(info["videos"]),
            embeddings=tensors["embeddings"],
            tokens=tensors.get("tokens"),
            token_sizes=tensors.get("token_sizes"),
            info=dict(info.get("info", {})),
            failures=info.get("failures", []),
            row_fields=info.get("row_fields") or {},
            segments=tensors.get("segments"),
        )
        if first_stage:
            index.load_first_stage(directory)
        return index

    # -- search ------------------------------------------------------------------------------------------------------

    def filtered_rows(self, filters: dict[str, Any]) -> torch.Tensor:
        """The encoded rows whose payload passes `filters` (`filters`: ``video``, ``folder``, ``dataset``)."""
        valid = self.valid
        keep = [i for i in range(len(self)) if bool(valid[i]) and matches({**self.entry(i), "video": self.names[i]},
                                                                            filters)]
        return torch.tensor(keep, dtype=torch.long)

    def nearest(
        self, query_embeddings: torch.Tensor, k: int, use_faiss: bool | None = None,
        filters: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """First-stage search: the `k` videos of highest cosine similarity for each query.

        With `faiss` installed (`use_faiss=None`), the kept FAISS first stage (exact up to `exact_max_videos`
        encoded videos, approximate with exact re-scoring above; built on the first call if it was neither built
        nor loaded, see `FirstStage`); exact torch top-k otherwise. The embeddings are L2-normalised, so inner
        product = cosine. Videos that could not be encoded (possible in a store) are left out.

        Args:
            query_embeddings (`torch.FloatTensor` of shape `(num_queries, projection_dim)`): normalised text features.
            k (`int`): candidates per query (capped at the number of encoded videos).
            use_faiss (`bool`, *optional*): force (`True`, raises if missing) or avoid (`False`) FAISS.
            filters (`dict`, *optional*): only rows whose payload passes them (see `filtered_rows`), searched exactly;
                rows are ``-1`` (scores ``-inf``) past the matching ones.

        Returns:
            `(scores, indices)`, both `(num_queries, k)`, by decreasing similarity.

        Raises:
            ValueError: when the queries' size is not the index's embedding size (another model's `projection_dim`).
        """
        queries = query_embeddings.detach().float().cpu()
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"The queries have shape {tuple(queries.shape)}, but this index holds {self.dim}-d embeddings: "
                f"search it with the model that encoded it (projection_dim {self.dim}, got {queries.shape[-1]})."
            )
        if filters:
            rows = self.filtered_rows(filters)
            scores = torch.full((queries.shape[0], int(k)), float("-inf"))
            found = torch.full((queries.shape[0], int(k)), -1, dtype=torch.long)
            if rows.numel():
                top, at = exact_nearest(queries, self.embeddings, rows, min(int(k), rows.numel()))
                scores[:, : top.shape[1]], found[:, : at.shape[1]] = top, at
            return scores, found
        count = self.num_encoded
        k = min(int(k), count)
        faiss = faiss_module() if use_faiss in (None, True) else None
        if use_faiss and faiss is None:
            raise ImportError("use_faiss=True but `faiss` is not installed (pip install faiss-cpu).")
        if k == 0:
            return torch.zeros(queries.shape[0], 0), torch.zeros(queries.shape[0], 0, dtype=torch.long)
        if faiss is None:
            if use_faiss is None:
                warn_exact_fallback(count)
            return exact_nearest(queries, self.embeddings, self.encoded_rows(), k)
        stage = self.current_first_stage() or self.build_first_stage()
        if stage.kind != "flat" and candidate_count(k, count) >= count:
            return exact_nearest(queries, self.embeddings, self.encoded_rows(), k)  # nothing to prune
        scores, indices = stage.search(faiss, queries, k, self.embeddings)
        short = (indices < 0).any(dim=1)
        if bool(short.any()):  # an approximate stage reached fewer than k: answer those queries exactly
            scores[short], indices[short] = exact_nearest(queries[short], self.embeddings, self.encoded_rows(), k)
        return scores, indices


__all__ = [
    "EXACT_MAX_VIDEOS",
    "FIRST_STAGE_FILE",
    "FIRST_STAGE_INFO_FILE",
    "INDEX_INFO_FILE",
    "INDEX_TENSORS_FILE",
    "FirstStage",
    "VideoIndex",
    "faiss_module",
    "first_stage_kind",
    "video_name",
]
