"""Indexing and searching moments: `encode_videos(paths, window=, stride=)` (one row per window, decoded once per
video), `search` returning `{"video", "start", "end", "score"}`, `group_by="video"`, saving, growing and bad input.

References: every window decoded on its own (its frames only) and encoded by the model directly; the two-stage
ranking of `model.rank_videos` over those rows (k = all)."""

import numpy as np
import pytest
import torch
from helpers.pipelines import FRAMES, build_retrieval, tiny_processor
from helpers.requirements import require
from helpers.videos import write_long_video

from modeling_testa import VideoTextRetrievalPipeline
from testa_search.moments import window_frame_indices
from testa_search.index import VideoIndex


require("faiss")
QUERIES = ["a white block in the corner", "a black frame"]


@pytest.fixture(scope="module")
def pipe():
    return VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moments")
    minute = write_long_video(folder / "minute.mp4", 120, fps=2)  # 60 s: windows (0, 25), (15, 40), (30, 55), (35, 60)
    half = write_long_video(folder / "half_minute.mp4", 90, fps=3)  # 30 s: (0, 25), (5, 30)
    short = write_long_video(folder / "short.mp4", 20, fps=2)  # 10 s, shorter than a window: one entry (0, 10)
    return [str(minute), str(half), str(short)]


# windows of 25 s every 15 s; the last one of a video moved back to end at its end
EXPECTED_ROWS = [("minute.mp4", 0, 25), ("minute.mp4", 15, 40), ("minute.mp4", 30, 55), ("minute.mp4", 35, 60),
                 ("half_minute.mp4", 0, 25), ("half_minute.mp4", 5, 30), ("short.mp4", 0, 10)]


@torch.no_grad()
def reference_rows(pipe, videos):
    """Every window decoded alone (its own frames only) and encoded by the model on its own."""
    processor, model = pipe.video_processor, pipe.model
    tokens, sizes, features = [], [], []
    for name, start, end in EXPECTED_ROWS:
        path = next(v for v in videos if v.endswith("/" + name))

        def sample(metadata, s=start, e=end):
            return window_frame_indices(s, e, metadata.fps, metadata.total_num_frames, FRAMES)

        frames, _ = processor.fetch_videos(path, sample_indices_fn=sample)
        pixel_values = processor(videos=[frames], num_frames=FRAMES, return_tensors="pt")["pixel_values"]
        out = model.get_video_tokens(pixel_values)
        tokens.append(out.last_hidden_state)
        sizes.append(out.token_sizes)
        features.append(model.get_video_features(video_tokens=out.last_hidden_state,
                                                 video_token_sizes=out.token_sizes).pooler_output)
    return torch.cat(tokens), torch.cat(sizes), torch.cat(features)


def test_each_window_is_one_row_equal_to_encoding_it_alone(pipe, videos):
    index = pipe.encode_videos(videos, window=25, stride=15, batch_size=4)
    assert [(name.rsplit("/", 1)[1], *index.moment(i)) for i, name in enumerate(index.names)] == EXPECTED_ROWS
    assert index.info["window"] == 25 and index.info["stride"] == 15
    tokens, sizes, features = reference_rows(pipe, videos)
    torch.testing.assert_close(index.embeddings, features.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(index.tokens, tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(index.token_sizes, sizes)


def test_search_returns_moments_ranked_as_the_model_ranks_the_rows(pipe, videos):
    index = pipe.encode_videos(videos, window=25, stride=15)
    tokens, sizes, features = reference_rows(pipe, videos)
    text = pipe.processor(text=QUERIES)
    reference = pipe.model.rank_videos(text["input_ids"], tokens, attention_mask=text["attention_mask"],
                                       video_token_sizes=sizes, k=len(EXPECTED_ROWS)).scores
    results = pipe.search(QUERIES, index, top_k=None, rerank_k=len(EXPECTED_ROWS))
    for ranked, scores in zip(results, reference):
        order = sorted(range(len(EXPECTED_ROWS)), key=lambda i: (-float(scores[i]), i))
        got = [(r["video"].rsplit("/", 1)[1], r["start"], r["end"]) for r in ranked]
        assert got == [EXPECTED_ROWS[i] for i in order]
        np.testing.assert_allclose([r["score"] for r in ranked], [float(scores[i]) for i in order], atol=1e-4)
        assert set(ranked[0]) == {"video", "start", "end", "score", "reranked"}


def test_group_by_video_gives_each_video_once_at_its_best_moment(pipe, videos):
    index = pipe.encode_videos(videos, window=25, stride=15)
    for top_k in (None, 2):
        for rerank_k in (2, 7):
            full = pipe.search(QUERIES, index, top_k=None, rerank_k=rerank_k)
            grouped = pipe.search(QUERIES, index, top_k=top_k, rerank_k=rerank_k, group_by="video")
            for every, best in zip(full, grouped):
                first_of_each = []
                for result in every:
                    if result["video"] not in [r["video"] for r in first_of_each]:
                        first_of_each.append(result)
                assert best == first_of_each[:top_k]
    with pytest.raises(ValueError, match="`group_by` must be None or 'video'"):
        pipe.search(QUERIES, index, group_by="moment")


def test_moments_given_as_entries_are_the_rows_window_plans(pipe, videos):
    """`IndexEntry` moments (with a dataset) go through the same builder and decoder as `window=`: the same rows,
    the same embeddings, and the dataset carried into the results."""
    from testa_search.homes import IndexEntry

    planned = pipe.encode_videos(videos, window=25, stride=15)
    entries = [IndexEntry(name, start, end, dataset="lectures") for name, start, end in planned.row_keys()]
    given = pipe.encode_videos(entries, batch_size=3)
    assert given.row_keys() == planned.row_keys() and given.row_fields == {"dataset": ["lectures"] * len(entries)}
    torch.testing.assert_close(given.embeddings, planned.embeddings)
    results = pipe.search(QUERIES[0], given, top_k=None)
    assert [(r["video"], r["start"], r["end"]) for r in results] == [
        (r["video"], r["start"], r["end"]) for r in pipe.search(QUERIES[0], planned, top_k=None)]
    assert {r["dataset"] for r in results} == {"lectures"}


def test_a_video_given_whole_and_as_a_moment_gets_both_rows(pipe, videos):
    """Entries of one video mixing the whole video and a window: each row gets its own clip, as when each is encoded
    alone (they once shared one decoded clip, and the batch came up one clip short)."""
    from testa_search.homes import IndexEntry

    mixed = pipe.encode_videos([IndexEntry(videos[0]), IndexEntry(videos[0], 0.0, 25.0)], batch_size=2)
    whole = pipe.encode_videos([IndexEntry(videos[0])])
    window = pipe.encode_videos([IndexEntry(videos[0], 0.0, 25.0)])
    assert mixed.row_keys() == [whole.row_keys()[0], window.row_keys()[0]]
    torch.testing.assert_close(mixed.embeddings, torch.cat([whole.embeddings, window.embeddings]))
    grouped = pipe.search(QUERIES[0], mixed, top_k=None, group_by="video")
    assert len(grouped) == 1 and grouped[0]["video"] == videos[0]


def test_whole_video_indexes_are_unchanged(pipe, videos):
    index = pipe.encode_videos(videos)
    assert index.segments is None
    assert set(pipe.search(QUERIES[0], index)[0]) == {"video", "score", "reranked"}


def test_moments_survive_save_load_and_growth(pipe, videos, tmp_path):
    whole = pipe.encode_videos(videos, window=25, stride=15)
    whole.save(tmp_path / "index")
    loaded = VideoIndex.load(tmp_path / "index")
    assert loaded.row_keys() == whole.row_keys() and loaded.info["window"] == 25
    assert pipe.search(QUERIES, loaded) == pipe.search(QUERIES, whole)

    grown = pipe.encode_videos(videos[:1], window=25, stride=15)
    grown = pipe.encode_videos(videos, window=25, stride=15, index=grown)  # the first video is not encoded again
    assert grown.row_keys() == whole.row_keys()
    torch.testing.assert_close(grown.embeddings, whole.embeddings)
    grown.add(pipe.encode_videos(videos[1:2], window=25, stride=15))  # its moments are there already: skipped
    assert len(grown) == len(EXPECTED_ROWS) and grown.skipped == [videos[1]] * 2
    with pytest.raises(ValueError, match="window: the index has 25.0, this build 30.0"):
        pipe.encode_videos(videos[2:], window=30, stride=15, index=grown)
    # the video store format keeps the moments as well
    whole.save(tmp_path / "store", as_store=True)
    stored = VideoIndex.load(tmp_path / "store")
    assert stored.store is not None and stored.row_keys() == whole.row_keys()
    assert pipe.search(QUERIES, stored) == pipe.search(QUERIES, whole)


def test_a_whole_video_index_grows_with_moments_of_other_videos(pipe, videos):
    index = pipe.encode_videos(videos[2:])  # the short video, whole
    moments = pipe.encode_videos(videos[:1], window=25, stride=15)
    moments.info = {k: v for k, v in moments.info.items() if k not in ("window", "stride")}
    index.add(moments)
    assert [(name.rsplit("/", 1)[1], *index.moment(i)) for i, name in enumerate(index.names)] == [
        ("short.mp4", None, None), ("minute.mp4", 0, 25), ("minute.mp4", 15, 40), ("minute.mp4", 30, 55),
        ("minute.mp4", 35, 60)]
    results = pipe.search(QUERIES[0], index, top_k=None)
    assert {(r["start"], r["end"]) for r in results if r["video"] == videos[2]} == {(None, None)}


def test_bad_input_for_windows(pipe, videos, tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 50)
    index = pipe.encode_videos([str(broken)] + videos[2:], window=25)
    assert index.names == [videos[2]] and str(broken) in {f.video for f in index.failures}
    with pytest.raises(ValueError, match="None of the 1 videos could be read"):
        pipe.encode_videos([str(broken)], window=25)
    with pytest.raises(ValueError, match=r"videos\[0\] are in-memory videos"):
        pipe.encode_videos([np.zeros((4, 32, 32, 3), dtype=np.uint8)], window=25)
    with pytest.raises(ValueError, match="`window` must be a positive number of seconds"):
        pipe.encode_videos(videos, window=-1)
    with pytest.raises(ValueError, match="only video argument"):
        pipe.encode_videos(videos, window=25, fps=1)


def test_search_command_prints_moments_as_h_mm_ss(pipe, videos, tmp_path, capsys):
    from helpers.pipelines import save_folder

    from testa_search.cli.search import main

    model = save_folder(pipe.model, pipe.processor, tmp_path / "model")
    index = pipe.encode_videos(videos, window=25, stride=15)
    index.save(tmp_path / "index")
    results = main(["--store", str(tmp_path / "index"), "--model", str(model), "--top-k", "3", QUERIES[0]])
    expected = pipe.search(QUERIES[0], index, top_k=3)  # another copy of the model: scores agree to rounding
    assert [{k: v for k, v in r.items() if k != "score"} for r in results[0]] == [
        {k: v for k, v in r.items() if k != "score"} for r in expected]
    np.testing.assert_allclose([r["score"] for r in results[0]], [r["score"] for r in expected], rtol=0, atol=1e-5)
    lines = capsys.readouterr().out.splitlines()
    for line, result in zip(lines[1:4], results[0]):
        start, end = int(result["start"]), int(result["end"])
        assert line.endswith(f"{result['video']}  0:00:{start:02d}-0:00:{end:02d}")
    grouped = main(["--store", str(tmp_path / "index"), "--model", str(model), "--group-by-video", "--json",
                    QUERIES[0]])
    assert [r["video"] for r in grouped[0]] == list(dict.fromkeys(r["video"] for r in pipe.search(
        QUERIES[0], index, top_k=None)))


def test_decoding_threads_give_the_same_moments(pipe, videos, tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 50)
    paths = [videos[0], str(broken), *videos[1:]]
    alone = pipe.encode_videos(paths, window=25, stride=15, batch_size=3)
    threads = pipe.encode_videos(paths, window=25, stride=15, batch_size=3, num_workers=2)
    assert threads.row_keys() == alone.row_keys() and {f.video for f in threads.failures} == {str(broken)}
    torch.testing.assert_close(threads.embeddings, alone.embeddings)
    assert threads.stats["num_workers"] == 2


def test_train_index_writes_a_store_of_moments_and_grows_it(pipe, videos, tmp_path, capsys):
    from helpers.pipelines import save_folder

    from testa_search.cli.index import main as index_main

    model = save_folder(pipe.model, pipe.processor, tmp_path / "model")
    store = tmp_path / "store"
    common = ["--model", str(model), "--store", str(store), "--token-dtype", "float32", "--num-workers", "0",
              "--window", "25", "--stride", "15", "--shard-size", "2", "--batch-size", "3"]
    first = tmp_path / "first.txt"
    first.write_text("\n".join(videos[:2]))
    index_main(common + ["--videos", str(first)])
    ordered = sorted(videos[:2])  # train.index sorts the collection: half_minute.mp4, minute.mp4
    index = VideoIndex.load(store)
    reference = pipe.encode_videos(ordered, window=25, stride=15)
    assert index.store is not None and index.row_keys() == reference.row_keys()
    torch.testing.assert_close(index.embeddings, reference.embeddings, atol=1e-5, rtol=1e-5)
    # shards hold whole videos: half_minute's 2 rows, then minute's 4
    from testa_search.store.video_store import store_metadata

    assert [[s["start"], s["stop"]] for s in store_metadata(store)["shards"]] == [[0, 2], [2, 6]]
    assert "Indexing 6 moments of 2 videos into 2 shards" in capsys.readouterr().out

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 50)
    everything = tmp_path / "all.txt"
    everything.write_text("\n".join([*videos, str(broken)]))
    index_main(common + ["--videos", str(everything)])
    grown = VideoIndex.load(store)
    reference = pipe.encode_videos(ordered + sorted([videos[2], str(broken)]), window=25, stride=15)
    valid = grown.valid
    assert [key for key, ok in zip(grown.row_keys(), valid) if ok] == reference.row_keys()
    assert {f.video for f in grown.failures} == {str(broken)}
    for got, want in zip(pipe.search(QUERIES, grown, top_k=None), pipe.search(QUERIES, reference, top_k=None)):
        assert [(r["video"], r["start"], r["end"]) for r in got] == [(r["video"], r["start"], r["end"]) for r in want]
        np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], atol=1e-4)
    with pytest.raises(SystemExit, match="window: the index has 25.0, this build 30.0"):
        index_main([*common[:-8], "--window", "30", "--stride", "15", "--shard-size", "2", "--videos", str(first)])


def test_a_resumed_shard_decodes_only_the_rows_it_lacks(pipe, videos):
    """`WindowRowDecoder` on the rows a shard still lacks (here rows 2, 3 and 5 of a plan over two videos) streams
    each video once and gives exactly those windows' pixel values and rows, batched."""
    from testa_search.build import window_entries
    from testa_search.homes import IndexEntry
    from testa_search.moments import WindowRowDecoder, video_groups

    entries = window_entries([IndexEntry(video) for video in videos[:2]], 25, 15)
    names = [str(entry.video) for entry in entries]
    assert names == [videos[0]] * 4 + [videos[1]] * 2
    assert [[entry.start, entry.end] for entry in entries] == [[0, 25], [15, 40], [30, 55], [35, 60], [0, 25], [5, 30]]
    assert video_groups([2, 3, 5], names) == [(videos[0], [2, 3]), (videos[1], [5])]
    for num_workers in (0, 2):
        batches = list(WindowRowDecoder(pipe.video_processor, FRAMES, batch_size=2, num_workers=num_workers)(
            entries, [2, 3, 5]))
        assert [(indices, failures) for indices, _, failures in batches] == [([2, 3], []), ([5], [])]
        whole = [window_pixel_values_of(pipe, video, 25, 15) for video in videos[:2]]
        expected = torch.stack([whole[0][2], whole[0][3], whole[1][1]])
        torch.testing.assert_close(torch.cat([pixels for _, pixels, _ in batches]), expected, rtol=0, atol=0)


def window_pixel_values_of(pipe, video, window, stride):
    from testa_search.moments import window_pixel_values

    return window_pixel_values(pipe.video_processor, video, window, stride)[1]


def test_a_killed_store_of_moments_resumes_and_decodes_only_what_it_lacks(pipe, videos, tmp_path, monkeypatch):
    import json

    import testa_search.moments as moments_module
    from helpers.pipelines import save_folder

    from testa_search.store.video_store import VideoStoreWriter
    from testa_search.cli.index import main as index_main

    model = save_folder(pipe.model, pipe.processor, tmp_path / "model")
    store = tmp_path / "store"
    listing = tmp_path / "videos.txt"
    listing.write_text("\n".join(videos[:2]))
    args = ["--model", str(model), "--store", str(store), "--token-dtype", "float32", "--num-workers", "0",
            "--window", "25", "--stride", "15", "--shard-size", "2", "--batch-size", "3", "--videos", str(listing)]
    decoded = []

    class CountingStream(moments_module.WindowStream):
        def __init__(self, source, windows, *args, **kwargs):
            decoded.append((str(source).rsplit("/", 1)[1], windows))
            super().__init__(source, windows, *args, **kwargs)

    monkeypatch.setattr(moments_module, "WindowStream", CountingStream)
    original_add = VideoStoreWriter.add_batch
    calls = []

    def killed_after_two_batches(self, *args, **kwargs):
        original_add(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")

    monkeypatch.setattr(VideoStoreWriter, "add_batch", killed_after_two_batches)
    with pytest.raises(RuntimeError, match="killed"):
        index_main(args)
    # half_minute (rows 0-1, shard 0) and 3 of minute's 4 windows (rows 2-4 of shard 1) were journaled
    assert decoded == [("half_minute.mp4", [(0.0, 25.0), (5.0, 30.0)]),
                       ("minute.mp4", [(0.0, 25.0), (15.0, 40.0), (30.0, 55.0), (35.0, 60.0)])]
    monkeypatch.setattr(VideoStoreWriter, "add_batch", original_add)
    decoded.clear()
    index_main(args)
    assert decoded == [("minute.mp4", [(35.0, 60.0)])]  # the resume decodes minute once, for its last window only
    journaled = [row for journal in sorted(store.glob("journal-*.jsonl"))
                 for line in journal.read_text().splitlines()[1:] for row in json.loads(line).get("encoded", [])]
    assert sorted(journaled) == list(range(6))  # every row encoded exactly once over both runs
    reference = pipe.encode_videos(sorted(videos[:2]), window=25, stride=15)
    index = VideoIndex.load(store)
    assert index.row_keys() == reference.row_keys()
    torch.testing.assert_close(index.embeddings, reference.embeddings, atol=1e-5, rtol=1e-5)


def test_each_process_of_an_index_launch_probes_only_its_share_of_the_durations(videos, tmp_path, monkeypatch):
    """`build.window_entries` (`train.index --window`, the pipeline's `window=`) on the second of two
    processes: it probes the second half of the videos (those the store lacks), the first half's windows come from
    the other process (through the gather), and the rows are every video's windows in order, an unreadable file one
    whole-video row (its decoding then says why)."""
    import testa_search.build as build_module
    from testa_search.homes import IndexEntry
    from testa_search.moments import plan_windows, probe_duration

    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 50)
    given = [*videos, str(broken)]
    probed = []

    def counting(video):
        probed.append(video)
        return probe_duration(video)

    other_half = {video: plan_windows(probe_duration(video), 25, 15) for video in given[1:2]}  # what process 0 sends
    monkeypatch.setattr(build_module, "rank", lambda: 1)
    monkeypatch.setattr(build_module, "world_size", lambda: 2)
    monkeypatch.setattr(build_module, "gather_objects", lambda mine: [other_half, mine])
    rows = build_module.window_entries([IndexEntry(video, dataset="d") for video in given], 25, 15,
                                       skip=[videos[0]], duration=counting)
    assert probed == given[2:]  # its contiguous share of the 3 videos not skipped
    expected = [IndexEntry(video, start, end, "d") for video in given[1:3]
                for start, end in plan_windows(probe_duration(video), 25, 15)] + [IndexEntry(str(broken), dataset="d")]
    assert rows == expected