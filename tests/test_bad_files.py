"""Bad files are data: the one encode loop (`modeling_testa.indexing`) records a video it cannot read with a reason
code and goes on, for `DecodeVideos` (train.index, the evaluation), `DecodeAhead` (the pipeline) and the pipeline's
`encode_videos`; and an in-memory index grows (`encode_videos(..., index=existing)`).

References: real mp4s (tests/helpers/videos.py) and one broken file of each kind, whose expected code is known by
construction; an index built from the good videos only (search results and tensors compared exactly); the encoder's
own call count."""

import os
from pathlib import Path

import pytest
import torch
from helpers.pipelines import build_retrieval, tiny_processor
from helpers.videos import write_bad_videos, write_noise_video, write_video

import modeling_testa.indexing as indexing
from modeling_testa import VideoTextRetrievalPipeline
from modeling_testa.indexing import (
    FAILURE_CODES,
    DecodeAhead,
    DecodeVideos,
    check_on_error,
    failure_code,
    failure_reason,
    failure_summary,
    looks_like_video,
)
from modeling_testa.video_decoding import VideoDecodingError, VideoDecodingTimeoutError

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
        reason = failure_reason(error.value, path)
        assert reason.startswith(f"{code}: {type(error.value).__name__}: ") and path in reason
    assert set(bad) <= set(FAILURE_CODES)


def test_decoder_crash_and_timeout_codes_come_from_the_decoder_client_errors(files):
    good, _, _ = files
    # the messages `video_decoding.DecoderProcess` gives when its helper dies or exceeds decode_timeout
    crashed = VideoDecodingError(good[0], "the pyav decoder crashed (SIGSEGV)", "pyav")
    gone = VideoDecodingError(good[0], "the decoder process exited unexpectedly (exit code 1)", "pyav")
    slow = VideoDecodingTimeoutError(good[0], "decoding took longer than decode_timeout=1 s", "pyav")
    assert [failure_code(e, good[0]) for e in (crashed, gone, slow)] == ["decoder_crash", "decoder_crash", "timeout"]
    assert failure_code(VideoDecodingError(good[0], "no video stream"), good[0]) == "unreadable"
    assert failure_code(PermissionError(13, "Permission denied", good[0]), good[0]) == "unreadable"


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
    failures = [(f"v{i}.mp4", f"truncated: VideoDecodingError: cut {i}") for i in range(13)]
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
    assert [(i, path) for i, path, _ in failures] == [(i, p) for i, p in enumerate(mixed) if p in codes]
    assert all(reason.startswith(codes[path] + ": ") for _, path, reason in failures)
    raising = DecodeVideos(tiny_processor().video_processor, 4, on_error="raise")
    with pytest.raises(ValueError, match="notes.mp4"):
        raising(list(enumerate(mixed)))


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_ahead_skips_in_order_with_and_without_threads(files, workers):
    good, bad, mixed = files
    processor = tiny_processor().video_processor
    decode = lambda i: processor(videos=[mixed[i]])["pixel_values"]  # noqa: E731
    with DecodeAhead(decode, len(mixed), workers, window=4) as ahead:
        batches = list(ahead.batches(3, "skip", mixed.__getitem__))
    assert [i for b in batches for i in b[0]] == [i for i, p in enumerate(mixed) if p in good]
    assert [f[1] for b in batches for f in b[2]] == [p for p in mixed if p not in good]
    assert all(b[1] is None or b[1].shape[0] == len(b[0]) for b in batches)
    with DecodeAhead(decode, len(mixed), workers, window=4) as ahead, pytest.raises(ValueError, match="notes.mp4"):
        list(ahead.batches(3, "raise"))
