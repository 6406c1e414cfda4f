"""Long videos streamed into windows (`moments.WindowStream`, `moments.WindowRowDecoder`): times from the frames'
timestamps (a generated variable-frame-rate file), truncated files (windows up to the last decodable frame, a failure
with the time for the rest), a stall limit instead of a length limit (a decoder that stops making progress is stopped
and the error says where; a slow one that makes progress is not), decoders taking over from each other mid-video, and
a moment far into a long file decoded from its keyframe, not from the start.

References: the timestamps the test wrote into the file and the frame index every frame carries in its pixels; the
video processor applied to the frames of a window decoded on their own; PyAV's own plain decode."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.pipelines import FRAMES, build_retrieval, tiny_processor
from helpers.requirements import require
from helpers.videos import (
    CountingContainer,
    read_long_index,
    uniform,
    write_long_vfr_video,
    write_long_video,
    write_truncated_faststart_mp4,
)

import modeling_testa.video_decoding as decoding
from modeling_testa import VideoTextRetrievalPipeline
from testa_search.moments import WindowStream, decode_windows, moment_frames, plan_windows, probe_duration
from modeling_testa.video_decoding import VideoDecodingTimeoutError, decode_video, format_time


require("faiss")

# 20 s at 10 fps, then 40 s at 2 fps: 280 frames over 60 s, 4.7 fps on average
VFR_TIMES_MS = [k * 100 for k in range(200)] + [20000 + k * 500 for k in range(80)]


@pytest.fixture(scope="module")
def vfr_video(tmp_path_factory):
    return write_long_vfr_video(tmp_path_factory.mktemp("vfr") / "vfr.mp4", VFR_TIMES_MS)


@pytest.fixture(scope="module")
def long_video(tmp_path_factory):
    """Ten minutes at 2 fps (1,200 frames, a keyframe every 20), 112x16; every frame carries its index."""
    return write_long_video(tmp_path_factory.mktemp("long") / "ten_minutes.mp4", 1200, fps=2)


@pytest.fixture(scope="module")
def pipe():
    return VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")


@pytest.fixture
def fresh_decoder_process():
    decoding.shutdown_decoder_process()
    yield
    decoding.shutdown_decoder_process()


def shown_in(times_ms: list[int], start: float, end: float, num_frames: int) -> list[int]:
    """The frames a window `[start, end)` must hold, worked out from the written timestamps: the uniform segment
    midpoints of the frames shown inside it."""
    inside = [i for i, t in enumerate(times_ms) if start * 1000 - 1e-3 <= t < end * 1000 - 1e-3]
    return [inside[j] for j in uniform(len(inside), num_frames)]


# ---------------------------------------------------------------------------------------------- variable frame rate


@pytest.mark.parametrize("backend,isolate", [("pyav", False), ("pyav", True), ("decord", False), ("decord", True)])
def test_windows_of_a_variable_frame_rate_file_hold_the_frames_shown_in_them(vfr_video, backend, isolate):
    """By frame count over the average rate (4.7 fps), the window 40-60 s would show frames of 38-59 s and the window
    20-40 s frames of 19-29 s; by timestamps every frame of a window is shown inside it."""
    cut = decode_windows(vfr_video, window=20, stride=20, num_frames=4, backend=backend, isolate_decoder=isolate)
    assert cut.total_num_frames == 280 and cut.duration == pytest.approx(60.0)
    assert [round(start, 2) for start, _ in cut.windows] == [0.0, 20.0, 39.53]  # planned over the declared 59.53 s
    for (start, end), frames in zip(cut.windows, cut.frames):
        got = [read_long_index(frame) for frame in frames]
        assert got == shown_in(VFR_TIMES_MS, start, end, 4), (start, end)
        assert all(start <= VFR_TIMES_MS[i] / 1000 < end for i in got)


def test_an_index_of_a_variable_frame_rate_file_labels_its_moments_right(pipe, vfr_video):
    """`encode_videos(window=)`: every row's embedding is the model's on the frames shown inside its start-end,
    decoded on their own and transformed by the processor."""
    index = pipe.encode_videos([str(vfr_video)], window=20, stride=10)
    planned = plan_windows(probe_duration(vfr_video), 20, 10)
    assert [(start, end) for _, start, end in index.row_keys()] == planned
    processor, model = pipe.video_processor, pipe.model
    for row, (start, end) in enumerate(planned):
        wanted = shown_in(VFR_TIMES_MS, start, end, FRAMES)
        frames, _ = decode_video(vfr_video, lambda metadata, w=wanted: w)
        assert [read_long_index(frame) for frame in frames] == wanted
        pixel_values = processor(videos=[frames], num_frames=FRAMES, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.get_video_tokens(pixel_values)
            expected = model.get_video_features(video_tokens=out.last_hidden_state,
                                                video_token_sizes=out.token_sizes).pooler_output
        torch.testing.assert_close(index.embeddings[row:row + 1], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- truncated files


def test_an_index_of_a_truncated_file_holds_its_decodable_windows_and_a_failure_with_the_time_for_the_rest(
        pipe, long_video, tmp_path):
    cut_file = write_truncated_faststart_mp4(long_video, tmp_path / "cut.mp4", 0.6)
    index = pipe.encode_videos([str(cut_file), str(long_video)], window=60, stride=60)
    planned = plan_windows(600, 60, 60)
    decoded = index.row_keys()
    reached = [(start, end) for video, start, end in decoded if video == str(cut_file)]
    assert reached == planned[:5]  # 0-5 min: the data ends at 5:09
    assert [(start, end) for video, start, end in decoded if video == str(long_video)] == planned
    # one failure per window past the data, each naming the moment and where the data ends
    assert [f.video for f in index.failures] == [str(cut_file)] * 5
    for failure, (start, end) in zip(index.failures, planned[5:]):
        assert failure.code == "truncated", failure
        assert f"the moment {format_time(start)}-{format_time(end)} lies past the end of the video's decodable data " \
               "at 0:05:09" in failure.reason, failure.reason
    # the decodable windows are the file's real frames, not copies of its last one
    cut = decode_windows(cut_file, 60, 60, FRAMES)
    assert [[read_long_index(f) for f in frames] for frames in cut.frames] == \
        [shown_in([500 * i for i in range(1200)], start, end, FRAMES) for start, end in planned[:5]]


# ---------------------------------------------------------------------------------------------- stalls, not length


_FRAME_STEP = 'replies.send(("frame", index, frame.shape, frame.dtype.str))'


def _helper_with(tmp_path, monkeypatch, statement: str, backends: tuple[str, ...]) -> None:
    """This process' decoder helpers run a copy of the handler that runs `statement` (with `index`, the frame about
    to be sent) before sending each frame, with the decoders `backends`."""
    text = Path(decoding._WORKER_SCRIPT).read_text(encoding="utf-8")
    assert text.count(_FRAME_STEP) == 1
    line_start = text.rindex("\n", 0, text.index(_FRAME_STEP)) + 1
    indent = text[line_start:text.index(_FRAME_STEP)]
    text = text[:line_start] + f"{indent}import time; reader.backend in {backends!r} and ({statement})\n" + \
        text[line_start:]
    script = tmp_path / "helper" / "video_decoding_worker.py"
    script.parent.mkdir()
    script.write_text(text, encoding="utf-8")
    monkeypatch.setattr(decoding, "_WORKER_SCRIPT", str(script))
    decoding.shutdown_decoder_process()


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_a_decoder_that_stops_making_progress_is_stopped_and_says_where(long_video, tmp_path, monkeypatch,
                                                                         fresh_decoder_process, backend):
    _helper_with(tmp_path, monkeypatch, "index >= 300 and time.sleep(600)", (backend,))
    begin = time.monotonic()
    with pytest.raises(VideoDecodingTimeoutError) as error:
        decode_video(long_video, lambda metadata: [0, 100, 200, 300, 400], backend=backend, decode_timeout=2)
    assert time.monotonic() - begin < 60  # the stall is stopped (the sleep would last 600 s)
    message = str(error.value)
    assert "ten_minutes.mp4" in message and "no progress for decode_timeout=2 s" in message
    # the last frame it sent was 200 (1:40); a progress message may have said it got to frame 300 (2:30)
    assert "at 0:01:40 (frame 201 of 1200)" in message or "at 0:02:30 (frame 301 of 1200)" in message, message
    assert error.value.code == "timeout" and decoding.decoder_process().process is None  # killed


def test_a_slow_decoder_that_makes_progress_is_never_stopped(long_video, tmp_path, monkeypatch, fresh_decoder_process):
    """Each frame takes 0.4 s, 8 frames 3.2 s: longer than the 1.5 s limit in all, well under it for each step."""
    _helper_with(tmp_path, monkeypatch, "time.sleep(0.4)", ("pyav",))
    wanted = [int(i) for i in np.linspace(0, 1199, 8)]
    begin = time.monotonic()
    frames, _ = decode_video(long_video, lambda metadata: wanted, backend="pyav", decode_timeout=1.5)
    assert time.monotonic() - begin > 1.5
    assert [read_long_index(frame) for frame in frames] == wanted


def test_windows_before_a_stall_are_kept_and_the_rest_fail_with_the_time(long_video, tmp_path, monkeypatch,
                                                                          fresh_decoder_process):
    _helper_with(tmp_path, monkeypatch, "index >= 300 and time.sleep(600)", ("pyav",))
    clips = list(WindowStream(long_video, plan_windows(600, 60, 60), 4, backend="pyav", decode_timeout=2))
    decoded = [(clip.start, clip.end) for clip in clips if clip.error is None]
    assert decoded == [(0.0, 60.0), (60.0, 120.0)]  # frames 0-239: before the stall at frame 300 (2:30)
    for clip in clips[2:]:
        assert clip.error.code == "timeout" and "no progress for decode_timeout=2 s" in str(clip.error)
        assert f"before the end of the moment {format_time(clip.start)}-{format_time(clip.end)}" in str(clip.error)


def test_auto_continues_with_pyav_where_decord_stalled(long_video, tmp_path, monkeypatch, fresh_decoder_process):
    """``backend="auto"`` streams with PyAV first; when it stalls, decord takes over from the first frame not yet
    decoded, and every window holds its own frames."""
    _helper_with(tmp_path, monkeypatch, "index >= 300 and time.sleep(600)", ("pyav",))
    planned = plan_windows(600, 60, 30)
    stream = WindowStream(long_video, planned, 4, decode_timeout=2)
    clips = list(stream)
    assert [clip.error for clip in clips] == [None] * len(planned)
    for clip in clips:
        assert [read_long_index(f) for f in clip.frames] == shown_in([500 * i for i in range(1200)], clip.start,
                                                                      clip.end, 4)


# ---------------------------------------------------------------------------------------------- a moment far in


def test_a_moment_far_into_a_long_file_is_decoded_from_its_keyframe(tmp_path, monkeypatch):
    """PyAV demuxes the file once (timestamps), then seeks to the keyframe before the moment: it reads a few GOPs'
    packets, not the hour before the moment (the frames are the right ones either way)."""
    import av

    hour = write_long_video(tmp_path / "hour.mp4", 7200, fps=2)  # a keyframe every 20 frames
    counts = {"packets": 0, "frames": 0, "seeks": 0}
    real_open = av.open

    monkeypatch.setattr(av, "open", lambda *args, **kwargs: CountingContainer(real_open(*args, **kwargs), counts))
    frames = moment_frames(hour, 3000, 3020, num_frames=6, backend="pyav", isolate_decoder=False)
    assert [read_long_index(f) for f in frames] == [6000 + i for i in uniform(40, 6)]
    assert counts["seeks"] >= 1 and counts["packets"] <= 7200 + 3 * 20, counts  # the probe, then about 2 GOPs


# ---------------------------------------------------------------------------------------------- streams and short reads


def test_short_reads_never_wait_for_a_stream_and_nested_reads_do_not_deadlock(long_video, fresh_decoder_process):
    """A stream holds its decoder helper for the whole video while its windows are used (an index encodes them):
    a moment's strip asked for meanwhile, in another thread, is decoded by the helper for short reads at once; in the
    same thread, a read inside the stream gets a helper of its own instead of waiting for itself."""
    import threading

    stream = iter(WindowStream(long_video, plan_windows(600, 60, 60), 4, backend="pyav"))
    first = next(stream)  # mid-video: the stream helper is held
    strips = []
    other = threading.Thread(target=lambda: strips.append(moment_frames(long_video, 500, 520, 2, backend="pyav")))
    other.start()
    other.join(120)
    assert strips and [read_long_index(f) for f in strips[0]] == [1000 + i for i in uniform(40, 2)]
    frames, _ = decode_video(long_video, lambda metadata: [5], backend="pyav")  # this thread, short read
    nested = list(WindowStream(long_video, [(0.0, 60.0)], 4, backend="pyav"))  # this thread, another stream
    assert read_long_index(frames[0]) == 5 and [read_long_index(f) for f in nested[0].frames] == uniform(120, 4)
    clips = [first, *stream]
    assert len(clips) == 10 and all(clip.error is None for clip in clips)
    assert [read_long_index(f) for f in clips[-1].frames] == [1080 + i for i in uniform(120, 4)]
