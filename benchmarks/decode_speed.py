"""Decode + preprocess speed of `TestaVideoProcessor`: 32 frames from a 60-second 224p video, on one CPU core.

The video is generated with PyAV (libx264, CRF 23, preset veryfast, default GOP and B-frames) into a temporary
directory, 400x224 at 30 fps (1800 frames), with two kinds of content, because H.264 decoding time depends on it:

* `shapes`: moving coloured shapes on a smooth, slowly drifting gradient (cheap to decode, ~0.2 MB/min);
* `noise`: the same shapes on a scrolling random-noise background (a hard case, ~3.6 MB/min, i.e. ~480 kbit/s, the
  bitrate of a typical 240p web video).

Each backend is timed end to end, from the file path to the normalised `pixel_values` tensor `(1, 32, 3, 224, 224)`,
with uniform sampling over the whole video. The process (and with it the helper process) is pinned to one core
(`os.sched_setaffinity` where available), torch uses one thread and the decoders one thread each.
Both backends run in the crash-isolation helper process by default (one helper, reused across videos and backends);
each is also timed in process (`isolate_decoder=False`) to show what the isolation costs. The first call of each
configuration (imports, decoder helper start-up) is a warm-up and not counted; the table gives the median of the timed
runs.

    python -m benchmarks.decode_speed            # 7 timed runs per backend
    python -m benchmarks.decode_speed --runs 11 --content noise
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from modeling_testa.video_decoding import decoder_available
from modeling_testa.video_processing_testa import TestaVideoProcessor


def make_video(path: str, seconds: int, fps: int, content: str = "noise", width: int = 400, height: int = 224) -> int:
    """Writes an H.264 mp4 of moving coloured shapes (`content`: "shapes" or "noise" background); returns #frames."""
    import av

    if content == "noise":
        rng = np.random.default_rng(0)
        background = rng.integers(40, 200, size=(height, width, 3), dtype=np.uint8)
    else:
        yy, xx = np.mgrid[0:height, 0:width]
        background = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 127 // (width + height)], -1)
        background = background.astype(np.uint8)
    n = seconds * fps
    with av.open(path, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        # One encoder thread: x264's output depends on its thread count (auto = the cores this process may use), and
        # so does the decoding cost of the file; fixed, the file is the same pinned or not, on any machine.
        stream.codec_context.thread_count = 1
        for i in range(n):
            frame = np.roll(background, i, axis=1).copy()
            x = (5 * i) % (width - 60)
            y = (3 * i) % (height - 60)
            frame[y : y + 60, x : x + 60] = (230, 40, 40)
            frame[height - 60 - y // 2 : height - y // 2, width - 60 - x // 2 : width - x // 2] = (40, 200, 60)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per backend (median reported), default 7")
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--num-frames", type=int, default=32)
    parser.add_argument("--content", choices=["shapes", "noise", "both"], default="both")
    args = parser.parse_args()

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"

    configurations = []
    if decoder_available("decord"):
        configurations.append(("decord (helper process, default)", {"video_backend": "decord"}))
        configurations.append(("decord (in process)", {"video_backend": "decord", "isolate_decoder": False}))
    configurations.append(("PyAV (helper process, default)", {"video_backend": "pyav"}))
    configurations.append(("PyAV (in process)", {"video_backend": "pyav", "isolate_decoder": False}))

    contents = ["shapes", "noise"] if args.content == "both" else [args.content]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for content in contents:
            path = os.path.join(tmp, f"video_{args.seconds}s_224p_{content}.mp4")
            t0 = time.perf_counter()
            total = make_video(path, args.seconds, args.fps, content)
            print(f"generated {content!r} video: {total} frames, 400x224, {args.fps} fps, "
                  f"{os.path.getsize(path) / 1e6:.2f} MB, in {time.perf_counter() - t0:.1f} s")

            processor = TestaVideoProcessor(num_frames=args.num_frames, decode_threads=1)
            for name, settings in configurations:
                processor(path, **settings)  # warm-up
                times = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    out = processor(path, return_metadata=True, **settings)
                    times.append(time.perf_counter() - start)
                shape = tuple(out["pixel_values"].shape)
                indices = out["video_metadata"][0].frames_indices
                assert shape == (1, args.num_frames, 3, 224, 224), shape
                assert indices[-1] >= total - total // args.num_frames, "uniform sampling must reach the tail"
                rows.append((content, name, statistics.median(times), min(times), max(times), shape))

    print(f"\ncores used: {cores}, torch threads: {torch.get_num_threads()}, decoder threads: 1, "
          f"runs per row: {args.runs} (+1 warm-up)\n")
    print("| content | backend | median (s) | min (s) | max (s) | output | < 0.25 s |")
    print("|---|---|---|---|---|---|---|")
    for content, name, median, low, high, shape in rows:
        ok = "yes" if median < 0.25 else "no"
        print(f"| {content} | {name} | {median:.3f} | {low:.3f} | {high:.3f} | {shape} | {ok} |")


if __name__ == "__main__":
    main()
