"""Moments of long videos (testa_search/moments.py): window plans worked out by hand, an hour-long video decoded
once for all its windows (decoder opens, packets and seeks counted), and windows equal to the same frames decoded
window by window."""

import math

import numpy as np
import pytest
import torch
from helpers.videos import CountingContainer, read_long_index, write_long_video, write_truncated_faststart_mp4

from testa_search.moments import (
    best_moment_per_video,
    check_window_options,
    decode_windows,
    format_time,
    frame_spans,
    plan_windows,
    refine_moment,
    window_frame_indices,
    window_pixel_values,
)
from modeling_testa.video_decoding import VideoDecodingError, decode_video


# ------------------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize(
    "duration, window, stride, expected",
    [
        (100, 40, 30, [(0, 40), (30, 70), (60, 100)]),  # the third regular window (60, 100) ends at the end
        (100, 40, 40, [(0, 40), (40, 80), (60, 100)]),  # (80, 120) would overrun: moved back to end at 100
        (120, 40, 40, [(0, 40), (40, 80), (80, 120)]),  # exact multiple: no extra window
        (40, 40, 10, [(0, 40)]),  # exactly one window
        (25, 40, 10, [(0, 25)]),  # shorter than a window: the whole video, one entry
        (0.3, 0.1, 0.1, [(0, 0.1), (0.1, 0.2), (0.2, 0.3)]),  # 0.3 - 0.1 = 0.19999...: no fourth window
    ],
)
def test_plan_windows_hand_worked(duration, window, stride, expected):
    planned = plan_windows(duration, window, stride)
    assert len(planned) == len(expected)
    for (start, end), (want_start, want_end) in zip(planned, expected):
        assert start == pytest.approx(want_start) and end == pytest.approx(want_end)


def test_an_hour_in_overlapping_windows_covers_every_second():
    planned = plan_windows(3600, 60, 30)
    assert len(planned) == 119 and planned[0] == (0.0, 60.0) and planned[-1] == (3540.0, 3600.0)
    assert all(end - start == 60 for start, end in planned)
    covered = np.zeros(3600, dtype=bool)
    for start, end in planned:
        covered[int(start):int(end)] = True
    assert covered.all()


@pytest.mark.parametrize(
    "window, stride, message",
    [(0, None, "`window` must be a positive"), (-5, 2, "`window` must be a positive"), (10, 0, "`stride` must be"),
     (math.inf, None, "`window` must be"), (True, None, "`window` must be"), (None, 5, "`stride=5` needs `window`"),
     (20, 50, "`stride=50` is longer than `window=20`")],  # it would leave gaps no search finds (issue 52)
)
def test_bad_window_options_are_named(window, stride, message):
    with pytest.raises(ValueError, match=message):
        check_window_options(window, stride)


def test_bad_duration_is_refused():
    with pytest.raises(ValueError, match="a video of 0.0 seconds"):
        plan_windows(0, 10, 10)


def test_window_frame_indices_are_uniform_midpoints_inside_the_window():
    # window [30, 60) s at 2 fps: frames 60..119 (60 frames); 4 segments of 15 frames, midpoints 7, 22, 37, 52
    assert window_frame_indices(30, 60, 2.0, 7200, 4).tolist() == [67, 82, 97, 112]
    # a window past the last frame keeps to the frames there are: [100, 200) s at 1 fps of a 150-frame video
    assert window_frame_indices(100, 200, 1.0, 150, 2).tolist() == [112, 137]
    # fewer frames than asked (3 frames, 4 wanted): floor((2i + 1) * 3 / 8) = 0, 1, 1, 2, repeated in order as a
    # short clip's are
    assert window_frame_indices(0, 1.5, 2.0, 100, 4).tolist() == [0, 1, 1, 2]


def test_format_time_and_grouping():
    assert [format_time(t) for t in (0, 59.99, 61, 3725.4, 36000)] == ["0:00:00", "0:00:59", "0:01:01", "1:02:05",
                                                                        "10:00:00"]
    assert format_time(None) == "-"
    with pytest.raises(ValueError, match="non-negative"):
        format_time(-1)
    ranking = [{"video": "a", "start": 30, "end": 60, "score": 0.9},
               {"video": "b", "start": 0, "end": 30, "score": 0.8},
               {"video": "a", "start": 0, "end": 30, "score": 0.7},
               {"video": "c", "start": None, "end": None, "score": 0.1}]
    assert best_moment_per_video(ranking) == [ranking[0], ranking[1], ranking[3]]


# ------------------------------------------------------------------------------------------------ decoding once


HOUR_FPS = 2


@pytest.fixture(scope="module")
def hour_video(tmp_path_factory):
    """An hour at 2 fps, 112x16 pixels (about 0.2 MB, written in about 2 s); every frame carries its index."""
    path = write_long_video(tmp_path_factory.mktemp("long") / "hour.mp4", 3600 * HOUR_FPS, fps=HOUR_FPS)
    assert _packets_in(path) == 3600 * HOUR_FPS  # counted before any test wraps av.open
    return path


@pytest.fixture
def pyav_counts(monkeypatch):
    import av

    counts = {"opens": 0, "packets": 0, "frames": 0, "seeks": 0}
    real_open = av.open

    def counting_open(*args, **kwargs):
        counts["opens"] += 1
        return CountingContainer(real_open(*args, **kwargs), counts)

    monkeypatch.setattr(av, "open", counting_open)
    return counts


def _packets_in(path):
    import av

    with av.open(str(path)) as container:
        return sum(packet.size > 0 for packet in container.demux(container.streams.video[0]))


def test_an_hour_long_video_is_decoded_once_for_all_its_windows(hour_video, pyav_counts):
    file_packets = 3600 * HOUR_FPS
    cut = decode_windows(hour_video, window=60, stride=30, num_frames=8, backend="pyav", isolate_decoder=False)
    assert len(cut.windows) == 119 and cut.frames.shape == (119, 8, 16, 112, 3)
    # one probe (demux only) and one decoding pass for all 119 windows, front to back: it jumps ahead to the GOP of
    # the next frame wanted (a seek per GOP at most: a keyframe every 20 frames) and reads fewer packets than the file
    print("one pass for 119 windows:", pyav_counts)
    assert pyav_counts["opens"] == 2 and 0 < pyav_counts["seeks"] <= file_packets // 20
    assert pyav_counts["packets"] < 2 * file_packets
    # every window holds its own frames: read back from the pixels, against indices worked out from the plan
    for (start, end), frames in zip(cut.windows, cut.frames):
        expected = window_frame_indices(start, end, HOUR_FPS, 3600 * HOUR_FPS, 8)
        assert [read_long_index(frame) for frame in frames] == expected.tolist()
        assert start * HOUR_FPS <= expected.min() and expected.max() < end * HOUR_FPS


def test_decoding_window_by_window_would_reopen_and_reread_the_file(hour_video, pyav_counts):
    """The cost decode_windows avoids: three windows decoded one by one already open the file six times and read
    more packets than the whole one-pass decode of 119 windows."""
    file_packets = 3600 * HOUR_FPS
    for start, end in plan_windows(3600, 60, 30)[-3:]:
        decode_video(hour_video, lambda m, s=start, e=end: window_frame_indices(s, e, m.fps, m.total_num_frames, 8),
                     backend="pyav", isolate_decoder=False)
    print("three windows one by one:", pyav_counts)
    assert pyav_counts["opens"] == 6
    assert pyav_counts["packets"] > 2 * file_packets


def test_isolated_decoder_and_decord_cut_the_same_windows(hour_video):
    reference = decode_windows(hour_video, 600, 300, num_frames=4, backend="pyav", isolate_decoder=False)
    isolated = decode_windows(hour_video, 600, 300, num_frames=4, backend="pyav")  # the helper process (default)
    assert isolated.windows == reference.windows and np.array_equal(isolated.frames, reference.frames)
    auto = decode_windows(hour_video, 600, 300, num_frames=4)  # decord where installed
    assert [[read_long_index(f) for f in w] for w in auto.frames] == reference.frame_indices.tolist()


def test_a_video_shorter_than_a_window_is_one_entry(tmp_path):
    path = write_long_video(tmp_path / "short.mp4", 20, fps=4)  # 5 seconds
    cut = decode_windows(path, window=30, num_frames=4, isolate_decoder=False)
    assert cut.windows == [(0.0, 5.0)] and cut.duration == 5.0
    # the whole video's 20 frames, 4 segments of 5: midpoints 2, 7, 12, 17
    assert [read_long_index(f) for f in cut.frames[0]] == [2, 7, 12, 17]


def test_a_damaged_file_raises_naming_it(tmp_path):
    path = write_long_video(tmp_path / "cut.mp4", 200, fps=2)
    data = path.read_bytes()
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(data[: len(data) // 3])  # the moov atom (at the end) is lost
    with pytest.raises(VideoDecodingError, match="broken.mp4"):
        decode_windows(broken, window=10, num_frames=2)
    with pytest.raises(ValueError, match="`num_frames` must be a positive int"):
        decode_windows(path, window=10, num_frames=0)


def test_window_pixel_values_equal_each_window_decoded_on_its_own(tmp_path):
    from modeling_testa import TestaVideoProcessor

    path = write_long_video(tmp_path / "ten_minutes.mp4", 600 * 2, fps=2)
    processor = TestaVideoProcessor(num_frames=4, size={"shortest_edge": 32}, crop_size={"height": 16, "width": 32})
    cut, pixel_values = window_pixel_values(processor, path, window=120, stride=90)
    assert cut.windows == [(0.0, 120.0), (90.0, 210.0), (180.0, 300.0), (270.0, 390.0), (360.0, 480.0),
                           (450.0, 570.0), (480.0, 600.0)]
    assert pixel_values.shape == (7, 4, 3, 16, 32)
    for (start, end), clip in zip(cut.windows, pixel_values):
        # the reference decodes only this window's frames, as a clip of its own
        def sample(metadata, s=start, e=end):
            return window_frame_indices(s, e, metadata.fps, metadata.total_num_frames, 4)

        frames, _ = processor.fetch_videos(str(path), sample_indices_fn=sample)
        expected = processor(videos=[frames], num_frames=4, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(clip, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ refining


def test_frame_spans_share_the_window_equally():
    assert frame_spans(30, 60, 3) == [(30, 40), (40, 50), (50, 60)]


def test_refine_moment_keeps_the_run_around_the_best_frame():
    spans = frame_spans(0, 80, 8)  # 10 s per frame
    # scores 0..1: threshold at half-way 0.5; best frame 4 (0.9); the run 3..5 (0.6, 0.9, 0.5); frame 7 (0.8) is
    # above the threshold but cut off from the run by frame 6
    scores = [0.0, 0.1, 0.2, 0.6, 0.9, 0.5, 0.1, 0.8]
    assert refine_moment(spans, scores) == (30.0, 60.0)
    # a higher level trims: threshold 0.72 keeps frame 4 alone
    assert refine_moment(spans, scores, level=0.8) == (40.0, 50.0)
    # level 0 keeps everything: the whole span
    assert refine_moment(spans, scores, level=0.0) == (0.0, 80.0)


def test_refine_moment_merges_overlapping_windows_in_time_order_and_skips_nan():
    # two windows (0, 40) and (20, 60) of 2 frames each, given out of order: frames (20, 40), (40, 60), (0, 20),
    # (20, 40); NaN never qualifies
    spans = frame_spans(20, 60, 2) + frame_spans(0, 40, 2)
    assert refine_moment(spans, [0.9, 0.2, float("nan"), 0.8]) == (20.0, 40.0)
    assert refine_moment(spans, [0.9, 0.7, 0.1, 0.8]) == (20.0, 60.0)
    with pytest.raises(ValueError, match="one score per frame span"):
        refine_moment(spans, [0.1])
    with pytest.raises(ValueError, match="NaN"):
        refine_moment(spans, [float("nan")] * 4)


def test_moment_frames_come_from_inside_the_moment(hour_video):
    from testa_search.moments import moment_frames

    frames = moment_frames(hour_video, 1800, 1830, num_frames=3, isolate_decoder=False)
    # frames 3600..3659 at 2 fps: 3 segments of 20, midpoints 10, 30, 50
    assert [read_long_index(f) for f in frames] == [3610, 3630, 3650]
    with pytest.raises(ValueError, match="0 <= start < end"):
        moment_frames(hour_video, 30, 10)


def _decodable_frames(path) -> int:
    """How many frames PyAV's own plain decode gets out of a file (stopping at its first error)."""
    import av

    count = 0
    with av.open(str(path)) as container:
        try:
            for _ in container.decode(video=0):
                count += 1
        except av.FFmpegError:
            pass
    return count


@pytest.mark.parametrize("isolate", [False, True])
def test_a_truncated_file_gives_the_windows_its_data_reaches_and_failures_for_the_rest(tmp_path, isolate):
    """An mp4 whose index survives but whose last frames' data is lost (the index declares 10 minutes): the windows
    are planned over the 10 minutes, those the data reaches are decoded from their real frames, and each of the rest
    is a failure naming the file, the moment and where the data ends, never a copy of the last frame."""
    source = write_long_video(tmp_path / "ten_minutes.mp4", 1200, fps=2)
    cut_file = write_truncated_faststart_mp4(source, tmp_path / "cut.mp4", 0.6)
    decodable = _decodable_frames(cut_file)
    assert 500 < decodable < 700  # about 5 minutes of the 10
    cut = decode_windows(cut_file, window=60, stride=60, num_frames=4, backend="auto", isolate_decoder=isolate)
    planned = plan_windows(600, 60, 60)
    assert cut.total_num_frames == 1200 and cut.windows == [w for w in planned if w[1] * 2 <= decodable]
    for (start, end), frames in zip(cut.windows, cut.frames):
        expected = window_frame_indices(start, end, 2, decodable, 4)
        assert [read_long_index(f) for f in frames] == expected.tolist()
    assert [(start, end) for start, end, _ in cut.failures] == [w for w in planned if w[1] * 2 > decodable]
    for start, end, error in cut.failures:
        assert isinstance(error, VideoDecodingError) and error.source == str(cut_file)
        assert f"{format_time(start)}-{format_time(end)}" in str(error) and "0:05:0" in str(error), str(error)
