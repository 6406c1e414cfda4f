"""The Milvus home against a real `milvus-lite server` process on the loopback, and an embedded Milvus Lite file.

References: the rows a build must hold are known exactly (a stand-in encoder whose embedding of row i is row i of a
seeded table, `helpers/milvus_writer.py`); search is compared with exact float64 top-10 in torch over the same
embeddings; filters with the payload computed in Python."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.requirements import require

require("pymilvus")
require("milvus_lite")

from helpers.milvus_server import milvus_lite_server, stop  # noqa: E402
from helpers.milvus_writer import SETTINGS, LookupModel, collection  # noqa: E402

from testa_search.build import IndexBuild  # noqa: E402
from testa_search.homes import InMemoryHome  # noqa: E402
from testa_search.encoding import encode_videos  # noqa: E402
from testa_search.milvus import MilvusHome, matches, row_key  # noqa: E402


def by_row(entries, positions):
    """The stand-in decoder of `LookupModel`: a row's "pixels" are its number."""
    return ([[p], torch.tensor([float(p)]), []] for p in positions)

COUNT, DIM = 400, 32
ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `milvus-lite server` bound to 127.0.0.1 on a free port; stopped whatever happens."""
    with milvus_lite_server(tmp_path_factory.mktemp("milvus_data")) as uri:
        yield uri


def writer(uri: str, start: int, stop_row: int, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS.parent)]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(HELPERS / "milvus_writer.py"), uri, str(COUNT), str(DIM),
                             str(start), str(stop_row), str(delay)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def exact_top(queries: torch.Tensor, vectors: torch.Tensor, rows: list[int], k: int) -> list[list[int]]:
    scores = queries.double() @ vectors[rows].double().T
    return [[rows[j] for j in order] for order in scores.topk(min(k, len(rows)), dim=1).indices.tolist()]


def test_two_writers_one_killed_and_resumed_give_the_rows_of_an_in_process_build(server):
    entries, vectors = collection(COUNT, DIM)
    half = len(entries) // 2
    first, second = writer(server, 0, half, 0.0), writer(server, half, len(entries), 0.02)
    try:
        assert first.wait(timeout=240) == 0, first.stderr.read().decode()[-3000:]
        home = MilvusHome(server, dim=DIM)
        deadline = time.monotonic() + 120  # kill the second writer once it has written some of its rows
        while len(home.existing_keys([row_key(e.name(i), e.start, e.end)
                                      for i, e in enumerate(entries[half:], half)])) < 20:
            ended = second.poll() is not None
            assert not ended and time.monotonic() < deadline, "the second writer ended too early: " + (
                second.stderr.read().decode()[-3000:] if ended else "timed out")
            time.sleep(0.2)
        second.send_signal(signal.SIGKILL)
        second.wait(timeout=30)
    finally:
        stop(first)
        stop(second)
    partial = len(home.existing_keys([row_key(e.name(i), e.start, e.end) for i, e in enumerate(entries)]))
    assert half + 20 <= partial < len(entries)
    resumed = writer(server, half, len(entries), 0.0)
    try:
        assert resumed.wait(timeout=240) == 0, resumed.stderr.read().decode()[-3000:]
    finally:
        stop(resumed)
    # a build over the same rows finds them all there; a writer that is not resumed writes every row again, and
    # that changes nothing either: upserts keyed by the row
    settings = {**SETTINGS, "projection_dim": DIM}
    result = IndexBuild(MilvusHome(server), settings).run(LookupModel(vectors), entries, by_row)
    assert result.report.handled == 0 and result.report.rows == len(entries)
    home = MilvusHome(server)
    home.check_settings(settings)
    with home.writer(0, 0, len(entries), resume=False, entries=entries) as again:
        stats = encode_videos(LookupModel(vectors), by_row(entries, range(len(entries))), again, summary=False)
    assert stats.videos == len(entries)
    index = home.finish()
    rows = index.all_rows()
    # the rows equal an in-process build of the same entries, and nothing is duplicated
    in_process = IndexBuild(InMemoryHome(store_tokens=False), settings).run(LookupModel(vectors), entries,
                                                                            by_row).index
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)) == len(entries) == len(index)
    expected = {row_key(*in_process.row_key(i)): in_process.embeddings[i] for i in range(len(in_process))}
    assert set(keys) == set(expected)
    for row in rows:
        torch.testing.assert_close(torch.tensor(row["embedding"]), expected[row["key"]], rtol=0, atol=1e-6)
    # search equals exact search on the same embeddings (top-10; HNSW at this size is exact)
    queries = torch.nn.functional.normalize(torch.randn(12, DIM, generator=torch.Generator().manual_seed(7)), dim=1)
    _, found = index.nearest(queries, 10)
    got = [[index.hits[int(r)]["video"], index.hits[int(r)]["start"]] for r in found.flatten()]
    truth = exact_top(queries, vectors, list(range(len(entries))), 10)
    assert [(name, start) for name, start in got] == [
        (entries[i].name(i), -1.0 if entries[i].start is None else entries[i].start) for row in truth for i in row]
    # a filter returns only (and exactly the best of) the matching videos
    for filters in ({"folder": "/data/cats"}, {"dataset": ["set1", "long"]}):
        allowed = [i for i, e in enumerate(entries) if matches({"video": e.name(i), "dataset": e.dataset}, filters)]
        _, found = index.nearest(queries, 10, filters=filters)
        names = [[index.hits[int(r)]["video"] for r in row] for row in found]
        assert names == [[entries[i].name(i) for i in row] for row in exact_top(queries, vectors, allowed, 10)]


def test_pipeline_search_on_an_embedded_milvus_lite_file_carries_moments(tmp_path):
    entries, vectors = collection(60, DIM)
    home = MilvusHome(str(tmp_path / "videos.db"))
    index = IndexBuild(home, {**SETTINGS, "projection_dim": DIM}).run(LookupModel(vectors), entries, by_row).index
    _, found = index.nearest(vectors[-1:], 3)
    top = index.entry(int(found[0, 0]))
    assert top == {"video": entries[-1].name(len(entries) - 1), "start": 5.0, "end": 10.0, "dataset": "long"}


def test_train_index_into_milvus_then_train_search_equals_the_store_search(tmp_path):
    """`train.index --milvus FILE` upserts every encoded video (keyed by video; a repeated run duplicates nothing),
    and `train.search --milvus FILE` (first stage in Milvus, tokens from the store) ranks as the store does."""
    from helpers.pipelines import build_retrieval, save_folder, tiny_processor
    from helpers.videos import write_noise_video

    from testa_search.cli.index import main as index_main
    from testa_search.cli.search import search

    model = save_folder(build_retrieval(), tiny_processor(), tmp_path / "model")
    for i in range(12):
        write_noise_video(tmp_path / "videos" / ("cats" if i % 2 else "dogs") / f"clip{i:02d}.mp4", seed=40 + i)
    (tmp_path / "videos" / "dogs" / "broken.mp4").write_text("not a video")
    store, milvus = tmp_path / "store", str(tmp_path / "videos.db")
    arguments = ["--model", str(model), "--videos", str(tmp_path / "videos"), "--store", str(store),
                 "--token-dtype", "float32", "--num-workers", "0", "--shard-size", "5", "--milvus", milvus]
    index_main(arguments)
    index_main(arguments)  # again: nothing new is encoded, every row is upserted again
    home = MilvusHome(milvus, dim=16)
    rows = home.open().all_rows()
    videos = sorted(str(p) for p in (tmp_path / "videos").rglob("clip*.mp4"))
    assert sorted(row["video"] for row in rows) == videos  # each once; the broken file is not a row
    queries = ["a red square on a blue screen", "green and yellow blocks"]
    for filters in (None, {"folder": [str(tmp_path / "videos" / "cats")]}):
        from_store = search(str(store), queries, top_k=4, filters=filters)
        from_milvus = search(str(store), queries, top_k=4, filters=filters, milvus=milvus)
        for got, want in zip(from_milvus, from_store, strict=True):
            assert [r["video"] for r in got] == [r["video"] for r in want]
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)
            assert all(r["reranked"] for r in got)
            if filters:
                assert all("/cats/" in r["video"] for r in got)



def test_train_index_of_moments_into_milvus_keeps_start_and_end_and_searches_as_the_store(tmp_path):
    """`train.index --window --milvus FILE`: the builder's moments (planned from the videos' durations) land in
    Milvus with their start/end in the payload, one row per (video, start, end) of the store; `train.search --milvus`
    returns them as moments, ranked as the store ranks them (also grouped by video)."""
    from helpers.pipelines import build_retrieval, save_folder, tiny_processor
    from helpers.videos import write_long_video

    from testa_search.index import VideoIndex
    from testa_search.cli.index import main as index_main
    from testa_search.cli.search import search

    model = save_folder(build_retrieval(), tiny_processor(), tmp_path / "model")
    (tmp_path / "videos").mkdir()
    write_long_video(tmp_path / "videos" / "minute.mp4", 120, fps=2)  # 60 s: (0, 25) (15, 40) (30, 55) (35, 60)
    write_long_video(tmp_path / "videos" / "short.mp4", 20, fps=2)  # 10 s: one row (0, 10)
    (tmp_path / "videos" / "broken.mp4").write_text("not a video")
    store, milvus = tmp_path / "store", str(tmp_path / "videos.db")
    index_main(["--model", str(model), "--videos", str(tmp_path / "videos"), "--store", str(store), "--token-dtype",
                "float32", "--num-workers", "0", "--window", "25", "--stride", "15", "--shard-size", "2", "--milvus",
                milvus])
    stored = VideoIndex.load(store)
    keys = [key for key, ok in zip(stored.row_keys(), stored.valid) if ok]
    names = [Path(name).name for name, _, _ in keys]
    assert [(name, start, end) for name, (_, start, end) in zip(names, keys)] == [
        ("minute.mp4", 0, 25), ("minute.mp4", 15, 40), ("minute.mp4", 30, 55), ("minute.mp4", 35, 60),
        ("short.mp4", 0, 10)]
    assert [Path(f.video).name for f in stored.failures] == ["broken.mp4"]
    rows = MilvusHome(milvus).open().all_rows()
    assert sorted((row["video"], row["start"], row["end"]) for row in rows) == sorted(keys)
    assert sorted(row["key"] for row in rows) == sorted(row_key(*key) for key in keys)
    queries = ["a white block in the corner", "a black frame"]
    for group_by_video in (False, True):
        from_store = search(str(store), queries, top_k=5, group_by_video=group_by_video)
        from_milvus = search(str(store), queries, top_k=5, milvus=milvus, group_by_video=group_by_video)
        for got, want in zip(from_milvus, from_store, strict=True):
            assert [(r["video"], r["start"], r["end"]) for r in got] == [(r["video"], r["start"], r["end"])
                                                                          for r in want]
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)
            assert len(got) == (2 if group_by_video else 5)


def test_writers_starting_together_share_the_collection_one_of_them_created(tmp_path, monkeypatch):
    """Two writers (two builds at once) may both find no collection and both create it: Milvus refuses the second
    creation ("already exists"), which must not stop that writer when the collection holds its settings, and must
    stop it, naming the difference, when it holds others."""
    settings = {**SETTINGS, "projection_dim": 8}
    first = MilvusHome(str(tmp_path / "videos.db"))
    first.check_settings(settings)
    calls = []
    monkeypatch.setattr(first.client, "has_collection", lambda name: bool(calls) or calls.append(1))
    assert first.check_settings(settings)["projection_dim"] == 8  # looked absent, the creation failed: it goes on
    calls.clear()
    with pytest.raises(ValueError, match="num_frames: the index has 1, this build 2"):
        first.check_settings({**settings, "num_frames": 2})