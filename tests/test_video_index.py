"""`VideoIndex`'s first stage (built once, kept, saved and reopened; approximate above a size threshold with exact
re-scoring), growing an in-memory index with `add`, cheap opening of a store, and the checks that refuse to search
an index with another model. References: exact torch top-k (float32 matrix products), an index built at once, the
files on disk."""

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.pipelines import build_retrieval, tiny_processor, write_videos
from helpers.requirements import require

import testa_search.index as video_index_module
import testa_search.store.video_store as video_store_module
from modeling_testa import VideoTextRetrievalPipeline
from testa_search.encoding import Failure
from testa_search.index import FIRST_STAGE_FILE, FIRST_STAGE_INFO_FILE, FirstStage, VideoIndex
from testa_search.store.video_store import VideoStoreWriter, finalize_store


faiss = require("faiss")
QUERIES = ["a red square moves to the right", "a blue bar goes down", "a dark gradient"]


def unit_vectors(count: int, dim: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(count, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


def random_index(count: int, dim: int = 32, seed: int = 0, **kwargs) -> VideoIndex:
    return VideoIndex(videos=[f"v{i}.mp4" for i in range(count)], embeddings=unit_vectors(count, dim, seed), **kwargs)


def exact(queries: torch.Tensor, embeddings: torch.Tensor, k: int, rows: torch.Tensor | None = None):
    """The reference: float64 matrix product over the given rows, top k."""
    database = embeddings.double() if rows is None else embeddings[rows].double()
    scores, indices = (queries.double() @ database.T).topk(k, dim=1)
    return scores.float(), (indices if rows is None else rows[indices])


@pytest.fixture
def builds(monkeypatch):
    """Counts first-stage builds."""
    calls = []
    original = FirstStage.build.__func__

    def counting(cls, *args, **kwargs):
        stage = original(cls, *args, **kwargs)
        calls.append(stage.kind)
        return stage

    monkeypatch.setattr(FirstStage, "build", classmethod(counting))
    return calls


def write_store(directory, embeddings: torch.Tensor, failed: set[int], num_tokens: int = 3, hidden: int = 4):
    """A one-shard store of the given embeddings (random tokens); the rows in `failed` are failures."""
    names = [f"clip{i}.mp4" for i in range(len(embeddings))]
    with VideoStoreWriter(directory, 0, 0, len(embeddings), token_dtype=torch.float32) as writer:
        for i in range(len(embeddings)):
            if i in failed:
                writer.add_failure(i, names[i], "VideoDecodingError: cannot decode", code="unreadable")
            else:
                writer.add_batch([i], torch.randn(1, num_tokens, hidden), None, embeddings[i : i + 1])
    finalize_store(directory, names, 1, {"projection_dim": embeddings.shape[1]})
    return names


# ---------------------------------------------------------------------------------------------- the first stage


@pytest.mark.parametrize("kind", ["pq", "hnsw", "ivf"])
def test_approximate_first_stage_equals_exact_search_on_a_small_collection(kind):
    index = random_index(3000, exact_max_videos=10)
    queries = unit_vectors(20, 32, seed=1)
    index.build_first_stage(kind=kind)
    scores, indices = index.nearest(queries, k=10)
    expected_scores, expected_indices = exact(queries, index.embeddings, 10)
    assert index.first_stage.kind == kind
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=0)  # re-scored: exact cosines


@pytest.mark.parametrize("kind", ["ivf", "pq"])
def test_saving_over_a_mapped_first_stage_leaves_its_reader_working(tmp_path, kind):
    """`save` renames a new file into place: an index that memory-mapped the old one (IVF maps its lists) keeps
    searching instead of crashing on a file truncated under it (a bus error, before)."""
    index = random_index(3000, exact_max_videos=10)
    index.build_first_stage(kind=kind)
    index.save(tmp_path)
    reopened = VideoIndex.load(tmp_path)
    queries = unit_vectors(5, 32, seed=3)
    before = reopened.nearest(queries, k=10)
    reopened.save(tmp_path)  # rewrites first_stage.faiss while `reopened` holds the old one
    random_index(3000, seed=7, exact_max_videos=10).save(tmp_path)  # and again, other vectors
    after = reopened.nearest(queries, k=10)
    assert torch.equal(before[1], after[1]) and torch.equal(before[0], after[0])
    assert not list(tmp_path.glob(".*.partial"))


def test_an_unreadable_first_stage_file_is_rebuilt(tmp_path, builds):
    index = random_index(3000, exact_max_videos=10)
    index.build_first_stage(kind="pq")
    index.save(tmp_path)
    (tmp_path / FIRST_STAGE_FILE).write_bytes(b"torn")
    reopened = VideoIndex.load(tmp_path)
    scores, indices = reopened.nearest(unit_vectors(4, 32, seed=2), k=5)
    assert torch.equal(indices, exact(unit_vectors(4, 32, seed=2), reopened.embeddings, 5)[1])
    assert builds == ["pq", "flat"]  # built; rebuilt after the torn file was ignored (3000 < the default threshold)


def test_the_default_first_stage_is_exact_below_the_threshold_and_approximate_above():
    small, large = random_index(2000), random_index(2000, exact_max_videos=100)
    queries = unit_vectors(5, 32, seed=1)
    for index, kind in ((small, "flat"), (large, "pq")):
        _, indices = index.nearest(queries, k=7)
        assert index.first_stage.kind == kind
        assert torch.equal(indices, exact(queries, index.embeddings, 7)[1])


def test_failed_rows_of_a_store_are_never_returned(tmp_path):
    embeddings = unit_vectors(3000, 16, seed=2)
    failed = set(range(0, 3000, 7))
    write_store(tmp_path / "store", embeddings, failed)
    index = VideoIndex.load(tmp_path / "store")
    assert [f.video for f in index.failures] == [f"clip{i}.mp4" for i in sorted(failed)]
    assert [f.index for f in index.failures] == sorted(failed)
    assert {(f.code, f.reason) for f in index.failures} == {("unreadable", "VideoDecodingError: cannot decode")}
    kept = torch.tensor([i for i in range(3000) if i not in failed])
    queries = embeddings[sorted(failed)[:10]]  # the failed videos' own embeddings: they would come first
    for threshold, kind in ((10_000, "flat"), (10, "pq")):
        index.exact_max_videos = threshold
        index.first_stage = None
        scores, indices = index.nearest(queries, k=10)
        assert index.first_stage.kind == kind
        assert not set(indices.flatten().tolist()) & failed
        expected_scores, expected_indices = exact(queries, index.embeddings, 10, kept)
        assert torch.equal(indices, expected_indices)
        torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=0)


def test_the_first_stage_is_built_once_across_many_searches(builds, monkeypatch):
    index = random_index(2000, exact_max_videos=100)
    queries = unit_vectors(30, 32, seed=3)
    rescored = []
    original = video_index_module.gather_rows
    monkeypatch.setattr(video_index_module, "gather_rows", lambda e, rows: rescored.append(len(rows)) or original(e, rows))
    for q in range(30):
        assert torch.equal(index.nearest(queries[q : q + 1], k=5)[1], exact(queries[q : q + 1], index.embeddings, 5)[1])
    assert builds == ["pq"]
    assert rescored == [video_index_module.MIN_CANDIDATES] * 30  # per query: the candidates, not the collection
    index.nearest(queries, k=5, use_faiss=False)  # torch search: no FAISS stage needed
    assert builds == ["pq"]


@pytest.mark.slow
def test_first_stage_recall_at_200k_meets_the_target():
    """Random unit vectors (the worst case for approximate search), the default stage: recall@10 >= 0.99."""
    index = random_index(200_000, dim=256, seed=4)
    queries = unit_vectors(200, 256, seed=5)
    _, indices = index.nearest(queries, k=10)
    assert index.first_stage.kind == "pq"
    _, expected = exact(queries, index.embeddings, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(indices.tolist(), expected.tolist())])
    assert recall >= 0.99, recall


def test_save_and_load_reopen_the_first_stage_and_rebuild_a_stale_one(tmp_path, builds):
    index = random_index(1200, exact_max_videos=100)
    queries = unit_vectors(8, 32, seed=6)
    before = index.nearest(queries, k=10)
    index.save(tmp_path / "a")
    meta = json.loads((tmp_path / "a" / FIRST_STAGE_INFO_FILE).read_text())
    assert (meta["kind"], meta["count"], meta["dim"]) == ("pq", 1200, 32)
    assert builds == ["pq"]  # saved, not built again
    loaded = VideoIndex.load(tmp_path / "a")
    assert loaded.first_stage is not None and loaded.first_stage.kind == "pq"
    after = loaded.nearest(queries, k=10)
    assert builds == ["pq"]  # reopened, not rebuilt
    assert torch.equal(after[1], before[1]) and torch.allclose(after[0], before[0])
    loaded.add(VideoIndex(videos=[f"w{i}.mp4" for i in range(400)], embeddings=unit_vectors(400, 32, seed=3)))
    assert builds == ["pq"] and loaded.first_stage.count == 1600  # the reopened stage grows
    assert torch.equal(loaded.nearest(queries, k=10)[1], exact(queries, loaded.embeddings, 10)[1])

    # stale: the first stage of other embeddings (another count, another dim, the same shape with other values)
    for name, other in (("count", random_index(1300, exact_max_videos=100)),
                        ("dim", random_index(1200, dim=16, exact_max_videos=100)),
                        ("values", random_index(1200, seed=9, exact_max_videos=100))):
        other.save(tmp_path / name)
        for file in (FIRST_STAGE_FILE, FIRST_STAGE_INFO_FILE):
            shutil.copy(tmp_path / "a" / file, tmp_path / name / file)
        reopened = VideoIndex.load(tmp_path / name)
        assert reopened.first_stage is None, name
        reopened.exact_max_videos = 100
        probe = unit_vectors(3, other.dim, seed=7)
        assert torch.equal(reopened.nearest(probe, k=10)[1], exact(probe, other.embeddings, 10)[1]), name
        assert builds[-1] == "pq" and reopened.first_stage.count == len(other), name


def test_a_flat_first_stage_is_not_saved(tmp_path):
    """An exact stage is a copy of the embeddings: rebuilt in one pass rather than stored twice; a saved approximate
    stage left in the directory is removed."""
    index = random_index(300)
    index.nearest(unit_vectors(1, 32, seed=1), k=3)
    large = random_index(300, exact_max_videos=100)
    large.save(tmp_path / "x")
    assert (tmp_path / "x" / FIRST_STAGE_FILE).is_file()
    index.save(tmp_path / "x")
    assert not (tmp_path / "x" / FIRST_STAGE_FILE).exists()
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["video_index.json", "video_index.safetensors"]


def test_a_store_opens_without_reading_tokens_or_copying_embeddings(tmp_path, monkeypatch):
    embeddings = unit_vectors(400, 16, seed=8)
    write_store(tmp_path / "store", embeddings, failed={3})
    stored = VideoIndex.load(tmp_path / "store")
    stored.exact_max_videos = 100
    stored.save_first_stage()
    assert (tmp_path / "store" / FIRST_STAGE_FILE).is_file()

    reads = []
    monkeypatch.setattr(video_store_module.os, "preadv", lambda *a: reads.append(a) or 0)
    monkeypatch.setattr(video_store_module, "load_file", lambda *a, **k: pytest.fail("embeddings read, not mapped"))
    index = VideoIndex.load(tmp_path / "store")
    assert reads == []  # no token read
    assert index.first_stage is not None and index.first_stage.count == 399
    assert torch.equal(index.embeddings[[0, 399]], embeddings[[0, 399]])
    kept = torch.tensor([i for i in range(400) if i != 3])
    queries = unit_vectors(4, 16, seed=9)
    assert torch.equal(index.nearest(queries, k=6)[1], exact(queries, embeddings, 6, kept)[1])


# ------------------------------------------------------------------------------------------------------ the pipeline


@pytest.fixture(scope="module")
def pipe():
    return VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return write_videos(tmp_path_factory.mktemp("videos"))


def test_add_of_two_halves_equals_one_index_built_at_once(pipe, videos, builds):
    whole = pipe.encode_videos(videos, batch_size=1)
    first = pipe.encode_videos(videos[:3], batch_size=1)
    second = pipe.encode_videos(videos[3:], batch_size=1)
    first.nearest(whole.embeddings[:1], k=2)  # a kept (flat) first stage grows with `add`
    assert builds == ["flat"]
    grown = first.add(second)
    assert grown is first and first.videos == whole.videos and first.skipped == []
    for name in ("embeddings", "tokens", "token_sizes"):
        torch.testing.assert_close(getattr(first, name), getattr(whole, name), atol=1e-6, rtol=0)
    assert first.first_stage.count == len(videos) and builds == ["flat"]
    for top_k in (2, None):
        for got, expected in zip(pipe.search(QUERIES, first, top_k=top_k), pipe.search(QUERIES, whole, top_k=top_k)):
            assert [item["video"] for item in got] == [item["video"] for item in expected]
            assert [item["reranked"] for item in got] == [item["reranked"] for item in expected]
            np.testing.assert_allclose([i["score"] for i in got], [i["score"] for i in expected], atol=1e-5)
    assert builds == ["flat", "flat"]  # one per index (`whole`'s on its first search), searched many times

    # again: the videos are already there, so nothing is added
    first.add(second)
    assert first.videos == whole.videos and first.skipped == videos[3:]


def test_add_merges_failures_and_a_video_encoded_later_leaves_them(pipe, videos):
    good = pipe.encode_videos(videos[:2], batch_size=2)
    good.failures = [Failure("broken.mp4", "no_frames", "E: no frames"), Failure(videos[2], "timeout", "E: slow")]
    later = pipe.encode_videos(videos[2:3])
    later.failures = [Failure("other.mp4", "empty", "E: empty file")]
    good.add(later)
    assert good.failures == [Failure("broken.mp4", "no_frames", "E: no frames"),
                             Failure("other.mp4", "empty", "E: empty file")]
    assert good.videos == videos[:3]


def test_failures_are_saved_by_both_formats(pipe, videos, tmp_path):
    index = pipe.encode_videos(videos[:2], token_dtype=torch.float32)
    index.failures = [Failure("broken.mp4", "no_frames", "E: no frames"), Failure("empty.mp4", "empty", "E: empty")]
    for as_store in (False, True):
        loaded = VideoIndex.load(index.save(tmp_path / str(as_store), as_store=as_store))
        # a store gives each failure its row (after the encoded videos)
        expected = [dataclasses.replace(f, index=2 + i) if as_store else f for i, f in enumerate(index.failures)]
        assert loaded.failures == expected, as_store
        assert [loaded.videos[i] for i in loaded.valid.nonzero().flatten()] == videos[:2]
        queries = index.embeddings[:2]
        assert torch.equal(loaded.nearest(queries, k=5)[1], exact(queries, index.embeddings, 2)[1])


def test_add_refuses_other_settings_and_store_backed_indexes(pipe, videos, tmp_path):
    index = pipe.encode_videos(videos[:2])
    other = pipe.encode_videos(videos[2:3])
    other.info = {**other.info, "num_frames": 99}
    with pytest.raises(ValueError, match="num_frames: the index has 4, this build 99"):
        index.add(other)
    half = pipe.encode_videos(videos[2:3], token_dtype=torch.float16)
    with pytest.raises(ValueError, match="tokens dtype torch.float16 to one with tokens dtype torch.float32"):
        index.add(half)
    light = pipe.encode_videos(videos[2:3], store_tokens=False)
    with pytest.raises(ValueError, match="has tokens False to one with has tokens True"):
        index.add(light)
    narrow = VideoIndex(videos=["x.mp4"], embeddings=unit_vectors(1, 8, seed=0))
    with pytest.raises(ValueError, match="embedding dim 8 to one with embedding dim 16"):
        VideoIndex(videos=["y.mp4"], embeddings=unit_vectors(1, 16, seed=0)).add(narrow)
    stored = pipe.encode_videos(videos[:2], store_dir=tmp_path / "store")
    with pytest.raises(ValueError, match=r"train\.index --store .*store --videos MORE"):
        stored.add(other)
    assert len(index) == 2 and len(stored) == 2  # nothing changed


def test_search_refuses_an_index_of_another_model_and_caps_top_k(pipe, videos):
    index = pipe.encode_videos(videos)
    results = pipe.search(QUERIES[0], index, top_k=100)
    assert len(results) == len(videos)
    scores, indices = index.nearest(index.embeddings[:2], k=100)
    assert indices.shape == (2, len(videos))

    reduction = pipe.model.config.vision_config.temporal_reduction_per_layer
    other = VideoIndex(videos=index.videos, embeddings=index.embeddings, tokens=index.tokens,
                       token_sizes=index.token_sizes, info={**index.info, "temporal_reduction": [0] * len(reduction)})
    with pytest.raises(ValueError, match=rf"temporal_reduction = \[0.*this model has temporal_reduction = "
                                         rf"{re.escape(str(reduction))}"):
        pipe.search(QUERIES[0], other)
    wider = VideoIndex(videos=["a.mp4", "b.mp4"], embeddings=unit_vectors(2, 24, seed=0))
    with pytest.raises(ValueError, match="24-d embeddings.*projection_dim 24, got 16"):
        pipe.search(QUERIES[0], wider)
    recorded = VideoIndex(videos=["a.mp4", "b.mp4"], embeddings=unit_vectors(2, 24, seed=0),
                          info={"projection_dim": 24})
    with pytest.raises(ValueError, match="projection_dim = 24, but this model has projection_dim = 16"):
        pipe.search(QUERIES[0], recorded)


def test_an_index_refuses_a_model_with_another_merge_rule(videos):
    """Issue 45: the index records the rule (`score_grid`) its videos were encoded with; searching it, or growing it,
    with a model under another rule is refused, naming both (the same videos would have merged other tokens)."""
    pipe = VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")
    index = pipe.encode_videos(videos[:2])
    assert index.info["score_grid"] == 2.0**-10
    pipe.model.set_aggregation(score_grid=0.0)
    with pytest.raises(ValueError, match=r"encoded with score_grid = 0.0009765625, but this model has score_grid = 0.0"):
        pipe.search(QUERIES[0], index)
    with pytest.raises(ValueError, match=r"score_grid: the index has 0.0009765625, this build 0.0"):
        pipe.encode_videos(videos[2:3], index=index)
    assert len(index) == 2  # nothing changed
    pipe.model.set_aggregation(score_grid=2.0**-10)  # the rule it was built with: searched and grown again
    assert pipe.search(QUERIES[0], index) and len(pipe.encode_videos(videos[2:3], index=index)) == 3

def mapped_file(address: int) -> str:
    """The file mapped at `address` in this process (Linux's /proc/self/maps), "" when none."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split()
            low, high = (int(part, 16) for part in span.split("-"))
            if low <= address < high:
                return rest[4] if len(rest) > 4 else ""
    return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_sharded_store_opens_mapped_without_joining_its_shards(tmp_path):
    embeddings = unit_vectors(300, 16, seed=5)
    names = [f"clip{i}.mp4" for i in range(300)]
    for shard, (start, stop) in enumerate([(0, 100), (100, 220), (220, 300)]):
        with VideoStoreWriter(tmp_path, shard, start, stop, token_dtype=torch.float32) as writer:
            for i in range(start, stop):
                if i == 150:
                    writer.add_failure(i, names[i], "E: broken", code="unreadable")
                else:
                    writer.add_batch([i], torch.randn(1, 3, 4), None, embeddings[i : i + 1])
    finalize_store(tmp_path, names, 3)
    index = VideoIndex.load(tmp_path)
    assert mapped_file(index.embeddings.data_ptr()).endswith("embeddings.f32")  # the file mapped, not a copy
    valid = index.valid.nonzero().flatten()
    assert valid.numel() == 299 and torch.equal(index.embeddings[valid], embeddings[valid])
    queries = embeddings[:5]
    scores, rows = index.nearest(queries, k=10, use_faiss=False)
    reference = exact(queries, embeddings[valid], 10)
    assert torch.equal(rows, valid[reference[1]])


def test_search_without_faiss_above_the_exact_limit_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(video_index_module, "faiss_module", lambda: None)
    monkeypatch.setattr(video_index_module, "_warned_exact_fallback", False)
    embeddings = unit_vectors(60, 8, seed=3)
    small = VideoIndex(videos=[f"v{i}.mp4" for i in range(60)], embeddings=embeddings)
    large = VideoIndex(videos=[f"v{i}.mp4" for i in range(60)], embeddings=embeddings)
    monkeypatch.setattr(video_index_module, "EXACT_MAX_VIDEOS", 50)
    with caplog.at_level("WARNING", logger=video_index_module.logger.name):
        small.nearest(embeddings[:2], 5, use_faiss=False)  # asked for: no warning
        for _ in range(3):
            scores, rows = large.nearest(embeddings[:2], 5)
    warnings = [r.getMessage() for r in caplog.records if "without faiss" in r.getMessage()]
    assert len(warnings) == 1 and "pip install faiss-cpu" in warnings[0] and "60 videos" in warnings[0]
    assert torch.equal(rows, exact(embeddings[:2], embeddings, 5)[1])


def test_filters_keep_only_matching_rows_and_moments_reach_the_results(pipe, videos):
    from testa_search.homes import IndexEntry

    entries = [IndexEntry(videos[0], dataset="a"), IndexEntry(videos[1], dataset="b"),
               IndexEntry(videos[2], dataset="a")]
    encoded = pipe.encode_videos(entries, batch_size=2)
    assert encoded.row_fields == {"dataset": ["a", "b", "a"]}
    # an index of moments (two windows of videos[1], as a moment decoder would give them)
    index = VideoIndex(videos=[videos[0], videos[1], videos[1], videos[2]], info=encoded.info,
                       embeddings=encoded.embeddings[[0, 1, 1, 2]],
                       tokens=encoded.tokens[[0, 1, 1, 2]], token_sizes=encoded.token_sizes[[0, 1, 1, 2]],
                       segments=[[float("nan")] * 2, [0.0, 1.0], [1.0, 2.0], [float("nan")] * 2],
                       row_fields={"dataset": ["a", "b", "b", "a"]})
    results = pipe.search("a video", index, top_k=None, rerank=False)
    assert sorted((r["video"], r["start"] if r["start"] is not None else -1) for r in results) == sorted(
        [(videos[0], -1), (videos[1], 0.0), (videos[1], 1.0), (videos[2], -1)])
    with pytest.raises(ValueError, match=r"one of \('dataset',\)"):  # a row's start/end live in `segments`
        VideoIndex(videos=videos[:1], embeddings=encoded.embeddings[:1], row_fields={"start": [0.0]})
    only_b = pipe.search("a video", index, top_k=None, rerank=False, filters={"dataset": "b"})
    assert [r["dataset"] for r in only_b] == ["b", "b"] and {(r["start"], r["end"]) for r in only_b} == {
        (0.0, 1.0), (1.0, 2.0)}
    under = pipe.search("a video", index, top_k=2, rerank=False, filters={"folder": str(Path(videos[2]).parent)})
    assert len(under) == 2  # every test video lies in that folder
    # growing with the same rows adds nothing: rows are keyed by (video, start, end)
    assert pipe.encode_videos(entries, index=encoded) is encoded and len(encoded) == 3


def test_a_filter_matching_fewer_rows_than_the_rerank_window_reranks_only_those(pipe, tmp_path):
    from helpers.videos import write_noise_video

    paths = [str(write_noise_video(tmp_path / ("a" if i < 2 else "b") / f"v{i}.mp4", seed=i)) for i in range(6)]
    index = pipe.encode_videos(paths, batch_size=3)
    got = pipe.search("a video", index, top_k=None, rerank_k=5, filters={"folder": str(tmp_path / "a")})
    reference = pipe.search("a video", pipe.encode_videos(paths[:2]), top_k=None, rerank_k=5)
    assert [r["video"] for r in got] == [r["video"] for r in reference] and all(r["reranked"] for r in got)
    assert [r["score"] for r in got] == pytest.approx([r["score"] for r in reference], abs=1e-5)


def test_int8_tokens_round_trip_through_a_store_within_half_a_step_per_token(tmp_path):
    from testa_search.store import int8_tokens
    from testa_search.store.video_store import VideoTokenStore

    generator = torch.Generator().manual_seed(11)
    # tokens of very different norms (one scale per token keeps the small ones), one all-zero token
    tokens = torch.randn(6, 5, 12, generator=generator) * torch.logspace(-3, 2, 5).view(1, 5, 1)
    tokens[2, 3] = 0
    embeddings = F.normalize(torch.randn(6, 8, generator=generator), dim=1)
    with VideoStoreWriter(tmp_path, 0, 0, 6, token_dtype="int8") as writer:
        writer.add_batch(range(6), tokens.half(), torch.ones(6, 5), embeddings)
    finalize_store(tmp_path, [f"v{i}" for i in range(6)], 1)
    store = VideoTokenStore(tmp_path)
    read = store.read_tokens(torch.arange(6))
    reference = tokens.half().double()  # the fp16 tokens given, re-quantized in float64
    scales = reference.abs().amax(dim=-1, keepdim=True) / 127
    expected = torch.where(scales > 0, torch.round(reference / scales.clamp(min=1e-300)) * scales, reference)
    assert read.dtype == torch.float32 and store.tokens.dtype == torch.float32
    # float32 arithmetic may round a value lying on a half step the other way than float64: one step, rarely
    steps = ((read.double() - expected).abs() / scales.clamp(min=1e-300)).round()
    assert int((steps > 0).sum()) <= 2 and float(steps.max()) <= 1
    assert bool(((read.double() - reference).abs() <= scales / 2 * (1 + 1e-4)).all())
    assert torch.equal(read[2, 3], torch.zeros(12))
    assert store.token_bytes == 5 * (12 + int8_tokens.SCALE_BYTES)  # half of fp16's 5 * 12 * 2 plus the scales
