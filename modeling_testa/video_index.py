"""An encoded video collection, searched without decoding again: `VideoIndex`, and its exact first-stage search
(`nearest`, with FAISS's `IndexFlatIP` when installed).

An index holds the L2-normalised contrastive embedding of every video (the first stage) and, optionally, the
aggregated tokens the matching head cross-attends to (the second stage). It lives in memory, or is backed by an
on-disk video store (`video_store.py`), which `VideoTextRetrievalPipeline.encode_videos(..., store_dir=...)` and the
training evaluation write (both through `indexing.encode_videos`). Two-stage search is
`VideoTextRetrievalPipeline.search`.

This file is Hub remote code: flat relative imports only, absolute imports of installed packages only (FAISS is
optional and imported inside `try`).
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .video_store import STORE_INFO_FILE, VideoStoreWriter, VideoTokenStore, finalize_store, is_video_store


INDEX_TENSORS_FILE = "video_index.safetensors"
INDEX_INFO_FILE = "video_index.json"


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


@dataclass
class VideoIndex:
    r"""
    A collection of videos encoded once by [`VideoTextRetrievalPipeline.encode_videos`].

    Two forms, searched the same way by [`VideoTextRetrievalPipeline.search`]:

    - in memory (default): `tokens` and `token_sizes` are tensors.
    - backed by an on-disk video store (`encode_videos(..., store_dir=DIR)` or `VideoIndex.load(DIR)` of a store, see
      `video_store.py`, the format the training evaluation writes too): `embeddings` are in memory, while `tokens`
      and `token_sizes` are lazy tensor-likes whose indexing (`index.tokens[candidates]`) reads only those videos from
      disk. A collection is indexed once and searched many times with memory bounded by the candidates.

    Args:
        videos (`list`): the videos as given (paths, or arrays for in-memory videos); after `load`, their names.
        embeddings (`torch.FloatTensor` of shape `(num_videos, projection_dim)`): L2-normalised contrastive video
            embeddings (`model.get_video_features`), used for the first stage.
        tokens (`torch.Tensor` of shape `(num_videos, tokens, hidden_size)`, *optional*): the aggregated video tokens
            the matching head cross-attends to, for the second (re-ranking) stage (lazy when store-backed).
        token_sizes (`torch.FloatTensor` of shape `(num_videos, tokens)`, *optional*): input patches per token.
        info (`dict`): how the index was built (model class, frames, ...); saved with it.
        store (`VideoTokenStore`, *optional*): the on-disk store backing `tokens`, when there is one.
        stats (`dict`): how fast `encode_videos` built it (not saved): `videos`, `seconds` (wall time),
            `videos_per_second`, `decode_wait_seconds` (time the encoder waited for decoded videos; all the decoding
            time without workers), `encode_seconds` (encoder forwards) and `num_workers`.
    """

    videos: list[Any]
    embeddings: torch.Tensor
    tokens: Any = None
    token_sizes: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    store: VideoTokenStore | None = None
    stats: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.videos)
        if self.embeddings.ndim != 2 or self.embeddings.shape[0] != n:
            raise ValueError(f"`embeddings` must be ({n}, dim) for {n} videos, got {tuple(self.embeddings.shape)}.")
        for name in ("tokens", "token_sizes"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise ValueError(f"`{name}` has {value.shape[0]} rows for {n} videos.")

    def __len__(self) -> int:
        return len(self.videos)

    @property
    def names(self) -> list[str]:
        """The videos' paths (or `videos[i]` for in-memory videos), as saved in the json file."""
        return [video_name(item, i) for i, item in enumerate(self.videos)]

    @property
    def has_tokens(self) -> bool:
        """Whether the aggregated tokens are stored, i.e. whether search can re-rank with the matching head."""
        return self.tokens is not None

    @property
    def valid(self) -> torch.Tensor:
        """`(num_videos,)` bool: the videos that were encoded (a store written by the training evaluation may hold
        videos that could not be decoded; they are never returned by `nearest`)."""
        return self.store.valid if self.store is not None else torch.ones(len(self), dtype=torch.bool)

    @classmethod
    def from_store(cls, store: "VideoTokenStore | str | os.PathLike") -> "VideoIndex":
        """An index over an on-disk video store (a `VideoTokenStore` or its directory)."""
        if not isinstance(store, VideoTokenStore):
            store = VideoTokenStore(store)
        return cls(videos=list(store.videos), embeddings=store.embeddings, tokens=store.tokens,
                   token_sizes=store.token_sizes, info=dict(store.info), store=store)

    def save(self, directory: str | os.PathLike, as_store: bool | None = None) -> Path:
        """Saves the index into `directory` (created if needed). Returns the directory.

        Args:
            as_store (`bool`, *optional*): write the on-disk video store format (`video_store.json` and shards; the
                tokens keep their dtype, which must be float16, bfloat16 or float32). Defaults to `True` for a
                store-backed index and to `False` otherwise, which writes the single-file format of earlier versions
                (`video_index.safetensors` with embeddings, tokens and token sizes, and `video_index.json`). `load`
                reads both.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        as_store = self.store is not None if as_store is None else as_store
        if as_store:
            if not self.has_tokens:
                raise ValueError("The video store format holds tokens; this index has none (save it with "
                                 "as_store=False, or encode with store_tokens=True).")
            if self.store is not None and Path(self.store.directory).resolve() == directory.resolve():
                return directory  # already there
            self._write_store(directory)
            return directory
        tensors = {"embeddings": self.embeddings.detach().cpu().contiguous()}
        if self.tokens is not None:
            tokens = self.tokens if isinstance(self.tokens, torch.Tensor) else self.tokens.materialize()
            tensors["tokens"] = tokens.detach().cpu().contiguous()
        if self.token_sizes is not None:
            sizes = self.token_sizes if isinstance(self.token_sizes, torch.Tensor) else self.token_sizes.materialize()
            tensors["token_sizes"] = sizes.detach().cpu().contiguous()
        save_file(tensors, str(directory / INDEX_TENSORS_FILE), metadata={"format": "pt"})
        info = {"format_version": 1, "videos": self.names, "info": self.info}
        (directory / INDEX_INFO_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
        return directory

    def _write_store(self, directory: Path, chunk: int = 64) -> None:
        valid = self.valid
        dtype = self.tokens.dtype if self.tokens.dtype in (torch.float16, torch.bfloat16) else torch.float32
        writer = VideoStoreWriter(directory, 0, 0, len(self), token_dtype=dtype)
        failures = {f["index"]: f for f in (self.store.failures if self.store is not None else [])}
        for start in range(0, len(self), chunk):
            rows = [i for i in range(start, min(start + chunk, len(self))) if valid[i]]
            for i in range(start, min(start + chunk, len(self))):
                if not valid[i]:
                    writer.add_failure(i, failures[i]["video"], failures[i]["reason"])
            if rows:
                index = torch.tensor(rows)
                sizes = self.token_sizes[index] if self.token_sizes is not None else None
                writer.add_batch(rows, self.tokens[index], sizes, self.embeddings[index])
        writer.close()
        finalize_store(directory, self.names, 1, self.info)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "VideoIndex":
        """Reads an index written by `save` (either format) or any video store (e.g. the one the training
        evaluation writes with `eval.store_dir`); `videos` then holds the saved names. A video store stays on disk:
        its tokens are read when indexed."""
        directory = Path(directory)
        if is_video_store(directory):
            return cls.from_store(directory)
        for name in (INDEX_TENSORS_FILE, INDEX_INFO_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(
                    f"No video index in {str(directory)!r}: it holds neither a video store ({STORE_INFO_FILE}) nor "
                    f"the single-file index ({name} is missing)."
                )
        tensors = load_file(str(directory / INDEX_TENSORS_FILE))
        info = json.loads((directory / INDEX_INFO_FILE).read_text(encoding="utf-8"))
        if info.get("format_version") != 1:
            raise ValueError(f"Unknown video index format_version {info.get('format_version')!r} in "
                             f"{str(directory / INDEX_INFO_FILE)!r}; this version reads 1 and video stores.")
        return cls(
            videos=list(info["videos"]),
            embeddings=tensors["embeddings"],
            tokens=tensors.get("tokens"),
            token_sizes=tensors.get("token_sizes"),
            info=dict(info.get("info", {})),
        )

    def nearest(
        self, query_embeddings: torch.Tensor, k: int, use_faiss: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """First-stage search: the `k` videos of highest cosine similarity for each query.

        Uses an exact inner-product FAISS index (`IndexFlatIP`) when `faiss` is installed (`use_faiss=None`), torch
        top-k otherwise. The embeddings are L2-normalised, so inner product = cosine. Videos that could not be
        encoded (possible in a store written by the training evaluation) are left out.

        Args:
            query_embeddings (`torch.FloatTensor` of shape `(num_queries, projection_dim)`): normalised text features.
            k (`int`): candidates per query (capped at the number of encoded videos).
            use_faiss (`bool`, *optional*): force (`True`, raises if missing) or avoid (`False`) FAISS.

        Returns:
            `(scores, indices)`, both `(num_queries, k)`, by decreasing similarity.
        """
        valid = self.valid
        rows = None if bool(valid.all()) else valid.nonzero().flatten()
        k = min(int(k), len(self) if rows is None else rows.numel())
        queries = query_embeddings.detach().float().cpu()
        database = self.embeddings.float().cpu()
        if rows is not None:
            database = database[rows]
        faiss = faiss_module() if use_faiss in (None, True) else None
        if use_faiss and faiss is None:
            raise ImportError("use_faiss=True but `faiss` is not installed (pip install faiss-cpu).")
        if faiss is not None:
            index = faiss.IndexFlatIP(database.shape[1])
            index.add(np.ascontiguousarray(database.numpy(), dtype=np.float32))
            scores, indices = index.search(np.ascontiguousarray(queries.numpy(), dtype=np.float32), k)
            scores, indices = torch.from_numpy(scores), torch.from_numpy(indices).long()
        else:
            scores, indices = (queries @ database.T).topk(k, dim=1)
        return scores, (indices if rows is None else rows[indices])


__all__ = ["INDEX_INFO_FILE", "INDEX_TENSORS_FILE", "VideoIndex", "faiss_module", "video_name"]
