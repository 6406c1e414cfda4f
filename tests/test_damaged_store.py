"""Damaged video stores are named, not searched: every error from opening or reading a store is a
`DamagedStoreError` naming the file (``.path``) and what is wrong with it (``.reason``).

Each case damages one file of a clean store the way users' disks and tools do (truncation, random bytes, garbage,
a torn journal line, a missing file) or the way two writers at once do (duplicated journal lines, rows appended
twice, rows out of order), and checks the exception's file and reason. The clean store itself opens and reads back
what was written (the reference for the undamaged case), and so does a store rebuilt from the same tensors."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testa_search import DamagedStoreError
from testa_search.index import FIRST_STAGE_INFO_FILE, VideoIndex, faiss_module
from testa_search.store.video_store import VideoStoreWriter, VideoTokenStore, finalize_store

COUNT, TOKENS, HIDDEN, DIM = 12, 5, 4, 8
NAMES = [f"video{i:02d}.mp4" for i in range(COUNT)]


def tensors(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(COUNT, TOKENS, HIDDEN, generator=generator)
    embeddings = torch.nn.functional.normalize(torch.randn(COUNT, DIM, generator=generator), dim=-1)
    return tokens, embeddings


def write_store(directory: Path, writers=None) -> Path:
    """Two shards of 6 videos, float32 tokens, written in batches of 2 (video 4 failed)."""
    tokens, embeddings = tensors()
    for shard, (start, stop) in enumerate([(0, 6), (6, 12)]):
        writer = VideoStoreWriter(directory, shard, start, stop, token_dtype=torch.float32)
        for first in range(start, stop, 2):
            batch = [i for i in (first, first + 1) if i != 4]
            writer.add_batch(batch, tokens[batch], None, embeddings[batch])
        if start == 0:
            writer.add_failure(4, NAMES[4], "ValueError: no frames")
        writer.close()
    finalize_store(directory, NAMES, 2)
    return directory


@pytest.fixture
def store(tmp_path) -> Path:
    return write_store(tmp_path / "store")


def damaged(directory: Path) -> DamagedStoreError:
    with pytest.raises(DamagedStoreError) as caught:
        index = VideoIndex.load(directory)
        index.tokens[torch.arange(len(index))[index.valid]]  # what a search reads
    return caught.value


def test_a_clean_store_opens_and_reads_back_what_was_written(store):
    tokens, embeddings = tensors()
    opened = VideoTokenStore(store)
    valid = [i for i in range(COUNT) if i != 4]
    assert opened.valid.tolist() == [i != 4 for i in range(COUNT)]
    assert torch.equal(opened.read_tokens(valid), tokens[valid])
    assert torch.equal(opened.embeddings[valid], embeddings[valid])


def test_a_truncated_shard_file_is_named(store):
    path = store / "shard-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-20])  # was: "buffer is smaller than requested size"
    error = damaged(store)
    assert error.path == path and "truncated" in error.reason and str(path) in str(error)
    path.write_bytes(path.read_bytes()[:5])
    assert damaged(store).reason.endswith("less than a safetensors header (truncated)")


def test_random_bytes_in_the_store_index_are_named(store):
    path = store / "video_store.json"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes())
    error = damaged(store)  # was: a UTF-8 decode error
    assert error.path == path and error.reason.startswith("it is not UTF-8 text (byte ")
    path.write_text('{"format": "testa-video-store", "version": 1, "num_videos": 12, "shar')
    assert damaged(store).reason.startswith("it is not valid JSON (Unterminated string")
    path.write_text(json.dumps({"format": "testa-video-store", "version": 1, "num_videos": 12, "shards": [],
                                "videos": NAMES, "failures": [], "token_dtype": "float32"}))
    assert damaged(store).reason == "its shards cover 0 videos, not num_videos 12"


@pytest.mark.skipif(faiss_module() is None, reason="the saved first stage needs faiss")
def test_garbage_in_the_first_stage_is_named_and_the_stage_rebuilt(store, caplog):
    """The first stage is derived from the embeddings: a damaged one is rebuilt with a warning naming the file, as
    a stale or unreadable FAISS file is, and search gives the exact answer."""
    index = VideoIndex.load(store)
    index.build_first_stage(kind="hnsw")  # approximate kinds are saved beside the store
    index.save_first_stage(store)
    assert VideoIndex.load(store).first_stage is not None
    path = store / FIRST_STAGE_INFO_FILE
    path.write_bytes(b"\x00garbage{")  # was: a JSON parse error
    with caplog.at_level(logging.WARNING):
        reopened = VideoIndex.load(store)
    assert reopened.first_stage is None
    assert f"Ignoring the unreadable first stage {path}" in caplog.text and "not valid JSON" in caplog.text
    queries = tensors(1)[1][:3]
    scores, rows = reopened.nearest(queries, k=4)
    exact = (queries @ reopened.embeddings[reopened.valid].T).topk(4).values
    torch.testing.assert_close(scores, exact)


def test_a_torn_journal_line_is_named(store):
    path = store / "journal-00000.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 30])
    error = damaged(store)
    assert error.path == path and "is not valid JSON" in error.reason and "truncated?" in error.reason
    assert error.reason.startswith(f"line {len(text.splitlines())} of {len(text.splitlines())}")


@pytest.mark.parametrize("name", ["shard-00001.safetensors", "tokens-00000.bin", "embeddings-00001.bin"])
def test_a_missing_file_is_named(store, name):
    (store / name).unlink()
    error = damaged(store)
    assert error.path == store / name and error.reason.startswith("the file is missing")


def test_a_truncated_token_file_is_named_when_opened_and_when_read(store, tmp_path):
    path = store / "tokens-00001.bin"
    opened = VideoTokenStore(store)
    with open(path, "r+b") as handle:
        handle.truncate(3 * TOKENS * HIDDEN * 4)
    error = damaged(store)
    assert error.path == path and error.reason == (f"it holds {3 * TOKENS * HIDDEN * 4} bytes, but its shard has 6 "
                                                   f"rows of {TOKENS * HIDDEN * 4} bytes ({6 * TOKENS * HIDDEN * 4}):"
                                                   " truncated")
    with pytest.raises(DamagedStoreError, match=r"it is truncated: row 5 \(video 11\)") as caught:
        opened.read_tokens([11])  # opened before the damage: named when read
    assert caught.value.path == path


def test_two_writers_appending_to_one_shard_are_detected(tmp_path):
    """What two runs on one store did: two writers of the same shard, the second started after the first wrote a
    batch, each writing the videos it had not seen journaled. Both close without an error; the store is refused."""
    tokens, embeddings = tensors()
    first = VideoStoreWriter(tmp_path, 0, 0, COUNT, token_dtype=torch.float32, resume=True)
    first.add_batch([0, 1], tokens[:2], None, embeddings[:2])
    second = VideoStoreWriter(tmp_path, 0, 0, COUNT, token_dtype=torch.float32, resume=True)
    assert second.done == {0, 1}
    for start in range(2, COUNT, 2):
        for writer in (second, first):
            writer.add_batch([start, start + 1], tokens[start:start + 2], None, embeddings[start:start + 2])
    first.close()
    second.close()
    finalize_store(tmp_path, NAMES, 1)
    error = damaged(tmp_path)
    assert error.path == tmp_path / "tokens-00000.bin" and error.reason.endswith(
        "rows that no video owns (two writers at once)")


def test_a_video_journaled_twice_is_detected(store):
    path = store / "journal-00001.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[2]]) + "\n")  # a second writer's copy of a batch
    error = damaged(store)
    assert error.path == path and error.reason == ("video 8 appears 2 times (lines [3, 5]): the shard was written by "
                                                   "two writers at once")


def test_rows_that_belong_to_other_videos_are_detected(store):
    """Rows 0 and 1 of shard 1 swapped in the data files (the row map and journal unchanged): the sizes agree,
    but the rows' embeddings are the other video's, and so would be their tokens."""
    for name, row_bytes in (("tokens-00001.bin", TOKENS * HIDDEN * 4), ("embeddings-00001.bin", DIM * 4)):
        data = bytearray((store / name).read_bytes())
        data[:2 * row_bytes] = data[row_bytes:2 * row_bytes] + data[:row_bytes]
        (store / name).write_bytes(bytes(data))
    error = damaged(store)
    assert error.path == store / "embeddings-00001.bin"
    assert error.reason == ("2 of its 6 rows do not hold the embedding shard-00001.safetensors keeps for their video "
                            "(first: row 0, video 6): their tokens belong to other videos")


def test_a_journal_out_of_row_order_is_detected(store):
    path = store / "journal-00001.jsonl"
    lines = path.read_text().splitlines()
    lines[1], lines[2] = lines[2], lines[1]
    path.write_text("\n".join(lines) + "\n")
    error = damaged(store)
    assert error.path == path and error.reason == ("it wrote video 8 as row 0, but the shard's row map says row 2: "
                                                   "rows and videos do not match")


def test_a_single_file_index_with_a_damaged_file_is_named(tmp_path):
    tokens, embeddings = tensors()
    VideoIndex(videos=NAMES, embeddings=embeddings, tokens=tokens).save(tmp_path / "index", as_store=False)
    path = tmp_path / "index" / "video_index.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    error = damaged(tmp_path / "index")
    assert error.path == path and "truncated" in error.reason


def test_a_store_copied_after_the_damage_is_still_refused(store, tmp_path):
    """The checks read the files, not anything kept from the writer."""
    path = store / "journal-00000.jsonl"
    path.write_text(path.read_text() + "{\"encoded\": [0]}\n")
    copy = shutil.copytree(store, tmp_path / "copy")
    error = damaged(Path(copy))
    assert error.path == Path(copy) / "journal-00000.jsonl" and "video 0 appears 2 times" in error.reason


def test_damaged_train_index_files_are_named(store, tmp_path):
    """`train.index`'s own files: a damaged `index_settings.json` stops `train.search` and `train.index` naming it
    (before any model is loaded by the search, and before anything is written by the index)."""
    from helpers.pipelines import build_retrieval, save_folder, tiny_processor
    from helpers.videos import write_noise_video

    from testa_search.cli.index import main as index_main
    from testa_search.cli.search import search

    settings = store / "index_settings.json"
    settings.write_bytes(b"\xff\xfe{not json")
    with pytest.raises(DamagedStoreError, match="index_settings.json': it is not UTF-8 text") as caught:
        search(str(store), ["a query"])
    assert caught.value.path == settings

    model = save_folder(build_retrieval(), tiny_processor(), tmp_path / "model")
    write_noise_video(tmp_path / "videos" / "clip.mp4", seed=0)
    before = {p.name: p.stat().st_mtime_ns for p in store.iterdir()}
    with pytest.raises(SystemExit, match=rf"error: Damaged video store file '{settings}': it is not UTF-8 text"):
        index_main(["--model", str(model), "--videos", str(tmp_path / "videos"), "--store", str(store),
                    "--num-workers", "0"])
    assert {p.name: p.stat().st_mtime_ns for p in store.iterdir()} == before
