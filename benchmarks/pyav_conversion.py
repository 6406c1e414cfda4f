"""PyAV decoding with one reused RGB converter against a new conversion per frame, alternating in one run.

    python -m benchmarks.pyav_conversion [--rounds 5] [--short-event-videos 24]

`modeling_testa.video_decoding_worker` converts decoded frames to RGB through one `VideoReformatter` per decode call
(`RGBConverter`); before, every frame went through ``frame.to_ndarray(format="rgb24")``, which sets up a new
conversion each time. This times `PyAVReader.frames` (the decode path the processor uses for PyAV: skipping unneeded
non-reference frames, seeking to a distant frame's keyframe) both ways, on the same files, alternating the two in
every round, one thread, and checks that the pixels are identical:

* the demo's videos (`processing.short_events`: 64 px, 96-144 frames, a keyframe a second), 8 and 16 frames each;
* the 60-second 400x224 videos of `decode_speed.py` (shapes and noise backgrounds, 1800 frames), 32 frames each.

It prints the median milliseconds per video of each way and their ratio. The ratio is large where little decoding
is done per frame kept (small, keyframe-dense videos) and near 1 where H.264 decoding dominates.
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch

import modeling_testa.video_decoding_worker as worker


class PerFrameConversion:
    """The previous behaviour: a new conversion for every frame."""

    def __init__(self, av) -> None:
        pass

    def __call__(self, frame):
        return frame.to_ndarray(format="rgb24")


WAYS = {"new conversion per frame (before)": PerFrameConversion, "one reused converter (now)": worker.RGBConverter}


def uniform(total: int, samples: int) -> list[int]:
    return sorted({int(i) for i in np.linspace(0, total - 1, samples)})


def decode_all(jobs, converter_class) -> list[dict]:
    worker.RGBConverter = converter_class
    return [dict(reader.frames(wanted)) for reader, wanted in jobs]


def compare(name: str, jobs, rounds: int) -> None:
    original = worker.RGBConverter
    try:
        outputs = {way: decode_all(jobs, cls) for way, cls in WAYS.items()}  # warm-up, and the pixel check
        first, second = outputs.values()
        if any(len(a) != len(wanted) or len(b) != len(wanted) for a, b, (_, wanted) in zip(first, second, jobs)):
            raise RuntimeError(f"{name}: the reader could not produce every frame")
        identical = all(np.array_equal(a[i], b[i]) for a, b in zip(first, second) for i in a)
        times = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way, cls in WAYS.items():
                start = time.perf_counter()
                decode_all(jobs, cls)
                times[way].append(1e3 * (time.perf_counter() - start) / len(jobs))
    finally:
        worker.RGBConverter = original
    before, now = (statistics.median(t) for t in times.values())
    print(f"| {name} | {len(jobs)} | {before:.2f} | {now:.2f} | {before / now:.2f}x | {'yes' if identical else 'NO'} |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--short-event-videos", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from benchmarks.decode_speed import make_video

    from processing.short_events import encode_video, make_videos

    with tempfile.TemporaryDirectory(prefix="testa-pyav-conversion-") as tmp:
        short = []
        for video in make_videos(num_videos=args.short_event_videos, seed=0):
            path = os.path.join(tmp, f"{video.video_id}.mp4")
            encode_video(video, path)
            short.append(worker.PyAVReader(path, 1))
        long = []
        for content in ("shapes", "noise"):
            path = os.path.join(tmp, f"{content}.mp4")
            make_video(path, 60, 30, content)
            long.append((content, worker.PyAVReader(path, 1)))
        print(f"{args.rounds} alternating rounds, one thread; median ms per video\n")
        print("| videos | count | new conversion per frame (ms) | one reused converter (ms) | speed-up | same pixels |")
        print("|---|---|---|---|---|---|")
        for frames in (8, 16):
            jobs = [(reader, uniform(reader.metadata["total_num_frames"], frames)) for reader in short]
            compare(f"short-event demo videos (64 px, 96-144 frames), {frames} frames each", jobs, args.rounds)
        for content, reader in long:
            compare(f"decode_speed.py {content} video (400x224, 1800 frames), 32 frames",
                    [(reader, uniform(reader.metadata["total_num_frames"], 32))], args.rounds)


if __name__ == "__main__":
    main()
