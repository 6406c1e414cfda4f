"""An on-disk store of encoded videos: the aggregated tokens the matching head cross-attends to, and the embeddings.

A collection is encoded once (possibly by several processes, each writing the shard of a contiguous range of
videos) and then searched many times. Ranking needs only the embeddings, which are small and memory-mapped, not
copied (``num_videos x projection_dim`` fp32); re-ranking reads the tokens of the candidates only, with positioned reads
(``os.preadv``) into a fresh buffer, so that the resident memory of a process is bounded by the number of candidates
read at a time, not by the collection (a memory map would keep every page it touched resident).

Layout of a store directory::

    video_store.json               format, shapes, dtypes, the shards, the video names, failed videos, `info`
                                   (`store_metadata` reads it; `journaled_count` / `journaled_failures` read the
                                   journals of a store still being written: nothing else parses these files)
    shard-00000.json               one shard's range, failures and token shape (written by the process that encoded it)
    journal-00000.jsonl            what the shard holds, batch by batch (what a resumed writer continues from)
    embeddings-00000.bin           (rows, projection_dim) fp32, in row order (the journal's copy of the embeddings)
    shard-00000.safetensors        `embeddings` (count, projection_dim) fp32 and `rows` (count,) int64: the row of
                                   each video in the token file, -1 for a video that could not be encoded
    tokens-00000.bin               (rows, num_tokens, hidden_size) in the store's token dtype, C order, no header
    token_sizes-00000.bin          (rows, num_tokens) fp32 (when the encoder reports token sizes)
    writer.lock                    while a writer runs: who it is (`lock.StoreLock`; one writer per store)

The ``.bin`` files are raw arrays: ``np.memmap(path, dtype, mode="r", shape=(rows, num_tokens, hidden_size))`` opens
them (bfloat16 tokens are stored as their 16-bit patterns). The token count is fixed per store: aggregation settings
that give another count need another store.

**Damaged stores are named, not searched.** Opening a store checks, without reading any token, that every file it
needs is there and whole (the sizes of the ``.bin`` files are the shard's rows times the row size) and that every row
belongs to its video: the shard's row map is a permutation of its rows, each video appears once in the journal and
at the row the row map gives it, and the row-order copy of the embeddings (``embeddings-NNNNN.bin``) equals the
embeddings kept per video (``shard-NNNNN.safetensors``). Two writers appending to one shard at once break these
(rows written twice, or rows of one writer under the other's row map). Any failure, here or when tokens are read
later, raises `DamagedStoreError` naming the file and what is wrong with it.
"""

import json
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save, save_file

from testa_search.store.int8_tokens import SCALE_BYTES, pack, unpack

STORE_INFO_FILE = "video_store.json"
PLAN_FILE = "index_plan.json"
"""A store's rows in order and its shards' ranges while it is written and grown (`homes.StoreHome`); a store
written whole (`VideoIndex.save`) removes a stale one."""
JOINED_EMBEDDINGS_FILE = "embeddings.f32"
"""Every shard's embeddings in row order, ``(num_videos, dim)`` raw float32, written by `finalize_store`: a store of
several shards opens memory-mapped, without joining them into one copy."""
STORE_FORMAT = "testa-video-store"
STORE_VERSION = 1
TOKEN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}


def token_row_shape(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> tuple[tuple[int, int], torch.dtype]:
    """The on-disk shape and dtype of one video's tokens: int8 tokens carry their scale (`int8_tokens.pack`)."""
    if dtype == torch.int8:
        return (num_tokens, hidden_size + SCALE_BYTES), torch.uint8
    return (num_tokens, hidden_size), dtype


def row_bytes(num_tokens: int, hidden_size: int, dtype: torch.dtype, has_token_sizes: bool,
              embedding_dim: int) -> dict[str, int]:
    """The bytes one video takes in each data file of a shard (``tokens``, ``embeddings``, ``token_sizes``): what
    a writer appends per video, and what a reader checks the files against."""
    shape, stored = token_row_shape(num_tokens, hidden_size, dtype)
    return {"tokens": shape[0] * shape[1] * stored.itemsize, "embeddings": int(embedding_dim) * 4,
            "token_sizes": num_tokens * 4 if has_token_sizes else 0}


def replace_file(path: Path, data: bytes | str) -> None:
    """Writes `data` beside `path` (a hidden ``.NAME.partial``) and renames it into place: a reader sees the old
    file or the new one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(partial, path)


class DamagedStoreError(ValueError):
    """A file of a video store is missing, unreadable or inconsistent with the rest of the store. Attributes:
    ``path`` (the file) and ``reason`` (what is wrong with it)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), str(reason)
        super().__init__(f"Damaged video store file {str(path)!r}: {reason}. The store cannot be searched: index "
                         "its videos again into a new folder.")


def read_json_file(path: str | os.PathLike) -> Any:
    """The JSON value in ``path``; `DamagedStoreError` naming it when it is missing, not UTF-8 text or not JSON."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DamagedStoreError(path, "the file is missing") from None
    except OSError as error:
        raise DamagedStoreError(path, f"it cannot be read ({error})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DamagedStoreError(path, f"it is not UTF-8 text (byte {error.start} of {len(raw)} is "
                                      f"{raw[error.start:error.start + 1]!r})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DamagedStoreError(path, f"it is not valid JSON ({error.msg} at line {error.lineno} column "
                                      f"{error.colno}; {len(raw)} bytes)") from None


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in TOKEN_DTYPES:
        raise ValueError(f"Unsupported token dtype {dtype!r}; use one of {sorted(TOKEN_DTYPES)}.")
    return name


def shard_range(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous ``[start, stop)`` share of process ``rank``: sizes differ by at most one, and may be 0."""
    return num_items * rank // world_size, num_items * (rank + 1) // world_size


SHARD_FILES = {"marker": "shard-{}.json", "tensors": "shard-{}.safetensors", "journal": "journal-{}.jsonl",
               "tokens": "tokens-{}.bin", "token_sizes": "token_sizes-{}.bin", "embeddings": "embeddings-{}.bin"}
"""The files of one shard (see the module docstring), by kind: the closed marker, the embeddings and row map, the
journal and the three data files."""


def shard_file(kind: str, shard: int | str) -> str:
    """The name of shard `shard`'s file of `kind` (`SHARD_FILES`), e.g. ``shard-00003.json``; ``shard="*"``: the
    glob pattern of every shard's."""
    return SHARD_FILES[kind].format(shard if shard == "*" else f"{shard:05d}")


class VideoStoreWriter:
    """Writes one shard of a store: the videos ``[start, stop)`` of the collection, appended in any order.

    Tokens go to disk as they arrive (nothing of them is kept in memory); the embeddings of the shard are kept
    (``(stop - start) x projection_dim`` fp32) and written by `close`. Call `add_batch` for encoded videos and
    `add_failure` for videos that could not be decoded or encoded; `close` checks that every video of the range was
    given exactly once.

    A directory reused from an earlier run is made safe first: the shard's closed marker (``shard-NNNNN.json``) and,
    for shard 0, the store's index (``video_store.json``) are removed, so a run that fails halfway can never leave an
    old index describing new, partial shards. Use it as a context manager (or call `abort` on failure) so that its
    files are closed whatever happens.

    **Journal and resume.** Every batch is journaled: its tokens, token sizes and embeddings are appended to the
    shard's files and flushed, then one line naming its videos is appended to ``journal-NNNNN.jsonl`` (failures get
    a line each). With ``resume=True`` a writer reopens what a killed run left: it reads the journal (a torn last
    line is ignored), cuts the data files back to what the journal records, and continues; `done` holds the videos
    already written, which the caller skips. A killed process loses at most the batch in flight. (Flushed data
    survives a killed process; surviving a machine crash would need ``fsync``, which is not done.)
    """

    def __init__(self, directory: str | os.PathLike, shard: int, start: int, stop: int,
                 token_dtype: torch.dtype | str = torch.float16, resume: bool = False):
        if not 0 <= start <= stop:
            raise ValueError(f"Invalid shard range [{start}, {stop}).")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard, self.start, self.stop = int(shard), int(start), int(stop)
        self.token_dtype = TOKEN_DTYPES[_dtype_name(token_dtype)]
        self.rows = torch.full((stop - start,), -2, dtype=torch.long)  # -2: not given yet, -1: failed
        self.embeddings: torch.Tensor | None = None
        self.failures: list[dict[str, Any]] = []
        self.num_tokens = self.hidden_size = None
        self.has_token_sizes: bool | None = None
        self._written = 0
        (self.directory / shard_file("marker", self.shard)).unlink(missing_ok=True)
        if self.shard == 0:
            (self.directory / STORE_INFO_FILE).unlink(missing_ok=True)
        paths = {kind: self.directory / shard_file(kind, shard) for kind in ("tokens", "token_sizes", "embeddings")}
        journal = self.directory / shard_file("journal", shard)
        header = {"shard": self.shard, "start": self.start, "stop": self.stop,
                  "token_dtype": _dtype_name(self.token_dtype)}
        if resume and journal.is_file():
            self._replay(journal, header, paths)
        else:
            for path in (*paths.values(), journal):
                path.unlink(missing_ok=True)
            journal.write_text(json.dumps(header) + "\n", encoding="utf-8")
        self._data = {kind: open(path, "ab") for kind, path in paths.items()}  # noqa: SIM115
        self._journal = open(journal, "a", encoding="utf-8")  # noqa: SIM115

    @property
    def done(self) -> set[int]:
        """The videos (collection indices) already written or marked failed."""
        return {self.start + i for i in (self.rows != -2).nonzero().flatten().tolist()}

    def _replay(self, journal: Path, header: dict[str, Any], paths: dict[str, Path]) -> None:
        """Restores the state a killed writer journaled, and cuts its data files back to it."""
        lines = journal.read_text(encoding="utf-8").split("\n")
        entries = []
        for number, line in enumerate(lines):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(lines) - 1 and any(rest.strip() for rest in lines[number + 1:]):
                    raise DamagedStoreError(journal, f"line {number + 1} is not valid JSON, and lines follow "
                                                     "it") from None
                break  # a torn last line: the batch it named is written again
        if not entries or {k: entries[0].get(k) for k in header} != header:
            raise ValueError(f"{str(journal)!r} belongs to another shard or token dtype: {entries[:1]} (this writer: "
                             f"{header}). Remove the store directory or use another one.")
        rows_per_video = None
        for entry in entries[1:]:
            if "failed" in entry:
                self.add_failure(entry["failed"], entry["video"], entry["reason"], journal=False,
                                 code=entry.get("code"))
                continue
            if self.num_tokens is None:
                self.num_tokens, self.hidden_size = entry["num_tokens"], entry["hidden_size"]
                self.has_token_sizes = entry["has_token_sizes"]
                self.embeddings = torch.zeros(self.stop - self.start, entry["embedding_dim"], dtype=torch.float32)
            for index in entry["encoded"]:
                if self.start <= index < self.stop and self.rows[index - self.start] != -2:
                    raise DamagedStoreError(journal, f"video {index} appears twice: the shard was written by two "
                                                     "writers at once")
                self.rows[self._local(index)] = self._written
                self._written += 1
        if self.num_tokens is not None:
            rows_per_video = row_bytes(self.num_tokens, self.hidden_size, self.token_dtype, self.has_token_sizes,
                                       self.embeddings.shape[1])
        for kind, path in paths.items():
            size = self._written * (rows_per_video[kind] if rows_per_video else 0)
            if (path.stat().st_size if path.exists() else 0) < size:
                raise ValueError(f"{str(path)!r} holds less than its journal records ({size} bytes): the store is "
                                 "damaged; remove it and index again.")
            with open(path, "ab") as handle:
                handle.truncate(size)
        if self._written:
            raw = paths["embeddings"].read_bytes()
            written = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(self._written, -1)
            valid = (self.rows >= 0).nonzero().flatten()
            self.embeddings[valid] = written[self.rows[valid]]
        journal.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")

    def _local(self, index: int) -> int:
        if not self.start <= index < self.stop:
            raise IndexError(f"Video {index} is outside this shard's range [{self.start}, {self.stop}).")
        local = index - self.start
        if self.rows[local] != -2:
            raise ValueError(f"Video {index} was already added to the store.")
        return local

    def add_batch(self, indices: Iterable[int], tokens: torch.Tensor, token_sizes: torch.Tensor | None,
                  embeddings: torch.Tensor) -> None:
        """Appends encoded videos: ``tokens (batch, num_tokens, hidden)``, ``token_sizes (batch, num_tokens)`` or
        None, ``embeddings (batch, projection_dim)``; ``indices`` are their positions in the collection."""
        indices = [int(i) for i in indices]
        if tokens.ndim != 3 or tokens.shape[0] != len(indices) or embeddings.shape[0] != len(indices):
            raise ValueError(
                f"add_batch needs tokens (batch, tokens, hidden) and embeddings (batch, dim) for {len(indices)} "
                f"videos, got {tuple(tokens.shape)} and {tuple(embeddings.shape)}."
            )
        if self.num_tokens is None:
            self.num_tokens, self.hidden_size = int(tokens.shape[1]), int(tokens.shape[2])
            self.has_token_sizes = token_sizes is not None
            self.embeddings = torch.zeros(self.stop - self.start, embeddings.shape[1], dtype=torch.float32)
        if tuple(tokens.shape[1:]) != (self.num_tokens, self.hidden_size):
            raise ValueError(
                f"A store holds a fixed number of tokens per video: this one holds ({self.num_tokens}, "
                f"{self.hidden_size}) per video, got {tuple(tokens.shape[1:])} for videos {indices}. Encode each "
                "aggregation setting into its own store."
            )
        if (token_sizes is not None) != self.has_token_sizes:
            raise ValueError("Give `token_sizes` for every batch of a store or for none.")
        locals_ = [self._local(i) for i in indices]
        if len(set(locals_)) != len(locals_):
            raise ValueError(f"A batch names a video twice: {indices}.")
        if self.token_dtype == torch.int8:  # codes and one scale per token
            cpu_tokens = pack(tokens.detach().cpu())
        else:
            cpu_tokens = tokens.detach().to("cpu", self.token_dtype).contiguous()
        self._data["tokens"].write(cpu_tokens.view(torch.uint8).numpy().tobytes())
        if token_sizes is not None:
            cpu_sizes = token_sizes.detach().to("cpu", torch.float32).contiguous()
            self._data["token_sizes"].write(cpu_sizes.numpy().tobytes())
        cpu_embeddings = embeddings.detach().to("cpu", torch.float32).contiguous()
        self._data["embeddings"].write(cpu_embeddings.numpy().tobytes())
        for handle in self._data.values():
            handle.flush()  # the data first, then the journal line that makes it count
        self._log({"encoded": indices, "num_tokens": self.num_tokens, "hidden_size": self.hidden_size,
                   "has_token_sizes": self.has_token_sizes, "embedding_dim": int(embeddings.shape[1])})
        for j, local in enumerate(locals_):
            self.rows[local] = self._written + j
        self._written += len(indices)
        self.embeddings[locals_] = cpu_embeddings

    def add_failure(self, index: int, video: str, reason: str, journal: bool = True, code: str | None = None) -> None:
        """Marks a video that could not be encoded; it is never a candidate, and a query about it is a miss.
        `code` (`encoding.FAILURE_CODES`) is recorded beside the reason when given."""
        self.rows[self._local(int(index))] = -1
        coded = {"code": str(code)} if code is not None else {}
        self.failures.append({"index": int(index), "video": str(video), **coded, "reason": str(reason)})
        if journal:
            self._log({"failed": int(index), "video": str(video), **coded, "reason": str(reason)})

    def _log(self, entry: dict[str, Any]) -> None:
        self._journal.write(json.dumps(entry) + "\n")
        self._journal.flush()

    def _close_files(self) -> None:
        for handle in (*self._data.values(), self._journal):
            handle.close()

    def __enter__(self) -> "VideoStoreWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Closes the shard's files without marking it complete (the store stays unreadable; a writer with
        ``resume=True`` continues it)."""
        self._close_files()

    def close(self) -> None:
        self._close_files()
        missing = (self.rows == -2).nonzero().flatten()
        if missing.numel():
            raise ValueError(f"Videos {(missing + self.start).tolist()[:10]} of shard {self.shard} were never added.")
        embeddings = self.embeddings if self.embeddings is not None else torch.zeros(self.stop - self.start, 0)
        save_file({"embeddings": embeddings.contiguous(), "rows": self.rows.contiguous()},
                  str(self.directory / shard_file("tensors", self.shard)))
        meta = {
            "shard": self.shard, "start": self.start, "stop": self.stop, "num_rows": self._written,
            "num_tokens": self.num_tokens, "hidden_size": self.hidden_size, "has_token_sizes": self.has_token_sizes,
            "token_dtype": _dtype_name(self.token_dtype), "failures": self.failures,
        }
        (self.directory / shard_file("marker", self.shard)).write_text(json.dumps(meta), encoding="utf-8")


def forget_rows(directory: str | os.PathLike) -> None:
    """Makes a folder's store forget its rows before it is written anew (`settings.check_store_folder` with
    ``replace``): its plan, its index and every shard's closed marker, so that no shard of the old rows counts as
    written (each shard's writer removes the rest of its files when it starts)."""
    directory = Path(directory)
    for path in (directory / PLAN_FILE, directory / STORE_INFO_FILE, *directory.glob(shard_file("marker", "*"))):
        path.unlink(missing_ok=True)


def rewrite_shard(directory: str | os.PathLike, shard: int, keep: list[int], start: int) -> dict[str, Any]:
    """Rewrites the closed shard `shard` of a store so that it holds only the rows `keep` (positions in the shard,
    ascending) and begins at row `start` of the store: the rows a store removes (`homes.StoreHome.remove_rows`).
    Kept rows keep their bytes; the data files are rewritten only when an encoded row goes, the journal, the row map
    and the closed marker always (they name rows by their position in the store). Each file is written beside and
    renamed into place. Returns the new closed marker."""
    directory = Path(directory)
    marker_path = directory / shard_file("marker", shard)
    marker = read_json_file(marker_path)
    old_start, old_stop = int(marker["start"]), int(marker["stop"])
    if any(not 0 <= k < old_stop - old_start for k in keep) or list(keep) != sorted(set(keep)):
        raise ValueError(f"Shard {shard} holds rows 0..{old_stop - old_start - 1}; cannot keep {list(keep)[:10]}.")
    tensors = load_safetensors(directory / shard_file("tensors", shard))
    rows, embeddings = tensors["rows"], tensors["embeddings"]
    failures = {int(f["index"]) - old_start: f for f in marker["failures"]}
    kept_rows = sorted(int(rows[k]) for k in keep if int(rows[k]) >= 0)  # the encoded rows kept, in file order
    new_row = {old: new for new, old in enumerate(kept_rows)}
    if kept_rows != list(range(int(marker["num_rows"]))):  # an encoded row goes: its bytes leave every data file
        sizes = row_bytes(marker.get("num_tokens") or 0, marker.get("hidden_size") or 0,
                          TOKEN_DTYPES[marker["token_dtype"]], marker.get("has_token_sizes"), embeddings.shape[1])
        for kind, size in sizes.items():
            path = directory / shard_file(kind, shard)
            data = path.read_bytes() if path.exists() else b""
            replace_file(path, b"".join(data[row * size : (row + 1) * size] for row in kept_rows))
    new_rows = torch.tensor([new_row.get(int(rows[k]), -1) for k in keep], dtype=torch.long)
    kept_embeddings = embeddings[list(keep)] if len(keep) else embeddings[:0]
    replace_file(directory / shard_file("tensors", shard),
                 save({"embeddings": kept_embeddings.contiguous(), "rows": new_rows.contiguous()}))
    stop = start + len(keep)
    kept_failures = [{**failures[k], "index": start + j} for j, k in enumerate(keep) if k in failures]
    journal = [{"shard": int(shard), "start": start, "stop": stop, "token_dtype": marker["token_dtype"]}]
    if kept_rows:  # one batch of every kept encoded row, in row order (what `check_journal` reads)
        by_row = sorted((int(new_rows[j]), start + j) for j in range(len(keep)) if int(new_rows[j]) >= 0)
        journal.append({"encoded": [index for _, index in by_row], "num_tokens": marker["num_tokens"],
                        "hidden_size": marker["hidden_size"], "has_token_sizes": marker["has_token_sizes"],
                        "embedding_dim": int(embeddings.shape[1])})
    journal += [{"failed": f["index"], **{k: v for k, v in f.items() if k != "index"}} for f in kept_failures]
    replace_file(directory / shard_file("journal", shard), "".join(json.dumps(entry) + "\n" for entry in journal))
    marker = {**marker, "start": start, "stop": stop, "num_rows": len(kept_rows), "failures": kept_failures}
    replace_file(marker_path, json.dumps(marker))
    return marker


def missing_shards(directory: str | os.PathLike, num_shards: int) -> list[int]:
    """The shards among ``0..num_shards-1`` whose writer has not closed them in ``directory``."""
    return [s for s in range(num_shards) if not (Path(directory) / shard_file("marker", s)).is_file()]


def finalize_store(directory: str | os.PathLike, videos: list[str], num_shards: int,
                   info: dict[str, Any] | None = None, row_fields: dict[str, list[Any]] | None = None) -> Path:
    """Writes ``video_store.json`` once every shard is closed (call it on one process, after a barrier). Raises
    `FileNotFoundError` naming the missing shards when the directory does not hold them all, e.g. when processes on
    different machines wrote to directories that are not one shared filesystem."""
    directory = Path(directory)
    missing = missing_shards(directory, num_shards)
    if missing:
        raise FileNotFoundError(
            f"The video store {str(directory)!r} lacks shards {missing} of {num_shards}: every process must write to "
            "the same directory (on several machines, a shared filesystem)."
        )
    shards = [read_json_file(directory / shard_file("marker", s)) for s in range(num_shards)]
    ranges = sorted((m["start"], m["stop"]) for m in shards)
    position = 0
    for start, stop in ranges:
        if start != position:
            raise ValueError(f"The shards of {str(directory)!r} do not cover videos {position}..{start - 1}.")
        position = stop
    if position != len(videos):
        raise ValueError(f"The shards of {str(directory)!r} cover {position} videos, but {len(videos)} were given.")
    dtypes = {m["token_dtype"] for m in shards}
    if len(dtypes) > 1:
        raise ValueError(f"The shards of {str(directory)!r} hold tokens of different dtypes {sorted(dtypes)}.")
    shapes = {(m["num_tokens"], m["hidden_size"], m["has_token_sizes"]) for m in shards if m["num_tokens"] is not None}
    if len(shapes) > 1:
        raise ValueError(f"The shards of {str(directory)!r} hold different token shapes {sorted(shapes)}.")
    num_tokens, hidden_size, has_sizes = shapes.pop() if shapes else (None, None, None)
    meta = {
        "format": STORE_FORMAT, "version": STORE_VERSION, "num_videos": len(videos), "num_tokens": num_tokens,
        "hidden_size": hidden_size, "has_token_sizes": has_sizes, "token_dtype": shards[0]["token_dtype"],
        "shards": [{k: m[k] for k in ("shard", "start", "stop", "num_rows")} for m in shards],
        "failures": sorted((f for m in shards for f in m["failures"]), key=lambda f: f["index"]),
        "videos": [str(v) for v in videos], "info": dict(info or {}),
    }
    if row_fields:  # optional per-row fields (`start`/`end` of a moment, `dataset`), one value per video
        meta["row_fields"] = {key: list(values) for key, values in row_fields.items()}
    write_joined_embeddings(directory, meta)
    # written whole and then renamed: a reader sees the old index (e.g. of a store being grown) or the new one
    replace_file(directory / STORE_INFO_FILE, json.dumps(meta, indent=1))
    return directory


def check_joined_embeddings(path: Path, joined: torch.Tensor, shards: list[dict[str, Any]],
                            embeddings: list[torch.Tensor], samples: int = 8) -> None:
    """Raises `DamagedStoreError` naming `path` when up to `samples` evenly spaced rows of each shard differ from the
    shard's own embeddings (a joined file written for other shards, or overwritten)."""
    for shard, own in zip(shards, embeddings):
        count = shard["stop"] - shard["start"]
        if not count or own.shape[1] != joined.shape[1]:
            continue
        rows = sorted({count * j // samples for j in range(samples)})
        if not torch.equal(joined[[shard["start"] + r for r in rows]], own[rows]):
            raise DamagedStoreError(path, f"its rows of shard {shard['shard']} differ from that shard's embeddings")


def write_joined_embeddings(directory: Path, meta: dict[str, Any]) -> None:
    """Writes `JOINED_EMBEDDINGS_FILE` from the shards' embeddings, one shard at a time (memory-mapped), beside and
    renamed into place (a reader of the old index keeps its own mapping)."""
    if len(meta["shards"]) < 2:  # one shard's embeddings are mapped as they are
        (directory / JOINED_EMBEDDINGS_FILE).unlink(missing_ok=True)
        return
    shards = sorted(meta["shards"], key=lambda shard: shard["start"])
    paths = [directory / shard_file("tensors", shard["shard"]) for shard in shards]
    dims = {open_safetensors(path)["embeddings"].shape[1] for path in paths} - {0}
    if len(dims) != 1:
        return
    dim = dims.pop()
    partial = directory / f".{JOINED_EMBEDDINGS_FILE}.partial"
    with open(partial, "wb") as handle:
        for path in paths:
            embeddings = open_safetensors(path)["embeddings"].numpy()
            if embeddings.shape[1] != dim:  # a shard whose videos all failed: zero rows
                embeddings = np.zeros((embeddings.shape[0], dim), dtype=np.float32)
            handle.write(np.ascontiguousarray(embeddings, dtype=np.float32).tobytes())
    os.replace(partial, directory / JOINED_EMBEDDINGS_FILE)


SAFETENSORS_NUMPY_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
                            "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}


# Linux's MADV_POPULATE_READ (5.14+; Python 3.11's mmap module does not name it): map every page of a mapping for
# reading now, without copying a private mapping's pages (MAP_POPULATE would copy them, as for a write).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def populate_for_reading(mapped: mmap.mmap) -> None:
    """Maps the pages of `mapped` now where the OS can, so that the random rows a search re-scores do not each
    fault on first use; elsewhere they are mapped on use."""
    if sys.platform.startswith("linux"):
        try:
            mapped.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError):
            pass  # an older kernel


def safetensors_header(handle: Any, path: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """The header size and tensors (name -> ``dtype``, ``shape``, ``data_offsets``) of an open safetensors file,
    checked against the file's size: `DamagedStoreError` naming ``path`` when it is truncated or not safetensors."""
    size = os.fstat(handle.fileno()).st_size
    if size < 8:
        raise DamagedStoreError(path, f"it holds {size} bytes, less than a safetensors header (truncated)")
    header_size = int.from_bytes(handle.read(8), "little")
    if 8 + header_size > size:
        raise DamagedStoreError(path, f"its header announces {header_size} bytes but the file holds {size} "
                                      "(truncated, or not a safetensors file)")
    try:
        header = json.loads(handle.read(header_size))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedStoreError(path, f"its header is not valid JSON ({error}): not a safetensors file") from None
    if not isinstance(header, dict):
        raise DamagedStoreError(path, "its header is not a JSON object: not a safetensors file")
    header.pop("__metadata__", None)
    for name, meta in header.items():
        try:
            start, stop = (int(x) for x in meta["data_offsets"])
            count = int(np.prod([int(d) for d in meta["shape"]]))
            dtype = str(meta["dtype"])
        except (KeyError, TypeError, ValueError):
            raise DamagedStoreError(path, f"the header entry of tensor {name!r} is malformed: {meta!r}") from None
        if not 0 <= start <= stop:
            raise DamagedStoreError(path, f"tensor {name!r} has invalid data offsets {[start, stop]}")
        if 8 + header_size + stop > size:
            raise DamagedStoreError(path, f"tensor {name!r} ends at byte {8 + header_size + stop} but the file "
                                          f"holds {size} bytes (truncated)")
        itemsize = SAFETENSORS_ITEMSIZES.get(dtype)
        if itemsize is not None and stop - start != count * itemsize:
            raise DamagedStoreError(path, f"tensor {name!r} of shape {meta['shape']} {dtype} spans "
                                          f"{stop - start} bytes, not {count * itemsize}")
    return header_size, header


SAFETENSORS_ITEMSIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read into memory (`load_file`), after checking its header against its
    size: `DamagedStoreError` naming ``path`` when it is missing, truncated or not safetensors."""
    try:
        with open(path, "rb") as handle:
            safetensors_header(handle, path)
        return load_file(str(path))
    except FileNotFoundError:
        raise DamagedStoreError(path, "the file is missing") from None
    except DamagedStoreError:
        raise
    except Exception as error:  # safetensors raises its own error types
        raise DamagedStoreError(path, f"safetensors cannot read it ({error})") from None


def open_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped, not copied: a private (copy-on-write) mapping, its pages
    mapped at once where the OS can (`populate_for_reading`). Files with a dtype numpy lacks (bfloat16) are read
    with `load_file` instead. Raises `DamagedStoreError` naming ``path`` when it is missing, truncated or not a
    safetensors file."""
    try:
        handle = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise DamagedStoreError(path, "the file is missing") from None
    with handle:
        header_size, header = safetensors_header(handle, path)
        if any(meta["dtype"] not in SAFETENSORS_NUMPY_DTYPES for meta in header.values()):
            return load_safetensors(path)
        size = os.fstat(handle.fileno()).st_size
        if size <= 8 + header_size:
            mapped = b""
        elif not hasattr(mmap, "MAP_PRIVATE"):  # Windows
            mapped = np.memmap(path, dtype=np.uint8, mode="c")
        else:
            mapped = mmap.mmap(handle.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            populate_for_reading(mapped)
    tensors = {}
    for name, meta in header.items():
        dtype, shape = SAFETENSORS_NUMPY_DTYPES[meta["dtype"]], tuple(meta["shape"])
        start, stop = meta["data_offsets"]
        if start == stop:
            tensors[name] = torch.from_numpy(np.zeros(shape, dtype=dtype))
            continue
        array = np.frombuffer(mapped, dtype=dtype, count=int(np.prod(shape)), offset=8 + header_size + start)
        tensors[name] = torch.from_numpy(array.reshape(shape))
    return tensors


def is_video_store(directory: str | os.PathLike) -> bool:
    return (Path(directory) / STORE_INFO_FILE).is_file()


STORE_FIELDS = {"num_videos": int, "shards": list, "videos": list, "failures": list, "token_dtype": str}
SHARD_FIELDS = ("shard", "start", "stop", "num_rows")


def store_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    """What ``video_store.json`` of a finalised store says, without reading any tensor: ``videos`` (names, in store
    order), ``failures`` (``{"index", "video", "reason"}``), ``info`` (how it was built), ``shards`` (``{"shard",
    "start", "stop", "num_rows"}``), ``num_videos``, ``num_tokens``, ``hidden_size``, ``token_dtype``, ...

    Raises `FileNotFoundError` naming ``directory`` when it is not a (finalised) store, and `DamagedStoreError`
    (a `ValueError`) naming ``video_store.json`` and what is wrong when it cannot be read or is inconsistent."""
    path = Path(directory) / STORE_INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(f"No video store in {str(directory)!r}: {STORE_INFO_FILE} is missing.")
    meta = read_json_file(path)
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT or meta.get("version") != STORE_VERSION:
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else (type(meta).__name__, None)
        raise DamagedStoreError(path, f"it is not a version-{STORE_VERSION} {STORE_FORMAT} (got {got[0]!r} version "
                                      f"{got[1]!r})")
    for key, kind in STORE_FIELDS.items():
        if not isinstance(meta.get(key), kind):
            raise DamagedStoreError(path, f"field {key!r} should be a {kind.__name__}, got {meta.get(key)!r:.80}")
    if meta["token_dtype"] not in TOKEN_DTYPES:
        raise DamagedStoreError(path, f"field 'token_dtype' is {meta['token_dtype']!r}, not one of "
                                      f"{sorted(TOKEN_DTYPES)}")
    if len(meta["videos"]) != meta["num_videos"]:
        raise DamagedStoreError(path, f"it names {len(meta['videos'])} videos but says num_videos "
                                      f"{meta['num_videos']}")
    position = 0
    for shard in sorted(meta["shards"], key=lambda s: s.get("start", -1) if isinstance(s, dict) else -1):
        if not isinstance(shard, dict) or not all(isinstance(shard.get(k), int) for k in SHARD_FIELDS):
            raise DamagedStoreError(path, f"a shard entry lacks integer {SHARD_FIELDS}: {shard!r:.120}")
        if shard["start"] != position or shard["stop"] < shard["start"]:
            raise DamagedStoreError(path, f"its shards do not cover videos {position}..{shard['start'] - 1} "
                                          f"(shard {shard['shard']}: [{shard['start']}, {shard['stop']}))")
        position = shard["stop"]
    if position != meta["num_videos"]:
        raise DamagedStoreError(path, f"its shards cover {position} videos, not num_videos {meta['num_videos']}")
    return meta


def _journal_entries(directory: Path) -> Iterable[dict[str, Any]]:
    """The entries (after the header) of every shard journal in ``directory``; a torn last line is left out."""
    for journal in sorted(directory.glob(shard_file("journal", "*"))):
        for line in journal.read_text(encoding="utf-8").splitlines()[1:]:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def journaled_count(directory: str | os.PathLike) -> int:
    """Videos written or marked failed in all the shard journals of ``directory`` (a store being written, or a
    finished one): what a resumed run will not encode again. 0 for a directory without journals."""
    return sum(len(entry["encoded"]) if "encoded" in entry else 1 for entry in _journal_entries(Path(directory)))


def journaled_failures(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """``{"index", "video", "reason"}`` of every video marked failed in the shard journals of ``directory``, by
    index (for a store still being written; a finalised one has them in `store_metadata`)."""
    failures = [{"index": entry["failed"], "video": entry["video"],
                 **({"code": entry["code"]} if "code" in entry else {}), "reason": entry["reason"]}
                for entry in _journal_entries(Path(directory)) if "failed" in entry]
    return sorted(failures, key=lambda failure: failure["index"])


def open_shard(directory: Path, shard: dict[str, Any], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The ``rows`` and ``embeddings`` of one shard of a finalised store, after checking (without reading any token)
    that its files are whole and that every row belongs to its video (see the module's docstring). Raises
    `DamagedStoreError` naming the file and what is wrong."""
    number, start, stop, num_rows = (int(shard[key]) for key in SHARD_FIELDS)
    count = stop - start
    path = directory / shard_file("tensors", number)
    tensors = open_safetensors(path)
    rows, embeddings = tensors.get("rows"), tensors.get("embeddings")
    if rows is None or embeddings is None or rows.shape != (count,) or embeddings.ndim != 2 or \
            embeddings.shape[0] != count:
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        raise DamagedStoreError(path, f"it should hold `rows` ({count},) and `embeddings` ({count}, dim) for videos "
                                      f"[{start}, {stop}), holds {shapes}")
    check_row_map(path, rows, num_rows)
    dim = int(embeddings.shape[1])
    sizes = row_bytes(meta.get("num_tokens") or 0, meta.get("hidden_size") or 0, TOKEN_DTYPES[meta["token_dtype"]],
                      meta.get("has_token_sizes"), dim)
    for kind, size in sizes.items():
        check_data_file(directory / shard_file(kind, number), num_rows, size)
    journal = directory / shard_file("journal", number)
    if journal.is_file():  # a store copied without its journals is read without this check
        check_journal(journal, rows, number, start, stop)
    if num_rows and dim:
        check_row_embeddings(directory / shard_file("embeddings", number), path, rows, embeddings, start)
    return tensors


def check_row_map(path: Path, rows: torch.Tensor, num_rows: int) -> None:
    """A shard's row map gives every encoded video its own row of ``[0, num_rows)``, and failed videos -1."""
    values = rows.numpy()
    outside = (values < -1) | (values >= num_rows)
    if outside.any():
        bad = int(np.flatnonzero(outside)[0])
        raise DamagedStoreError(path, f"its row map gives video {bad} of the shard row {int(values[bad])}, outside "
                                      f"[0, {num_rows}) (-1: failed)")
    valid = values[values >= 0]
    if valid.size != num_rows or (valid.size and np.bincount(valid, minlength=num_rows).max() > 1):
        raise DamagedStoreError(path, f"its row map gives {valid.size} encoded videos {np.unique(valid).size} "
                                      f"distinct rows, but the shard has {num_rows} rows")


def check_data_file(path: Path, num_rows: int, row_bytes: int) -> None:
    """A ``.bin`` file holds exactly ``num_rows`` rows of ``row_bytes``: fewer is a truncated file, more is rows
    that no video owns (e.g. appended by a second writer)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        if num_rows * row_bytes == 0:
            return
        raise DamagedStoreError(path, f"the file is missing (it should hold {num_rows} rows)") from None
    expected = num_rows * row_bytes
    if size != expected:
        what = "truncated" if size < expected else "rows that no video owns (two writers at once)"
        raise DamagedStoreError(path, f"it holds {size} bytes, but its shard has {num_rows} rows of {row_bytes} "
                                      f"bytes ({expected}): {what}")


def check_journal(path: Path, rows: torch.Tensor, shard: int, start: int, stop: int) -> None:
    """The journal of a closed shard names each of its videos once, in row order: the k-th encoded video is at row
    k of the row map, and failed videos are failed there."""
    try:
        lines = path.read_bytes().decode("utf-8").split("\n")
    except UnicodeDecodeError as error:
        raise DamagedStoreError(path, f"it is not UTF-8 text (byte {error.start})") from None
    if lines and lines[-1] == "":
        lines.pop()
    entries = []
    for number, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise DamagedStoreError(path, f"line {number} of {len(lines)} is not valid JSON ({error.msg}; "
                                          f"{line[:60]!r}): truncated?") from None
        if not isinstance(entry, dict) or (number > 1 and not ("encoded" in entry or "failed" in entry)):
            raise DamagedStoreError(path, f"line {number} is not a journal entry: {line[:60]!r}")
        entries.append(entry)
    if not entries or (entries[0].get("shard"), entries[0].get("start"), entries[0].get("stop")) != \
            (shard, start, stop):
        raise DamagedStoreError(path, f"its header {entries[:1]} is not that of shard {shard} [{start}, {stop})")
    encoded = [int(i) for entry in entries[1:] for i in entry.get("encoded", [])]
    failed = [int(entry["failed"]) for entry in entries[1:] if "failed" in entry]
    local = np.asarray(encoded + failed, dtype=np.int64) - start
    if local.size and (local.min() < 0 or local.max() >= stop - start):
        raise DamagedStoreError(path, f"it names videos outside its shard's range [{start}, {stop})")
    counts = np.bincount(local, minlength=stop - start)
    if (counts > 1).any():
        twice = start + int(np.flatnonzero(counts > 1)[0])
        where = [n for n, entry in enumerate(entries, start=1) if twice in entry.get("encoded", [])
                 or entry.get("failed") == twice]
        raise DamagedStoreError(path, f"video {twice} appears {int(counts[twice - start])} times (lines "
                                      f"{where}): the shard was written by two writers at once")
    if (counts == 0).any():
        raise DamagedStoreError(path, f"it names {int((counts > 0).sum())} of the {stop - start} videos of its shard")
    row_map = rows.numpy()
    encoded_at = np.asarray(encoded, dtype=np.int64) - start
    wrong = np.flatnonzero(row_map[encoded_at] != np.arange(len(encoded))) if encoded else np.empty(0, np.int64)
    if wrong.size:
        k = int(wrong[0])
        raise DamagedStoreError(path, f"it wrote video {encoded[k]} as row {k}, but the shard's row map says row "
                                      f"{int(row_map[encoded_at[k]])}: rows and videos do not match")
    if failed and (row_map[np.asarray(failed) - start] != -1).any():
        raise DamagedStoreError(path, "videos it marks failed have rows in the shard's row map")


# Rows compared at a time by `check_row_embeddings` (32 MB of 256-d fp32 embeddings per side): bounded memory.
CHECK_CHUNK_ROWS = 32_768


def contiguous_rows(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``array[rows]``, as a view (no copy, no gather) when ``rows`` are consecutive, as they mostly are."""
    if rows.size and int(rows[-1]) - int(rows[0]) == rows.size - 1 and (np.diff(rows) == 1).all():
        return array[int(rows[0]) : int(rows[-1]) + 1]
    return array[rows]


def check_row_embeddings(path: Path, shard_path: Path, rows: torch.Tensor, embeddings: torch.Tensor,
                         start: int) -> None:
    """Each row of ``embeddings-NNNNN.bin`` (written with the row's tokens, in row order) equals, bit for bit, the
    embedding the writer kept for the video the row map gives it: a row written by another writer does not. Read
    in chunks of `CHECK_CHUNK_ROWS`, so memory stays bounded whatever the shard's size."""
    dim = embeddings.shape[1]
    row_order = np.memmap(path, dtype=np.float32, mode="r").reshape(-1, dim)
    row_map, kept_all = rows.numpy(), embeddings.numpy()
    videos = np.flatnonzero(row_map >= 0)
    mismatched, first = 0, None
    for begin in range(0, len(videos), CHECK_CHUNK_ROWS):
        chunk = videos[begin : begin + CHECK_CHUNK_ROWS]
        kept, in_rows = contiguous_rows(kept_all, chunk), contiguous_rows(row_order, row_map[chunk])
        same = (kept.view(np.uint32) == in_rows.view(np.uint32)).all(axis=1)  # bit for bit (NaN included)
        if not same.all():
            mismatched += int((~same).sum())
            first = first if first is not None else int(chunk[np.flatnonzero(~same)[0]])
    del row_order
    if mismatched:
        raise DamagedStoreError(path, f"{mismatched} of its {len(videos)} rows do not hold the embedding "
                                      f"{shard_path.name} keeps for their video (first: row {int(row_map[first])}, "
                                      f"video {start + first}): their tokens belong to other videos")


class VideoTokenStore:
    """Read access to a finalised store: embeddings memory-mapped, tokens read from disk on demand. Opening reads
    the json index and the shards' row maps only (a store of one shard maps its embeddings without copying; several
    shards are joined into one copy).

    Attributes:
        embeddings (`torch.FloatTensor` of shape `(num_videos, projection_dim)`): rows of failed videos are zeros.
        valid (`torch.BoolTensor` of shape `(num_videos,)`): whether each video was encoded; `num_valid` counts them.
        failures (`list[dict]`): ``{"index", "video", "reason"}`` of every video that could not be encoded.
        videos (`list[str]`), info (`dict`), num_tokens, hidden_size, token_dtype, has_token_sizes.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        meta = store_metadata(directory)  # raises naming the folder when it is not a store
        self.directory, self.meta = directory, meta
        self.videos: list[str] = list(meta["videos"])
        self.info: dict[str, Any] = dict(meta.get("info", {}))
        self.failures: list[dict[str, Any]] = list(meta["failures"])
        self.num_tokens, self.hidden_size = meta["num_tokens"], meta["hidden_size"]
        self.has_token_sizes = bool(meta["has_token_sizes"])
        self.token_dtype = TOKEN_DTYPES[meta["token_dtype"]]
        n = int(meta["num_videos"])
        self._shard_of = torch.empty(n, dtype=torch.long)
        self._row_of = torch.empty(n, dtype=torch.long)
        embeddings = []
        for shard in meta["shards"]:
            tensors = open_shard(directory, shard, meta)
            self._shard_of[shard["start"] : shard["stop"]] = shard["shard"]
            self._row_of[shard["start"] : shard["stop"]] = tensors["rows"]
            embeddings.append(tensors["embeddings"])
        dims = {e.shape[1] for e in embeddings if e.shape[0] and e.shape[1]}
        dim = dims.pop() if dims else 0
        joined = directory / JOINED_EMBEDDINGS_FILE
        if len(embeddings) > 1 and dim and joined.is_file() and joined.stat().st_size == n * dim * 4:
            # mapped, not joined: no copy of the collection's embeddings in this process
            self.embeddings = torch.from_numpy(np.memmap(joined, dtype=np.float32, mode="c", shape=(n, dim)))
            check_joined_embeddings(joined, self.embeddings, meta["shards"], embeddings)
        else:  # one shard is mapped already; a store written before the joined file existed is joined here
            embeddings = [e if e.shape[1] == dim else torch.zeros(e.shape[0], dim) for e in embeddings]
            self.embeddings = embeddings[0] if len(embeddings) == 1 else \
                torch.cat(embeddings) if embeddings else torch.zeros(0, dim)
        self.valid = self._row_of >= 0
        self.num_valid = int(self.valid.sum())
        self._files: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        return len(self.videos)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            os.close(fd)
        self._files = {}

    @property
    def token_bytes(self) -> int:
        """Bytes of one video's tokens on disk."""
        shape, stored = token_row_shape(self.num_tokens or 0, self.hidden_size or 0, self.token_dtype)
        return shape[0] * shape[1] * stored.itemsize if self.num_tokens and self.hidden_size else 0

    def _fd(self, kind: str, shard: int) -> int:
        key = (kind, shard)
        if key not in self._files:
            path = self.directory / shard_file(kind, shard)
            try:
                self._files[key] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise DamagedStoreError(path, "the file is missing (it was there when the store was opened)") from None
        return self._files[key]

    def _read(self, kind: str, indices: torch.Tensor, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty((indices.shape[0], *row_shape), dtype=dtype)
        if indices.shape[0] == 0:
            return out
        flat = out.view(indices.shape[0], -1).view(torch.uint8).numpy()
        row_bytes = flat.shape[1]
        order = sorted(range(indices.shape[0]), key=lambda j: (int(self._shard_of[indices[j]]),
                                                               int(self._row_of[indices[j]])))
        for j in order:
            video = int(indices[j])
            shard, row = int(self._shard_of[video]), int(self._row_of[video])
            fd, offset, done = self._fd(kind, shard), row * row_bytes, 0
            while done < row_bytes:
                got = os.preadv(fd, [memoryview(flat[j])[done:]], offset + done)
                if got <= 0:
                    raise DamagedStoreError(self.directory / shard_file(kind, shard),
                                            f"it is truncated: row {row} (video {video}) ends at byte "
                                            f"{offset + row_bytes}, after the end of the file")
                done += got
        return out

    def _indices(self, indices: Any) -> torch.Tensor:
        if isinstance(indices, slice):
            indices = range(*indices.indices(len(self)))
        indices = torch.as_tensor(indices, dtype=torch.long).flatten().cpu()
        if indices.numel() and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"Video indices must lie in [0, {len(self)}), got {indices.tolist()[:10]}.")
        failed = indices[~self.valid[indices]]
        if failed.numel():
            names = [self.videos[int(i)] for i in failed[:3]]
            raise ValueError(f"Videos {failed.tolist()[:10]} ({names}) could not be encoded and have no tokens.")
        return indices

    def read_tokens(self, indices: Any) -> torch.Tensor:
        """``(len(indices), num_tokens, hidden_size)`` tokens of the given videos, in the store's dtype."""
        indices = self._indices(indices)
        shape, stored = token_row_shape(self.num_tokens, self.hidden_size, self.token_dtype)
        tokens = self._read("tokens", indices, shape, stored)
        return unpack(tokens) if self.token_dtype == torch.int8 else tokens

    def read_token_sizes(self, indices: Any) -> torch.Tensor | None:
        """``(len(indices), num_tokens)`` fp32 token sizes, or None when the store has none."""
        if not self.has_token_sizes:
            return None
        indices = self._indices(indices)
        return self._read("token_sizes", indices, (self.num_tokens,), torch.float32)

    @property
    def tokens(self) -> "StoredTensor":
        """The tokens as a lazy ``(num_videos, num_tokens, hidden_size)`` tensor-like (indexing reads from disk)."""
        return StoredTensor(self, "tokens")

    @property
    def token_sizes(self) -> "StoredTensor | None":
        return StoredTensor(self, "token_sizes") if self.has_token_sizes else None


class StoredTensor:
    """A tensor-like view of a store's tokens (or token sizes): ``view[indices]`` reads those rows from disk and
    returns a `torch.Tensor`; ``shape``, ``dtype`` and ``len`` work without reading anything."""

    def __init__(self, store: VideoTokenStore, kind: str):
        self.store, self.kind = store, kind

    @property
    def shape(self) -> torch.Size:
        rows = (len(self.store), self.store.num_tokens or 0)
        return torch.Size(rows + ((self.store.hidden_size or 0,) if self.kind == "tokens" else ()))

    @property
    def dtype(self) -> torch.dtype:
        if self.kind == "tokens" and self.store.token_dtype != torch.int8:
            return self.store.token_dtype
        return torch.float32  # token sizes, and int8 tokens (read dequantized)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, indices: Any) -> torch.Tensor:
        single = isinstance(indices, int) or (isinstance(indices, torch.Tensor) and indices.ndim == 0)
        read = self.store.read_tokens if self.kind == "tokens" else self.store.read_token_sizes
        out = read([int(indices)] if single else indices)
        return out[0] if single else out

    def materialize(self) -> torch.Tensor:
        """All rows, in memory."""
        return self[slice(None)]
