"""Video decoding (`modeling_testa.video_decoding`): frame sampling, the exact frames of real mp4 files written with
PyAV for decord and PyAV (in process and in the helper process), errors that name the file, and the guard that turns
a decoder crash or hang in the helper process into an exception."""

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.videos import RAW, mp4_boxes, read_index, uniform, write_test_videos, write_truncated_faststart_mp4

import modeling_testa.video_decoding as decoding
import modeling_testa.video_decoding_worker as worker
from modeling_testa import TestaVideoProcessor, VideoDecodingError, VideoDecodingTimeoutError, decode_video
from modeling_testa.video_decoding import frames_for_fps, sample_frame_indices


# (decoder backend, run the decoder in the helper process)
BACKENDS = [("decord", True), ("decord", False), ("pyav", True), ("pyav", False)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Real H.264 mp4s of different lengths, frame rates and sizes; one grayscale; plus broken files."""
    return write_test_videos(tmp_path_factory.mktemp("videos"))


@pytest.fixture
def fresh_decoder_process():
    """Stops the decoder helper process before and after a test that patches it."""
    decoding.shutdown_decoder_process()
    yield
    decoding.shutdown_decoder_process()


# ----------------------------------------------------------------------------------------------------------------------
# frame sampling
# ----------------------------------------------------------------------------------------------------------------------


def test_uniform_sampling_is_segment_midpoints_and_covers_the_tail():
    idx = sample_frame_indices(100, 8, "uniform")
    assert idx.tolist() == [6, 18, 31, 43, 56, 68, 81, 93] == uniform(100, 8)
    # the original floor-stride (`np.arange(0, vlen, vlen / N, dtype=int)`) stops at 84 and never sees the last 16
    original = np.arange(0, 100, 100 / 8, dtype=int)
    assert original.tolist() == [0, 12, 24, 36, 48, 60, 72, 84]
    assert idx[-1] > original[-1] and idx[-1] >= 100 - 100 // 8
    for total, n in [(1800, 32), (31, 32), (33, 32), (1, 4), (7, 7)]:
        assert sample_frame_indices(total, n).tolist() == uniform(total, n)


def test_short_videos_repeat_frames_evenly_in_order():
    for strategy in ("uniform", "random", "headtail"):
        idx = sample_frame_indices(3, 8, strategy)
        assert idx.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    idx = sample_frame_indices(5, 8)
    assert idx.tolist() == [0, 0, 1, 2, 2, 3, 4, 4]
    assert sorted(set(idx.tolist())) == list(range(5))  # every frame is used


def test_random_sampling_one_frame_per_segment_and_seedable():
    total, n = 103, 8
    bounds = [i * total // n for i in range(n + 1)]
    seen = [set() for _ in range(n)]
    for seed in range(60):
        idx = sample_frame_indices(total, n, "random", torch.Generator().manual_seed(seed))
        for i, j in enumerate(idx):
            assert bounds[i] <= j < bounds[i + 1]
            seen[i].add(int(j))
    assert all(len(s) > 5 for s in seen)  # really random within the segments
    a = sample_frame_indices(total, n, "random", torch.Generator().manual_seed(3))
    b = sample_frame_indices(total, n, "random", torch.Generator().manual_seed(3))
    c = sample_frame_indices(total, n, "random", torch.Generator().manual_seed(4))
    assert a.tolist() == b.tolist() != c.tolist()
    torch.manual_seed(0)
    d = sample_frame_indices(total, n, "random")
    torch.manual_seed(0)
    assert d.tolist() == sample_frame_indices(total, n, "random").tolist()  # global torch RNG without a generator


def test_headtail_sampling():
    for n in (8, 7):
        idx = sample_frame_indices(100, n, "headtail", torch.Generator().manual_seed(1))
        head, tail = idx[: n // 2], idx[n // 2 :]
        assert len(idx) == n
        assert all(0 <= i < 50 for i in head) and all(50 <= i < 100 for i in tail)
        assert len(set(head.tolist())) == len(head) and len(set(tail.tolist())) == len(tail)
        assert head.tolist() == sorted(head.tolist()) and tail.tolist() == sorted(tail.tolist())


def test_sampling_rejects_bad_arguments():
    with pytest.raises(ValueError, match="frame_sampling"):
        sample_frame_indices(10, 4, "middle")
    with pytest.raises(ValueError, match="0 frames"):
        sample_frame_indices(0, 4)


def test_frames_for_fps_follows_transformers_rule():
    # max(1, int(total / video_fps * fps)), worked out by hand
    assert frames_for_fps(90, 30, 2) == 6  # 3 s at 2 frames per second
    assert frames_for_fps(50, 25, 1) == 2
    assert frames_for_fps(100, 29.97, 1) == 3  # 3.34 s
    assert frames_for_fps(5, 10, 0.1) == 1  # 0.05 frames: at least one
    assert frames_for_fps(90, 30, 30) == 90  # the video's own rate: every frame
    with pytest.raises(ValueError, match=r"clip\.mp4 at fps=60 asks for 180 frames, but it has only 90"):
        frames_for_fps(90, 30, 60, "clip.mp4")
    with pytest.raises(ValueError, match=r"fps=2.*frame rate of an array.*video_metadata"):
        frames_for_fps(90, None, 2, "an array")
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="`fps` must be a positive number"):
            frames_for_fps(90, 30, bad)


# ----------------------------------------------------------------------------------------------------------------------
# decoding real files: exact frames for each backend
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,isolate", BACKENDS)
@pytest.mark.parametrize("name,total,fps,size", [("long", 90, 30, (240, 320)), ("small", 50, 25, (144, 176)),
                                                 ("gray", 40, 24, (160, 208)), ("bframes", 60, 30, (160, 192))])
def test_exact_uniform_frames(videos, backend, isolate, name, total, fps, size):
    vp = TestaVideoProcessor(num_frames=8, video_backend=backend, isolate_decoder=isolate)
    out = vp(videos[name], return_metadata=True, **RAW)
    meta = out["video_metadata"][0]
    expected = uniform(total, 8)
    assert meta.frames_indices == expected
    assert meta.total_num_frames == total and meta.fps == pytest.approx(fps)
    assert (meta.height, meta.width) == size and meta.video_backend == backend
    assert meta.timestamps == pytest.approx([i / fps for i in expected])
    pixels = out["pixel_values"]
    assert pixels.shape == (1, 8, 3) + size and pixels.dtype == torch.float32
    decoded = [read_index(frame.permute(1, 2, 0).numpy()) for frame in pixels[0]]
    assert decoded == expected  # the pixels really are those frames
    assert expected[-1] >= total - total // 8  # the tail is sampled


@pytest.mark.parametrize("backend,isolate", BACKENDS)
def test_short_video_repeats_real_frames(videos, backend, isolate):
    vp = TestaVideoProcessor(num_frames=8, video_backend=backend, isolate_decoder=isolate)
    out = vp(str(videos["short"]), return_metadata=True, **RAW)
    assert out["video_metadata"][0].frames_indices == [0, 0, 1, 2, 2, 3, 4, 4]
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == [0, 0, 1, 2, 2, 3, 4, 4]


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_random_and_headtail_sampling_from_files(videos, backend):
    vp = TestaVideoProcessor(num_frames=6, video_backend=backend)
    a = vp(videos["long"], frame_sampling="random", seed=7, return_metadata=True, **RAW)
    b = vp(videos["long"], frame_sampling="random", seed=7, return_metadata=True, **RAW)
    idx = a["video_metadata"][0].frames_indices
    assert idx == b["video_metadata"][0].frames_indices
    assert all(i * 90 // 6 <= j < (i + 1) * 90 // 6 for i, j in enumerate(idx))
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in a["pixel_values"][0]] == idx
    h = vp(videos["long"], frame_sampling="headtail", seed=1, return_metadata=True, **RAW)
    idx = h["video_metadata"][0].frames_indices
    assert all(i < 45 for i in idx[:3]) and all(i >= 45 for i in idx[3:])
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in h["pixel_values"][0]] == idx


def test_pyav_seeks_and_skips_unneeded_frames_without_changing_pixels(videos):
    """PyAV jumps to the keyframe before a wanted frame when it lies ahead and skips non-reference frames that are
    not wanted: fewer frames are decoded, and every frame it gives equals PyAV's own plain decode of the file."""
    import av

    path = str(videos["bframes"])  # 60 frames, a keyframe every 12, B-frames (some of them reference frames)
    with av.open(path) as container:
        decoded = list(container.decode(video=0))
        plain = [frame.to_ndarray(format="rgb24") for frame in decoded]
        assert [int(f.pict_type) for f in decoded].count(3) > 10  # AV_PICTURE_TYPE_B: the file has B-frames
    decoded_frames = {}
    for wanted in ([4, 12, 21, 30, 38, 47, 55], [0, 59], [13], [47, 48], list(range(60))):
        for seek in (True, False):
            reader = worker.PyAVReader(path, None, seek=seek)
            seen = []
            got = list(reader.frames(wanted, lambda reached, seconds: seen.append(reached)))  # one call per frame
            assert [i for i, _ in got] == wanted and reader.reached == wanted[-1] + 1 and reader.error is None
            assert all(np.array_equal(frame, plain[i]) for i, frame in got), (wanted, seek)
            assert (reader.seeks > 0) == (seek and wanted[0] >= 12 and wanted != list(range(60))) or \
                wanted[0] < 12, (wanted, seek, reader.seeks)
            decoded_frames[tuple(wanted), seek] = len(seen)
    sparse = (4, 12, 21, 30, 38, 47, 55)
    # skipping alone decodes fewer frames than the 56 up to the last one wanted; seeking fewer still
    assert decoded_frames[sparse, True] < decoded_frames[sparse, False] < 56
    assert decoded_frames[(13,), True] <= 3 < decoded_frames[(13,), False]  # from the keyframe at 12, not from 0
    vp = TestaVideoProcessor(num_frames=7, video_backend="pyav", **RAW)
    isolated, in_process = vp(path)["pixel_values"], vp(path, isolate_decoder=False)["pixel_values"]
    assert torch.equal(isolated, in_process)
    assert torch.equal(isolated, vp(path, video_backend="decord")["pixel_values"])
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in isolated[0]] == uniform(60, 7)


@pytest.mark.parametrize("isolate", [True, False])
def test_truncated_faststart_file_decodes_the_frames_that_are_there(videos, tmp_path, caplog, isolate):
    cut = write_truncated_faststart_mp4(videos["long"], tmp_path / "cut.mp4", 0.6)
    out = TestaVideoProcessor(num_frames=4, video_backend="pyav", isolate_decoder=isolate)(cut, return_metadata=True,
                                                                                          **RAW)
    meta = out["video_metadata"][0]
    assert 0 < meta.total_num_frames < 90
    assert "could be decoded" in caplog.text and "cut.mp4" in caplog.text
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == meta.frames_indices
    assert meta.frames_indices == uniform(meta.total_num_frames, 4)


def test_decord_and_pyav_give_identical_pixels(videos):
    vp = TestaVideoProcessor(num_frames=8)
    a = vp(videos["small"], video_backend="decord")["pixel_values"]
    b = vp(videos["small"], video_backend="pyav")["pixel_values"]
    assert torch.equal(a, b)


def test_reused_rgb_converter_matches_per_frame_conversion(videos):
    """One `RGBConverter` across videos of different sizes and pixel formats gives exactly PyAV's own
    ``to_ndarray(format="rgb24")`` for every frame (a cached swscale context must follow size/format changes)."""
    import av

    convert = worker.RGBConverter(av)
    assert convert.reformatter is not None  # the fast path is what is tested
    checked = 0
    for name in ("long", "small", "gray", "bframes", "short"):
        with av.open(str(videos[name])) as container:
            for frame in container.decode(video=0):
                fast, reference = convert(frame), frame.to_ndarray(format="rgb24")
                assert fast.shape == reference.shape == (frame.height, frame.width, 3), name
                assert np.array_equal(fast, reference), name
                checked += 1
    assert checked == 90 + 50 + 40 + 60 + 5


# ----------------------------------------------------------------------------------------------------------------------
# bad files: clear exceptions that name the file
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isolate", [True, False])
@pytest.mark.parametrize("backend", ["auto", "decord", "pyav"])
def test_bad_files(videos, tmp_path, backend, isolate):
    vp = TestaVideoProcessor(num_frames=4, video_backend=backend, isolate_decoder=isolate)
    missing = tmp_path / "missing.mp4"
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        vp(missing)
    with pytest.raises(ValueError, match=r"empty\.mp4.*empty \(0 bytes\)"):
        vp(videos["empty"])
    # FFmpeg's own reason comes from PyAV's log capture or from the helper's log; decord in process only prints it
    in_process_decord = (backend, isolate) == ("decord", False)
    with pytest.raises(ValueError, match=r"truncated\.mp4.*" + ("Error reading" if in_process_decord else
                                                                   "moov atom not found")):
        vp(videos["truncated"])
    with pytest.raises(ValueError, match=r"notes\.mp4.*" + ("Error reading" if in_process_decord else
                                                               "Invalid data found")):
        vp(videos["text"])
    with pytest.raises(VideoDecodingError, match=r"no_frames\.mp4") as info:
        vp(videos["no_frames"])
    if backend != "decord":
        assert "no decodable frames" in str(info.value)
    with pytest.raises(FileNotFoundError, match="missing.mp4"):  # one bad file fails the whole batch, naming it
        vp([videos["small"], missing])


def test_file_without_video_stream(tmp_path):
    import av

    path = tmp_path / "speech.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(ValueError, match=r"speech\.mp4.*no video stream"):
        TestaVideoProcessor(video_backend="pyav")(path)
    with pytest.raises(ValueError, match=r"speech\.mp4.*no decoder could read it"):
        TestaVideoProcessor(video_backend="auto")(path)


# ----------------------------------------------------------------------------------------------------------------------
# the decoder guard: whichever backend runs, a decoder crash or hang cannot kill or block the caller
# ----------------------------------------------------------------------------------------------------------------------


# The helper's stream step, and the step that sends each frame; the fault tests run a copy of the helper's handler
# with a fault injected right before one of them.
_STREAM_STEP = "for index, frame in reader.frames(wanted, ProgressReports(replies)):"
_FRAME_STEP = 'replies.send(("frame", index, frame.shape, frame.dtype.str))'


def _inject(text: str, step: str, statement: str) -> str:
    """`text` with `statement` inserted before the one line holding `step`, at that line's indentation."""
    assert text.count(step) == 1
    line_start = text.rindex("\n", 0, text.index(step)) + 1
    indent = text[line_start:text.index(step)]
    return text[:line_start] + indent + statement + "\n" + text[line_start:]


def _faulty_worker(tmp_path, monkeypatch, fault: str, backends: tuple[str, ...], step: str = _STREAM_STEP) -> None:
    """Makes this process start its decoder helper with a copy of `video_decoding_worker.py` that runs `fault` (a
    Python expression: a segfault, an abort, a sleep) before `step` (by default: before streaming frames) with one of
    `backends`."""
    text = Path(decoding._WORKER_SCRIPT).read_text(encoding="utf-8")
    text = _inject(text, step, f"import os, time; reader.backend in {backends!r} and ({fault})")
    script = tmp_path / "faulty_worker" / "video_decoding_worker.py"
    script.parent.mkdir()
    script.write_text(text, encoding="utf-8")
    monkeypatch.setattr(decoding, "_WORKER_SCRIPT", str(script))
    decoding.shutdown_decoder_process()


def _without_decord(tmp_path, monkeypatch) -> None:
    """Simulates an install without decord, here and in the helper process (whose environment shadows it)."""
    fake = tmp_path / "no_decord"
    (fake / "decord").mkdir(parents=True)
    (fake / "decord" / "__init__.py").write_text("raise ImportError('No module named decord (simulated)')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])))
    monkeypatch.setitem(sys.modules, "decord", None)
    decoding.shutdown_decoder_process()
    assert not decoding.decoder_available("decord") and decoding.decoder_available("pyav")


def _helper_pid() -> int | None:
    worker_process = decoding.decoder_process().process
    return worker_process.pid if worker_process is not None and worker_process.poll() is None else None


# (scenario, video_backend, backends the fault hits, the error message after the file name)
FAULT_SCENARIOS = [
    ("decord", "decord", ("decord",), r" with decord: the decord decoder crashed \({signal}\)"),
    ("explicit pyav", "pyav", ("pyav",), r" with pyav: the pyav decoder crashed \({signal}\)"),
    ("auto, both fail", "auto", ("decord", "pyav"),
     r": no decoder could read it \(decord: the decord decoder crashed \({signal}\); pyav: the pyav decoder crashed "
     r"\({signal}\)\)"),
    ("no decord installed", "auto", ("pyav",), r" with pyav: the pyav decoder crashed \({signal}\)"),
]


@pytest.mark.parametrize("scenario,backend,hit,message", FAULT_SCENARIOS, ids=[s[0] for s in FAULT_SCENARIOS])
@pytest.mark.parametrize("fault,signal_name", [("os.kill(os.getpid(), 11)", "SIGSEGV"), ("os.abort()", "SIGABRT")])
def test_decoder_crash_is_an_exception(videos, tmp_path, monkeypatch, fresh_decoder_process, scenario, backend, hit,
                                       message, fault, signal_name):
    if scenario == "no decord installed":
        _without_decord(tmp_path, monkeypatch)
    _faulty_worker(tmp_path, monkeypatch, fault, hit)
    vp = TestaVideoProcessor(num_frames=4, video_backend=backend)
    with pytest.raises(VideoDecodingError, match=r"small\.mp4'" + message.format(signal=signal_name)):
        vp(videos["small"])
    assert decoding.decoder_process().process is None  # the crashed helper was reaped; this process goes on
    if scenario == "decord":  # "auto" falls back to PyAV, in a new helper, and still returns the exact frames
        out = TestaVideoProcessor(num_frames=4, video_backend="auto")(videos["small"], return_metadata=True, **RAW)
        assert out["video_metadata"][0].video_backend == "pyav" and _helper_pid() is not None
        assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == uniform(50, 4)
    # once the fault is gone, a new helper process serves the next call with the backend that crashed
    monkeypatch.setattr(decoding, "_WORKER_SCRIPT", worker.__file__)
    decoding.shutdown_decoder_process()
    out = vp(videos["small"], return_metadata=True, **RAW)
    assert out["video_metadata"][0].video_backend == hit[0] and _helper_pid() is not None
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == uniform(50, 4)


@pytest.mark.parametrize("scenario,backend,hit,_", FAULT_SCENARIOS, ids=[s[0] for s in FAULT_SCENARIOS])
def test_decoder_hang_times_out(videos, tmp_path, monkeypatch, fresh_decoder_process, scenario, backend, hit, _):
    if scenario == "no decord installed":
        _without_decord(tmp_path, monkeypatch)
    _faulty_worker(tmp_path, monkeypatch, "__import__('time').sleep(60)", hit)
    start = time.monotonic()
    with pytest.raises(VideoDecodingTimeoutError, match=r"small\.mp4.*no progress for decode_timeout=3 s"):
        TestaVideoProcessor(num_frames=4, video_backend=backend, decode_timeout=3)(videos["small"])
    assert time.monotonic() - start < 20 * len(hit)
    assert decoding.decoder_process().process is None  # the hung helper was killed
    assert isinstance(VideoDecodingTimeoutError("x", "y"), (ValueError, TimeoutError))


def test_a_slow_helper_start_is_not_a_stall(videos, tmp_path, monkeypatch, fresh_decoder_process):
    """The stall limit watches decoding, not the helper's start-up (imports on a loaded machine): a helper that takes
    2 s to start still decodes under a 1-second limit."""
    script = tmp_path / "slow_start" / "video_decoding_worker.py"
    script.parent.mkdir()
    script.write_text("import time\ntime.sleep(2)\n" + Path(decoding._WORKER_SCRIPT).read_text(encoding="utf-8"))
    monkeypatch.setattr(decoding, "_WORKER_SCRIPT", str(script))
    decoding.shutdown_decoder_process()
    pids = set()
    for backend in ("decord", "pyav"):
        out = TestaVideoProcessor(num_frames=4, video_backend=backend, decode_timeout=1)(videos["small"], **RAW)
        assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == uniform(50, 4)
        pids.add(_helper_pid())
    assert len(pids) == 1 and None not in pids  # started once (in 2 s), then reused


def test_a_helper_ends_when_its_caller_is_killed_even_if_the_thread_that_started_it_ended_first(videos, tmp_path):
    """A caller whose helper was started by a thread that has ended keeps its helper (a kernel parent-death signal
    would have killed it with that thread); once the caller is killed (SIGKILL: no clean-up runs), the helper ends by
    itself, even while hung in a decode."""
    import signal
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import os, sys, threading, time
        import modeling_testa.video_decoding as decoding
        from pathlib import Path
        text = Path(decoding._WORKER_SCRIPT).read_text()
        hung = Path({str(tmp_path)!r}) / "hung" / "video_decoding_worker.py"
        hung.parent.mkdir()
        hung.write_text(text.replace({_STREAM_STEP!r}, "__import__('time').sleep(600)\\n        " + {_STREAM_STEP!r}))
        thread = threading.Thread(target=lambda: decoding.decode_video({str(videos["small"])!r}, lambda m: [0]))
        thread.start(); thread.join()  # started the shared helper, decoded, ended
        decoding.decode_video({str(videos["small"])!r}, lambda m: [1])  # the helper is still there
        decoding._WORKER_SCRIPT = str(hung)
        decoding.shutdown_decoder_process()
        threading.Thread(target=decoding.decode_video, args=({str(videos["small"])!r}, lambda m: [2]),
                         kwargs={{"decode_timeout": None}}, daemon=True).start()
        time.sleep(3)
        print(decoding.decoder_process().process.pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(decoding.__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        helper = int(caller.stdout.readline())
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status = Path(f"/proc/{helper}/status").read_text()
            except OSError:
                break  # gone
            if "\nState:\tZ" in status:
                break  # exited, not yet reaped by whoever adopted it
            time.sleep(0.2)
        else:
            os.kill(helper, signal.SIGKILL)
            pytest.fail("the hung helper outlived its killed caller by 60 s")
    finally:
        caller.kill()


def test_helper_that_cannot_start_is_an_exception(videos, tmp_path, monkeypatch, fresh_decoder_process):
    script = tmp_path / "video_decoding_worker.py"
    script.write_text("import sys\nsys.exit('the helper is broken')\n")
    monkeypatch.setattr(decoding, "_WORKER_SCRIPT", str(script))
    for backend in ("decord", "pyav"):
        with pytest.raises(VideoDecodingError, match=rf"small\.mp4' with {backend}: could not start the decoder "
                                                     r"process: .*exit code 1.*decoder log: the helper is broken"):
            decode_video(videos["small"], backend=backend)


def test_no_decord_install_decodes_with_pyav_in_the_helper(videos, tmp_path, monkeypatch, fresh_decoder_process):
    _without_decord(tmp_path, monkeypatch)
    out = TestaVideoProcessor(num_frames=4)(videos["small"], return_metadata=True, **RAW)
    assert out["video_metadata"][0].video_backend == "pyav" and _helper_pid() is not None
    assert [read_index(f.permute(1, 2, 0).numpy()) for f in out["pixel_values"][0]] == uniform(50, 4)
    with pytest.raises(ImportError, match="decord"):
        TestaVideoProcessor(video_backend="decord")(videos["small"])
    # the simulation holds in the helper process too
    with pytest.raises(VideoDecodingError, match=r"small\.mp4.*decoder process cannot import it.*simulated"):
        decoding.decoder_process().decode("decord", str(videos["small"]), lambda metadata: [0], None, 30)


def test_one_helper_process_serves_both_backends_and_survives_decoding_errors(videos, fresh_decoder_process):
    pids = set()
    for backend in ("pyav", "decord", "auto", "pyav"):
        for name in ("small", "long", "truncated", "text"):
            try:
                decode_video(videos[name], lambda metadata: [0, 1], backend=backend)
            except VideoDecodingError as exc:
                assert name in ("truncated", "text") and exc.source == str(videos[name])
            pids.add(_helper_pid())
    assert len(pids) == 1 and None not in pids  # started once, reused for every video, file error and backend


def test_exported_folder_decodes_in_its_own_helper_without_the_package(videos, tmp_path):
    """The helper is exported with the remote code and runs from there: a fresh interpreter outside the repo, where
    `modeling_testa` cannot be imported, decodes with both backends in the helper, and a helper crash is an
    exception there too."""
    import subprocess
    import textwrap

    folder = tmp_path / "exported"
    TestaVideoProcessor(num_frames=4).save_pretrained(folder)
    assert (folder / "video_decoding_worker.py").read_text() == Path(worker.__file__).read_text()
    script = textwrap.dedent(f"""
        import os, sys
        sys.modules["modeling_testa"] = None
        try:
            import modeling_testa
            raise SystemExit("modeling_testa must not be importable here")
        except ImportError:
            pass
        from transformers import AutoVideoProcessor
        vp = AutoVideoProcessor.from_pretrained({str(folder)!r}, trust_remote_code=True)
        module = sys.modules[type(vp).__module__]
        assert module.__name__.startswith("transformers_modules"), module.__name__
        module = sys.modules[module.__name__.rsplit(".", 1)[0] + ".video_decoding"]  # the exported decoding module
        assert module._WORKER_SCRIPT.startswith(os.environ["HF_MODULES_CACHE"]), module._WORKER_SCRIPT
        for backend in ("decord", "pyav"):
            out = vp({str(videos["small"])!r}, video_backend=backend, return_metadata=True)
            assert out["video_metadata"][0].video_backend == backend
            assert out["pixel_values"].shape == (1, 4, 3, 224, 224)
            process = module.decoder_process().process
            assert process is not None and process.poll() is None
            print("HELPER", backend, process.pid, process.args[-1])
        text = open(module._WORKER_SCRIPT).read()
        faulty = os.path.join({str(tmp_path)!r}, "faulty.py")
        open(faulty, "w").write(text.replace({_STREAM_STEP!r}, "__import__('os').abort()\\n        " + {_STREAM_STEP!r}))
        module._WORKER_SCRIPT = faulty
        module.shutdown_decoder_process()
        try:
            vp({str(videos["small"])!r}, video_backend="pyav")
        except module.VideoDecodingError as exc:
            print("CAUGHT", exc)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    helpers = [line.split() for line in result.stdout.splitlines() if line.startswith("HELPER")]
    assert [h[1] for h in helpers] == ["decord", "pyav"] and helpers[0][2] == helpers[1][2]  # one helper, reused
    assert helpers[0][3].startswith(str(tmp_path / "modules")) and helpers[0][3].endswith("video_decoding_worker.py")
    assert "CAUGHT Could not decode video" in result.stdout and "pyav decoder crashed (SIGABRT)" in result.stdout


@pytest.fixture(scope="module")
def corrupt_videos(videos, tmp_path_factory):
    """Real mp4s with damaged bytes: the frame data replaced by noise, and a hole punched into the index (moov)."""
    d = tmp_path_factory.mktemp("corrupt")
    data = videos["small"].read_bytes()
    rng = np.random.default_rng(0)
    out = {"truncated": videos["truncated"]}
    names = {b"mdat": "noise_frames", b"moov": "broken_index"}
    for kind, offset, size in mp4_boxes(videos["small"]):
        if kind not in names:
            continue
        damaged = bytearray(data)
        if kind == b"mdat":
            damaged[offset + 8 : offset + size] = rng.integers(0, 256, size - 8, dtype=np.uint8).tobytes()
        else:
            middle = offset + size // 2
            damaged[middle : middle + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
        out[names[kind]] = d / f"{names[kind]}.mp4"
        out[names[kind]].write_bytes(bytes(damaged))
    assert len(out) == 3
    return out


@pytest.mark.parametrize("isolate", [True, False])
@pytest.mark.parametrize("backend", ["decord", "pyav"])
@pytest.mark.parametrize("name", ["truncated", "noise_frames", "broken_index"])
def test_corrupt_real_files_raise_an_error_naming_the_file(corrupt_videos, backend, isolate, name):
    path = corrupt_videos[name]
    with pytest.raises(VideoDecodingError) as info:
        decode_video(path, lambda metadata: [0, 1, 2], backend=backend, isolate_decoder=isolate, decode_timeout=60)
    error = info.value
    assert error.source == str(path) and error.backend == backend
    assert str(error).startswith(f"Could not decode video {str(path)!r} with {backend}: ")
    assert "crashed" not in error.reason and "exited" not in error.reason and len(error.reason) > 10


# ----------------------------------------------------------------------------------------------------------------------
# relative paths and the shared helper; the decoder table
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_a_relative_path_is_read_from_the_callers_directory_not_the_helpers(tmp_path, monkeypatch,
                                                                           fresh_decoder_process, backend):
    """The shared helper keeps the working directory it started in; after the caller moves, ``clip.mp4`` is the
    caller's file (12 frames), not the one beside the helper (5 frames)."""
    from helpers.videos import write_video

    started_in, moved_to = tmp_path / "started_in", tmp_path / "moved_to"
    started_in.mkdir(), moved_to.mkdir()
    write_video(started_in / "clip.mp4", 5)
    write_video(moved_to / "clip.mp4", 12)
    monkeypatch.chdir(started_in)
    assert decode_video("clip.mp4", backend=backend)[1].total_num_frames == 5  # starts the shared helper here
    helper = decoding.decoder_process()
    pid = helper.process.pid
    monkeypatch.chdir(moved_to)
    frames, metadata = decode_video("clip.mp4", backend=backend)
    assert decoding.decoder_process().process.pid == pid  # the same helper, still in started_in
    assert metadata.total_num_frames == 12
    assert [read_index(frame) for frame in frames] == list(range(12))


def test_decoder_names_and_capabilities_come_from_one_table():
    """`video_decoding_worker.DECODERS` drives the allowed values, the "auto" orders, the install messages and the
    reader dispatch; the messages still name the allowed values."""
    from testa_search.moments import STREAM_BACKENDS

    names = tuple(worker.DECODERS)
    assert decoding.VIDEO_BACKENDS == ("auto", *names) and set(names) == {"decord", "pyav"}
    assert STREAM_BACKENDS == decoding.STREAM_ORDER == ("pyav", "decord")  # the decoder that streams first
    assert [worker.DECODERS[name].streams for name in STREAM_BACKENDS] == [True, False]
    with pytest.raises(ValueError, match=r"Unknown video_backend='ffmpeg'; use one of \('auto', 'decord', 'pyav'\)"):
        decoding.backends_to_try("ffmpeg")
    with pytest.raises(ValueError, match=r"Unknown video backend 'ffmpeg'; use one of \('decord', 'pyav'\)"):
        worker.open_reader("ffmpeg", "clip.mp4", None)
    for name, decoder in worker.DECODERS.items():
        assert decoder.reader.backend == name


def test_the_decoder_table_dispatches_readers(videos):
    """`open_reader` opens each decoder's own reader class, which reads the same frames."""
    for name, decoder in worker.DECODERS.items():
        reader = worker.open_reader(name, str(videos["short"]), None)
        assert type(reader) is decoder.reader
        assert [read_index(frame) for _, frame in reader.frames([0, 4])] == [0, 4]


def test_no_decoder_names_are_compared_as_strings_outside_the_table():
    """Decoder names are not compared or listed as literals in the code that decodes (the four places that did:
    `backends_to_try`, `open_reader`, `moments.STREAM_BACKENDS`, the "no frames" message)."""
    import re

    repo = Path(__file__).resolve().parents[1]
    files = [*(repo / "modeling_testa").glob("video_decoding*.py"), repo / "testa_search" / "moments.py"]
    literal = r"""["'](?:decord|pyav)["']"""
    pattern = re.compile(rf"(?:==|!=|\bin)\s*{literal}|{literal}\s*(?:==|!=)|[(\[,]\s*{literal}\s*,\s*{literal}")
    found = [f"{path.name}:{number}: {line.strip()}" for path in files
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line) and not line.lstrip().startswith("Decoder(")]
    assert not found, found


def test_a_missing_decoder_is_named_with_its_install_command(tmp_path, monkeypatch, fresh_decoder_process):
    _without_decord(tmp_path, monkeypatch)
    with pytest.raises(ImportError, match=r"^video_backend='decord' needs decord: `pip install decord`\.$"):
        decoding.check_backend_installed("decord")
    assert decoding.backends_to_try("auto") == ["pyav"]
    assert decoding.backends_to_try("auto", decoding.STREAM_ORDER) == ["pyav"]
