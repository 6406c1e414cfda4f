"""Bad files are data: the one encode loop (`testa_search.encoding`) records a video it cannot read with a reason
code and goes on, for `DecodeVideos` (train.index, the evaluation), `DecodeAhead` (the pipeline) and the pipeline's
`encode_videos`; and an in-memory index grows (`encode_videos(..., index=existing)`).

References: real mp4s (tests/helpers/videos.py) and one broken file of each kind, whose expected code is known by
construction; an index built from the good videos only (search results and tensors compared exactly); the encoder's
own call count."""

import pickle
from pathlib import Path

import pytest
import torch
from helpers.pipelines import build_retrieval, tiny_processor
from helpers.videos import write_bad_videos, write_noise_video, write_video

import testa_search.encoding as indexing
import modeling_testa.video_processing_testa as video_processing
from modeling_testa import VideoTextRetrievalPipeline
from testa_search import Failure, NoReadableVideoError, VideoIndex
from testa_search.encoding import (
    FAILURE_CODES,
    DecodeAhead,
    DecodeEach,
    DecodeVideos,
    check_on_error,
    failure_code,
    failure_summary,
    looks_like_video,
)
from modeling_testa.video_decoding import VideoDecodingError, VideoDecodingTimeoutError
from testa_search.build import FileDecoder, IndexBuild
from testa_search.homes import IndexEntry

QUERIES = ["a red square on a blue screen", "green and yellow blocks", "first dark then bright"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """8 good noise videos and one broken file of each kind plus a missing path, interleaved."""
    root = tmp_path_factory.mktemp("bad_files")
    good = [str(write_noise_video(root / f"good{i}.mp4", seed=i)) for i in range(8)]
    source = write_video(root / "source.mp4", 30, fps=25, width=176, height=144)
    bad = {code: str(path) for code, path in write_bad_videos(root / "bad", source).items()}
    bad["missing"] = str(root / "gone.mp4")
    mixed = [good[0], bad["not_a_video"], good[1], good[2], bad["truncated"], bad["empty"], good[3], good[4],
             bad["no_frames"], good[5], bad["missing"], good[6], good[7]]
    return good, bad, mixed


@pytest.fixture(scope="module")
def pipe():
    return VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")


def count_encoded(model, monkeypatch) -> list[int]:
    """Records the batch size of every call of the model's video encoder."""
    calls: list[int] = []
    encode = model.get_video_tokens

    def counting(pixel_values, *args, **kwargs):
        calls.append(int(pixel_values.shape[0]))
        return encode(pixel_values, *args, **kwargs)

    monkeypatch.setattr(model, "get_video_tokens", counting)
    return calls


# ------------------------------------------------------------------------------------------------ reasons


def test_each_kind_of_bad_file_gets_its_code(files):
    _, bad, _ = files
    processor = tiny_processor().video_processor
    for code, path in bad.items():
        with pytest.raises((OSError, ValueError)) as error:
            processor(videos=[path])
        assert indexing.is_media_error(error.value), code
        assert failure_code(error.value, path) == code, (code, str(error.value)[:300])
        reason = str(Failure.from_error(error.value, path))
        assert reason.startswith(f"{code}: {type(error.value).__name__}: ") and path in reason
    assert set(bad) <= set(FAILURE_CODES)


def test_decoder_crash_and_timeout_codes_come_from_the_decoder_client_errors(files):
    good, _, _ = files
    # the codes `video_decoding.DecoderProcess` sets when its helper dies or exceeds decode_timeout
    crashed = VideoDecodingError(good[0], "the pyav decoder crashed (SIGSEGV)", "pyav", code="decoder_crash")
    slow = VideoDecodingTimeoutError(good[0], "the decoder made no progress for decode_timeout=1 s", "pyav")
    assert [failure_code(e, good[0]) for e in (crashed, slow)] == ["decoder_crash", "timeout"]
    # the code is never read from the message: the same words without a code are "unreadable"
    worded = VideoDecodingError(good[0], "the pyav decoder crashed (SIGSEGV); no decodable frames", "pyav")
    assert failure_code(worded, good[0]) == "unreadable"
    assert failure_code(VideoDecodingError(good[0], "no video stream"), good[0]) == "unreadable"
    assert failure_code(PermissionError(13, "Permission denied", good[0]), good[0]) == "unreadable"


def test_a_real_decoder_crash_sets_its_code_where_it_is_raised(files, monkeypatch):
    """The helper process really dies (SIGKILL from inside) and the client's error carries the code."""
    import os
    import signal

    from modeling_testa import video_decoding

    good, _, _ = files
    worker = video_decoding.DecoderProcess()
    try:
        def die(metadata):
            os.kill(worker.process.pid, signal.SIGKILL)
            return [0]

        with pytest.raises(VideoDecodingError) as error:
            worker.decode("pyav", good[0], die, None, 30)
        assert error.value.code == "decoder_crash" and failure_code(error.value, good[0]) == "decoder_crash"
    finally:
        worker.stop()


def test_container_signatures():
    assert looks_like_video(b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00")
    assert looks_like_video(b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01\x42\xf7\x81")  # WebM
    assert looks_like_video(b"RIFF\x24\x00\x00\x00AVI LIST")
    assert not looks_like_video(b"these are meeting notes")
    assert not looks_like_video(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0d")


def test_on_error_is_checked_and_names_the_allowed_values(pipe, files):
    assert check_on_error("skip") == "skip"
    with pytest.raises(ValueError, match=r"`on_error` must be one of 'skip', 'raise', got 'ignore'"):
        check_on_error("ignore")
    with pytest.raises(ValueError, match="'skip', 'raise'"):
        pipe.encode_videos(files[0][:2], on_error="ignore")
    with pytest.raises(ValueError, match="'skip', 'raise'"):
        DecodeVideos(tiny_processor().video_processor, 4, on_error=None)


def test_summary_counts_and_lists_up_to_the_limit():
    failures = [indexing.Failure(f"v{i}.mp4", "truncated", f"VideoDecodingError: cut {i}") for i in range(13)]
    text = failure_summary(failures, 40, limit=10)
    lines = text.splitlines()
    assert lines[0] == "13 of 40 videos could not be read and were skipped:"
    assert lines[1:11] == [f"  v{i}.mp4: truncated: VideoDecodingError: cut {i}" for i in range(10)]
    assert lines[11] == "  ... and 3 more" and len(lines) == 12


# ------------------------------------------------------------------------------------------------ decoders


def test_decode_videos_skips_each_bad_file_alone(files):
    good, bad, mixed = files
    collate = DecodeVideos(tiny_processor().video_processor, 4)
    indices, pixels, failures = collate(list(enumerate(mixed)))
    assert indices == [i for i, path in enumerate(mixed) if path in good]
    reference = torch.cat([collate.decode(path) for path in good])
    assert torch.equal(pixels, reference)
    codes = {path: code for code, path in bad.items()}
    assert [(f.index, f.video) for f in failures] == [(i, p) for i, p in enumerate(mixed) if p in codes]
    assert all(f.code == codes[f.video] and str(f).startswith(codes[f.video] + ": ") for f in failures)
    raising = DecodeVideos(tiny_processor().video_processor, 4, on_error="raise")
    with pytest.raises(ValueError, match="notes.mp4"):
        raising(list(enumerate(mixed)))


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_ahead_skips_in_order_with_and_without_threads(files, workers):
    """The pipeline's decoder (`FileDecoder`: `DecodeEach` run ahead in `DecodeAhead` threads): the readable videos
    in order, each unreadable one a failure named by its path; with ``on_error="raise"`` the decoder's error."""
    good, bad, mixed = files
    processor = tiny_processor().video_processor
    entries = [IndexEntry(path) for path in mixed]

    def decoder(on_error):
        decode = DecodeEach(lambda video, i: processor(videos=[video])["pixel_values"], on_error)
        return FileDecoder(decode, processor, 4, batch_size=3, num_workers=workers)

    batches = list(decoder("skip")(entries, list(range(len(mixed)))))
    assert [i for b in batches for i in b[0]] == [i for i, p in enumerate(mixed) if p in good]
    assert [f.video for b in batches for f in b[2]] == [p for p in mixed if p not in good]
    assert all(len(b[0]) <= 3 and (b[1] is None or b[1].shape[0] == len(b[0])) for b in batches)
    with pytest.raises(ValueError, match="notes.mp4"):
        list(decoder("raise")(entries, list(range(len(mixed)))))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_decode_ahead_streams_in_order_raise_in_place_and_close_on_exit(workers):
    """Streams (`max_items`: what `WindowRowDecoder` runs, one video's windows each): every item of stream 0, then
    of stream 1, ...; a stream's error is raised after its items; leaving early closes the started generators."""
    def stream(i):
        yield from ((i, j) for j in range(5))
        if i == 2:
            raise ValueError("stream 2 broke")

    got = []
    with pytest.raises(ValueError, match="stream 2 broke"), DecodeAhead(stream, 4, workers, max_items=2) as ahead:
        got.extend(ahead)
    assert got == [(i, j) for i in range(3) for j in range(5)]
    started, closed = [], []

    def endless(i):
        started.append(i)
        try:
            yield from range(10**6)
        finally:
            closed.append(i)

    with DecodeAhead(endless, 5, workers, max_items=2) as ahead:
        items = iter(ahead)
        assert [next(items) for _ in range(3)] == [0, 1, 2]
        items.close()
    # stream 0 and those the threads had begun (at most one a thread): each closed, none left running
    assert 0 in started and sorted(closed) == sorted(started) and len(started) <= max(workers, 1)


# ------------------------------------------------------------------------------------------------ the pipeline


def same_results(got: list, expected: list) -> None:
    for row, reference in zip(got, expected, strict=True):
        assert [item["video"] for item in row] == [item["video"] for item in reference]
        assert [item["reranked"] for item in row] == [item["reranked"] for item in reference]
        assert [item["score"] for item in row] == pytest.approx([item["score"] for item in reference], abs=1e-5)


@pytest.mark.parametrize("workers", [0, 2])
def test_encode_videos_indexes_the_good_videos_and_records_the_bad_ones(pipe, files, workers, monkeypatch, capsys):
    good, bad, mixed = files
    reference = pipe.encode_videos(good, batch_size=3)
    warnings = []
    monkeypatch.setattr(indexing.logger, "warning", lambda message, *args: warnings.append(message % args))
    calls = count_encoded(pipe.model, monkeypatch)
    index = pipe.encode_videos(mixed, batch_size=3, num_workers=workers, progress_bar=True)
    assert sum(calls) == len(good)  # every good video encoded once, no bad one
    assert index.videos == good
    for name in ("embeddings", "tokens", "token_sizes"):  # other batches: equal to float rounding
        torch.testing.assert_close(getattr(index, name), getattr(reference, name), rtol=0, atol=1e-5)
    assert {f.video: f.code for f in index.failures} == {path: code for code, path in bad.items()}
    assert all(str(f).startswith(f"{f.code}: ") and f.reason.split(":")[0] in ("VideoDecodingError",
                                                                               "FileNotFoundError")
               for f in index.failures)
    assert index.stats["failed"] == len(bad) and index.stats["videos"] == len(mixed)
    assert "failed 5" in capsys.readouterr().err  # the progress bar's postfix
    assert len(warnings) == 1 and warnings[0].startswith(f"{len(bad)} of {len(mixed)} videos could not be read")
    assert all(path in warnings[0] for path in bad.values())

    for top_k in (None, 3):  # search returns no failed video, and what the good-only index returns
        got = pipe.search(QUERIES, index, top_k=top_k, use_faiss=False)
        same_results(got, pipe.search(QUERIES, reference, top_k=top_k, use_faiss=False))
        assert not {item["video"] for row in got for item in row} & set(bad.values())


def test_a_store_records_the_bad_videos_and_search_skips_them(pipe, files, tmp_path):
    from testa_search import VideoIndex

    good, bad, mixed = files
    reference = pipe.encode_videos(good, batch_size=3)
    stored = pipe.encode_videos(mixed, batch_size=3, store_dir=tmp_path / "store", token_dtype=torch.float32)
    reopened = VideoIndex.load(tmp_path / "store")
    for index in (stored, reopened):
        assert {f.video: f.code for f in index.failures} == {path: code for code, path in bad.items()}
        for top_k in (None, 3):
            got = pipe.search(QUERIES, index, top_k=top_k, use_faiss=False)
            same_results(got, pipe.search(QUERIES, reference, top_k=top_k, use_faiss=False))


def test_on_error_raise_raises_the_decoders_error_naming_the_file(pipe, files):
    good, bad, mixed = files
    for workers in (0, 2):
        with pytest.raises(VideoDecodingError, match="notes.mp4"):
            pipe.encode_videos(mixed, batch_size=3, num_workers=workers, on_error="raise")
    with pytest.raises(FileNotFoundError, match="gone.mp4"):
        pipe.encode_videos([good[0], bad["missing"]], on_error="raise")


def test_no_readable_video_is_one_clear_error_and_writes_no_store(pipe, files, tmp_path):
    _, bad, _ = files
    with pytest.raises(ValueError, match=r"None of the 5 videos could be read:\n  .*notes.mp4: not_a_video"):
        pipe.encode_videos(list(bad.values()))
    with pytest.raises(ValueError, match=r"None of the 5 videos could be read; nothing was written:\n  .*notes.mp4"):
        pipe.encode_videos(list(bad.values()), store_dir=tmp_path / "store")
    assert not (tmp_path / "store").exists()  # no half-written store folder (issue 52)


@pytest.mark.parametrize("stored", [False, True])
def test_no_readable_video_error_carries_every_failure(pipe, files, tmp_path, stored):
    """The error says why each video failed (`failures`, one `Failure` a video, its code told by the file), so a
    caller (the app) need not decode them again to say it."""
    _, bad, _ = files
    with pytest.raises(NoReadableVideoError) as raised:
        pipe.encode_videos(list(bad.values()), store_dir=tmp_path / "store" if stored else None)
    assert isinstance(raised.value, ValueError)
    assert all(isinstance(failure, Failure) for failure in raised.value.failures)
    assert {failure.video: failure.code for failure in raised.value.failures} == \
        {path: code for code, path in bad.items()}
    copied = pickle.loads(pickle.dumps(raised.value))  # e.g. raised in a worker process: the same error arrives
    assert type(copied) is NoReadableVideoError and str(copied) == str(raised.value)
    assert [f.as_dict() for f in copied.failures] == [f.as_dict() for f in raised.value.failures]


@pytest.mark.parametrize("home", ["memory", "store", "store, moments"])
def test_a_video_that_failed_is_indexed_by_the_next_build_once_repaired(pipe, files, tmp_path, home):
    """A failure is not a permanent verdict (issue 52): every build given a video that failed tries it again, the
    pipeline's `encode_videos` (a store, or an index grown in memory) as `train.index` does."""
    good, _, _ = files
    video = tmp_path / "later.mp4"
    video.write_bytes(b"half a copy")  # run 1: not a video yet
    options = {"window": 10.0} if "moments" in home else {}
    store = tmp_path / "store" if "store" in home else None
    first = pipe.encode_videos([good[0], str(video)], store_dir=store, **options)
    assert [(f.video, f.code) for f in first.failures] == [(str(video), "not_a_video")]
    video.write_bytes(Path(good[1]).read_bytes())  # repaired: a copy of a good video
    second = pipe.encode_videos([good[0], str(video)], **({"store_dir": store} if store else {"index": first}),
                                **options)
    assert second.failures == [] and second.stats["videos"] == 1  # the repaired video alone was encoded
    rows = [i for i in range(len(second)) if second.entry(i)["video"] == str(video) and bool(second.valid[i])]
    assert len(rows) == 1 and (second.entry(rows[0]).get("start") is not None) == ("moments" in home)
    reference = pipe.encode_videos([good[1]], **options)  # the same file, encoded on its own
    torch.testing.assert_close(second.embeddings[rows[0]].float(), reference.embeddings[0].float())
    if store is not None:
        assert [VideoIndex.load(store).entry(i)["video"] for i in range(len(second))].count(str(video)) == 1


def test_an_index_grown_in_two_calls_equals_one_built_at_once(pipe, files, monkeypatch):
    good, bad, mixed = files
    at_once = pipe.encode_videos(mixed, batch_size=3)
    first = pipe.encode_videos(mixed[:6], batch_size=3)  # 3 good, 3 bad
    decoded = []
    decode = video_processing.decode_video
    monkeypatch.setattr(video_processing, "decode_video", lambda source, *a, **k: decoded.append(source) or decode(
        source, *a, **k))
    calls = count_encoded(pipe.model, monkeypatch)
    grown = pipe.encode_videos(mixed, batch_size=3, index=first)
    assert grown is first
    # the new videos and the ones that failed, tried again (in the order given); only the readable ones encoded
    assert decoded == [v for v in mixed if v not in good[:3]] and sum(calls) == len([v for v in mixed[6:] if v in good])
    assert grown.videos == at_once.videos == good
    assert grown.failures == at_once.failures
    for name in ("embeddings", "tokens", "token_sizes"):  # other batches: equal to float rounding
        torch.testing.assert_close(getattr(grown, name), getattr(at_once, name), rtol=0, atol=1e-5)
    same_results(pipe.search(QUERIES, grown, top_k=None, use_faiss=False),
                 pipe.search(QUERIES, at_once, top_k=None, use_faiss=False))
    calls.clear()
    assert pipe.encode_videos(mixed, index=grown) is grown and calls == []  # nothing new: nothing encoded


def test_growing_with_other_settings_or_in_memory_videos_is_refused_before_encoding(pipe, files, monkeypatch):
    good, _, _ = files
    index = pipe.encode_videos(good[:2])
    calls = count_encoded(pipe.model, monkeypatch)
    with pytest.raises(ValueError, match=r"other settings.*\n  num_frames: the index has 4, this build 3"):
        pipe.encode_videos(good[2:4], index=index, num_frames=3)
    with pytest.raises(ValueError, match="store_tokens=True"):
        pipe.encode_videos(good[2:4], index=index, store_tokens=False)
    with pytest.raises(ValueError, match=r"videos\[1\] are in-memory videos"):
        pipe.encode_videos([good[2], torch.zeros(4, 32, 32, 3, dtype=torch.uint8).numpy()], index=index)
    with pytest.raises(TypeError, match="must be a VideoIndex"):
        pipe.encode_videos(good[2:4], index={"videos": []})
    assert calls == [] and index.videos == good[:2]


def test_the_pipeline_grows_a_store_backed_index_like_one_built_at_once(pipe, files, monkeypatch, tmp_path):
    good, bad, mixed = files
    at_once = pipe.encode_videos(mixed, store_dir=tmp_path / "once", token_dtype=torch.float32)
    pipe.encode_videos(mixed[:6], store_dir=tmp_path / "grown", token_dtype=torch.float32)
    stored = VideoIndex.load(tmp_path / "grown")
    calls = count_encoded(pipe.model, monkeypatch)
    grown = pipe.encode_videos(mixed, index=stored)
    assert grown is stored and sum(calls) == len([v for v in mixed[6:] if v in good])  # only the new ones
    reopened = VideoIndex.load(tmp_path / "grown")  # the store on disk holds the grown index
    position = {name: i for i, name in enumerate(at_once.names)}
    for index in (grown, reopened):
        # the failed rows were tried again: they left the store and were planned anew, after its encoded rows
        assert sorted(index.names) == sorted(at_once.names)
        assert {(f.video, f.code) for f in index.failures} == {(f.video, f.code) for f in at_once.failures}
        rows = index.valid.nonzero().flatten().tolist()
        same = [position[index.names[row]] for row in rows]
        assert [at_once.names[i] for i in same] == [index.names[row] for row in rows] and all(at_once.valid[same])
        assert len(rows) == int(at_once.valid.sum())
        torch.testing.assert_close(index.embeddings[rows], at_once.embeddings[same], rtol=0, atol=1e-5)
        torch.testing.assert_close(index.tokens[rows], at_once.tokens[same], rtol=0, atol=1e-5)
        same_results(pipe.search(QUERIES, index, top_k=None, use_faiss=False),
                     pipe.search(QUERIES, at_once, top_k=None, use_faiss=False))
    calls.clear()
    assert pipe.encode_videos(mixed, index=reopened) is reopened and calls == []  # nothing new: nothing encoded
    with pytest.raises(ValueError, match="do not pass `store_dir`"):
        pipe.encode_videos(good[:1], index=reopened, store_dir=tmp_path / "other")


def test_a_store_names_each_row_by_its_own_video_when_a_video_is_given_twice(pipe, files, tmp_path):
    """A video listed twice (several captions of one video) is one row of a store: every row keeps its own name and
    embedding (the names once came from the inputs, shifted by the repeat)."""
    good, _, _ = files
    stored = pipe.encode_videos([good[0], good[0], good[1]], store_dir=tmp_path / "store", token_dtype=torch.float32)
    alone = pipe.encode_videos([good[0], good[1]], token_dtype=torch.float32)
    for index in (stored, VideoIndex.load(tmp_path / "store")):
        assert index.names == [good[0], good[1]] and len(index) == 2
        torch.testing.assert_close(index.embeddings[:], alone.embeddings, rtol=0, atol=1e-5)


def test_an_interrupted_growth_of_a_store_is_completed_by_the_next_one(pipe, files, monkeypatch, tmp_path):
    """A growth that fails after planning its rows leaves them planned and unwritten; growing again with the same
    videos encodes them (rather than saying they are already there) and gives the store built at once."""
    good, _, _ = files
    at_once = pipe.encode_videos(good[:4], store_dir=tmp_path / "once", token_dtype=torch.float32)
    pipe.encode_videos(good[:2], store_dir=tmp_path / "grown", token_dtype=torch.float32)
    encode = IndexBuild.encode

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexBuild, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe.encode_videos(good[:4], index=VideoIndex.load(tmp_path / "grown"))
    monkeypatch.setattr(IndexBuild, "encode", encode)
    calls = count_encoded(pipe.model, monkeypatch)
    grown = pipe.encode_videos(good[:4], index=VideoIndex.load(tmp_path / "grown"))
    assert sum(calls) == 2  # the two planned by the interrupted run, once
    for index in (grown, VideoIndex.load(tmp_path / "grown")):
        assert index.names == at_once.names
        torch.testing.assert_close(index.embeddings[:], at_once.embeddings[:], rtol=0, atol=1e-5)


def test_search_with_top_k_none_returns_every_row_of_a_large_index(pipe):
    """`top_k=None` is every video, however many (only a Milvus collection bounds one search's results)."""
    count = 20_000
    embeddings = torch.nn.functional.normalize(torch.randn(count, pipe.model.config.projection_dim), dim=-1)
    index = VideoIndex(videos=[f"v{i}.mp4" for i in range(count)], embeddings=embeddings)
    (results,) = pipe.search(QUERIES[:1], index, top_k=None, rerank=False, use_faiss=False)
    assert len(results) == count and len({item["video"] for item in results}) == count
