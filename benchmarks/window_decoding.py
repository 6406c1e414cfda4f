"""Decode time per window of a long video: decoded once for all windows (`decode_windows`) against decoding it window by
window, and against decoding whole clips of the window's length.

A long video and a clip as long as one window are generated with PyAV (`benchmarks.decode_speed.make_video`, the
`shapes` content, libx264 CRF 23 veryfast, default GOP and B-frames), 320x180 at 25 fps. For each decoder (decord and
PyAV, in the crash-isolation helper process as by default), three ways of getting `--num-frames` frames per window:

* `one pass`: `decode_windows(path, window, stride)`: one open and one pass over the video for every window;
* `window by window`: `decode_video` once per window with that window's frames (re-open, seek or decode forward to it);
* `whole clips`: `decode_video` of the separate clip file, `--num-frames` uniform frames (what indexing short clips
  costs per clip).

The process is pinned to one core, the decoders use one thread; the first run of each configuration is a warm-up; the
table gives the median of `--runs` timed runs, in milliseconds per window (per clip), and the ratio to one pass.

    python -m benchmarks.window_decoding                       # 10 minutes, 30 s windows every 30 s, 3 runs
    python -m benchmarks.window_decoding --minutes 60 --runs 1
"""

import argparse
import os
import statistics
import tempfile
import time

from benchmarks.decode_speed import make_video
from testa_search.moments import decode_windows, plan_windows, window_frame_indices
from modeling_testa.video_decoding import decode_video, decoder_available, sample_frame_indices


def timed(fn, runs: int) -> float:
    """Median seconds of `runs` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--stride", type=float, default=30.0)
    parser.add_argument("--num-frames", type=int, default=8)
    parser.add_argument("--fps", type=int, default=25)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    seconds = int(args.minutes * 60)
    windows = plan_windows(seconds, args.window, args.stride)
    options = dict(num_threads=1, decode_timeout=None)
    backends = (["decord"] if decoder_available("decord") else []) + ["pyav"]
    with tempfile.TemporaryDirectory() as tmp:
        long_path, clip_path = os.path.join(tmp, "long.mp4"), os.path.join(tmp, "clip.mp4")
        begin = time.perf_counter()
        make_video(long_path, seconds, args.fps, content="shapes", width=320, height=180)
        make_video(clip_path, int(args.window), args.fps, content="shapes", width=320, height=180)
        print(f"generated {seconds} s and {int(args.window)} s videos (320x180, {args.fps} fps) in "
              f"{time.perf_counter() - begin:.0f} s; {len(windows)} windows of {args.window:g} s every "
              f"{args.stride:g} s, {args.num_frames} frames each; median of {args.runs} runs, one core\n")

        def one_pass(backend):
            return lambda: decode_windows(long_path, args.window, args.stride, args.num_frames, backend=backend,
                                          **options)

        def window_by_window(backend):
            def run():
                for start, end in windows:
                    decode_video(long_path, lambda m, s=start, e=end: window_frame_indices(
                        s, e, m.fps, m.total_num_frames, args.num_frames), backend=backend, **options)
            return run

        def whole_clip(backend):
            return lambda: decode_video(clip_path, lambda m: sample_frame_indices(m.total_num_frames, args.num_frames),
                                        backend=backend, **options)

        rows = []
        for backend in backends:
            once = timed(one_pass(backend), args.runs) / len(windows)
            each = timed(window_by_window(backend), args.runs) / len(windows)
            clip = timed(whole_clip(backend), args.runs)
            rows.append((backend, once, each, clip))

    print("| decoder | one pass, ms/window | window by window, ms/window | whole clips, ms/clip | "
          "window by window / one pass | clip / one pass |")
    print("|---|---:|---:|---:|---:|---:|")
    for backend, once, each, clip in rows:
        print(f"| {backend} | {1000 * once:.1f} | {1000 * each:.1f} | {1000 * clip:.1f} | {each / once:.1f}x | "
              f"{clip / once:.1f}x |")
    hour_windows = len(plan_windows(3600, args.window, args.stride))
    for backend, once, _, _ in rows:
        print(f"{backend}: an hour in {hour_windows} windows at this rate: {once * hour_windows:.1f} s of decoding")


if __name__ == "__main__":
    main()
