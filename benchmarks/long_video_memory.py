"""Long videos in bounded memory: the peak memory of the whole process tree, wall time, the share of it spent decoding
and the decoder's own plain decode beside the library's, on generated hour-long videos.

    python -m benchmarks.long_video_memory --model outputs/demo/runs/b/final
    python -m benchmarks.long_video_memory --model M --videos 360p,720p --backends pyav,decord --json out.json

Videos, generated once into ``--cache-dir`` (default ``~/.cache/testa/long_videos``, outside the repository): a
60-second low-motion pattern (a gradient, a moving square, a sweeping line) encoded with libx264 (veryfast, CRF 23, a
keyframe every 250 frames, 3 B-frames) at 30 fps, repeated by remuxing into

* ``360p``: 1 hour at 640x360; ``720p``: 30 minutes at 1280x720; ``1080p``: 2 hours at 1920x1080;
* ``720p-2.5min`` and ``720p-10min``, for the check that memory does not grow with the length.

Low motion decodes faster than camera footage; the frame rate, GOP and B-frames are a camera's.

Every measurement runs in a fresh process (so every peak is its own; `benchmarks.process_memory` samples the tree:
the process and its decoder helper or engine worker), windows of 20 s every 10 s:

* ``plain:BACKEND``: the decoder's own plain sequential decode of every frame, default threads (as the library's
  helper uses): PyAV ``for frame in container.decode(stream)``; decord ``VideoReader.next()`` to the end. It and the
  next two are run in ``--rounds`` alternating rounds (medians reported), and timed by wall clock and by the CPU
  seconds of the process tree, which a shared machine disturbs less;
* ``frames:seek`` / ``frames:skip``: PyAV reading the windows' frames (the union) in this process, with seeking to
  the keyframe before a distant frame and without (skipping unneeded non-reference frames only): which is faster;
  ``sparse:seek`` / ``sparse:skip`` the same for the model's frames of the whole video as one clip (a sparse read);
* ``stream:BACKEND``: the library's decoding for an index (`moments.WindowStream` in the decoder helper, each frame
  resized to the model's input size as it arrives), without the encoder; its speed beside the plain decode's;
* ``index``: ``encode_videos(window=20, stride=10)`` with the model (PyTorch, decoder helper process): the peak, the
  wall time and the share of it the encoder waited for decoding;
* ``moment:BACKEND``: `moments.moment_frames` for a strip of 6 frames at 50:00-50:20 (what the app shows for a
  moment), twice: the first call starts the decoder helper;
* ``index:fast``: the same with the fastest encoder runtime on this CPU (OpenVINO int8, docs/inference.md), for the
  time to index an hour of video;
* ``train.index:N``: ``python -m train.index --window 20 --stride 10`` on two copies of the video with
  ``--num-workers 0`` and ``2`` (two videos streamed at once): the peak per decode worker.

The model: ``--model`` (e.g. the demo's model (b), 16 frames of 64 px). Its video processor's decoder settings
apply, except that the index runs decode in the helper process (the library's default); `train.index` takes the
folder's settings as they are.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


VIDEOS = {  # name: (width, height, seconds)
    "360p": (640, 360, 3600),
    "720p": (1280, 720, 1800),
    "1080p": (1920, 1080, 7200),
    "720p-2.5min": (1280, 720, 150),
    "720p-10min": (1280, 720, 600),
}
FPS, SEGMENT_SECONDS = 30, 60
WINDOW, STRIDE = 20.0, 10.0
GIB, MIB = 1 << 30, 1 << 20


# ----------------------------------------------------------------------------------------------------------- videos


def write_segment(path: Path, width: int, height: int) -> None:
    """`SEGMENT_SECONDS` of the low-motion pattern at `FPS`."""
    import av

    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, np.full_like(xx, 90)], -1).astype(np.uint8)
    side = height // 6
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "23", "g": "250", "bf": "3"}
        for i in range(SEGMENT_SECONDS * FPS):
            image = base.copy()
            x, y = (4 * i) % (width - side), (3 * i) % (height - side)
            image[y:y + side, x:x + side] = (230, 30, 30)
            image[:, (2 * i) % width] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def repeat_segment(segment: Path, path: Path, repeats: int) -> None:
    """The segment `repeats` times in a row, remuxed (no re-encoding), timestamps shifted."""
    import av

    with av.open(str(segment)) as source:
        stream = source.streams.video[0]
        packets = [(p.pts, p.dts, p.duration, bytes(p), p.is_keyframe) for p in source.demux(stream) if p.size]
        span = max(p[0] for p in packets) + packets[0][2] - min(p[0] for p in packets)
        temporary = path.with_suffix(".partial.mp4")
        with av.open(str(temporary), "w") as out:
            target = out.add_stream_from_template(stream)
            for k in range(repeats):
                for pts, dts, duration, data, keyframe in packets:
                    packet = av.Packet(data)
                    packet.pts, packet.dts, packet.duration = pts + k * span, dts + k * span, duration
                    packet.is_keyframe, packet.time_base, packet.stream = keyframe, stream.time_base, target
                    out.mux(packet)
    temporary.replace(path)


def video_path(cache: Path, name: str) -> Path:
    """The generated video `name` (made on first use)."""
    width, height, seconds = VIDEOS[name]
    path = cache / f"pattern_{width}x{height}_{FPS}fps_{seconds}s.mp4"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        segment = cache / f"pattern_{width}x{height}_{FPS}fps_segment.mp4"
        if not segment.exists():
            print(f"generating a {SEGMENT_SECONDS} s {width}x{height} segment ...", flush=True)
            write_segment(segment.with_suffix(".partial.mp4"), width, height)
            segment.with_suffix(".partial.mp4").replace(segment)
        print(f"writing {path.name} ...", flush=True)
        repeat_segment(segment, path, seconds // SEGMENT_SECONDS)
    return path


# ---------------------------------------------------------------------------------------------- one measurement


def load_pipeline(args, fast: bool = False):
    import torch

    from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor, VideoTextRetrievalPipeline
    from testa_runtimes import optimize_for_inference

    model = TestaForVideoTextRetrieval.from_pretrained(args.model).eval()
    processor = TestaProcessor.from_pretrained(args.model)
    processor.video_processor.isolate_decoder = True  # the library's default: decoders in their helper process
    if fast:
        model = optimize_for_inference(model, "int8", backend="openvino", cache_dir=args.engine_cache)
    torch.set_num_threads(os.cpu_count() or 1)
    return VideoTextRetrievalPipeline(model=model, processor=processor, device="cpu")


def plain_decode(path: Path, backend: str) -> dict:
    """Every frame, as the decoder itself decodes them in order."""
    if backend == "pyav":
        import av

        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            frames = sum(1 for _ in container.decode(stream))
        return {"frames": frames}
    import decord

    reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=0)
    frames = 0
    for _ in range(len(reader)):
        reader.next()
        frames += 1
    return {"frames": frames}


def window_frames(path: Path, num_frames: int) -> list[int]:
    """The union of every window's frames (what the index decodes)."""
    from testa_search.moments import data_end, frames_in_window, plan_windows, probe_duration
    from modeling_testa.video_decoding_worker import PyAVReader

    times = PyAVReader(str(path), None).metadata["frame_times"]
    duration = data_end(np.asarray(times))
    wanted = set()
    for start, end in plan_windows(probe_duration(path), WINDOW, STRIDE):
        wanted.update(frames_in_window(times, start, end, num_frames, duration).tolist())
    return sorted(wanted)


def measure(kind: str, path: Path, args) -> dict:
    """One measurement (see the module docstring), in this process."""
    from benchmarks.process_memory import TreeMemory, high_water, tree_cpu_seconds

    result: dict = {"kind": kind, "video": path.name}
    setup = time.perf_counter()
    pipe = None
    if kind.startswith(("stream", "index", "frames", "sparse")):
        pipe = load_pipeline(args, fast=kind == "index:fast")
        if kind == "index:fast":  # export and compile before the clock starts (cached on disk after the first run)
            pipe.encode_videos([str(video_path(Path(args.cache_dir), "720p-2.5min"))], window=WINDOW, stride=STRIDE,
                               progress_bar=False)
    result["setup_seconds"] = time.perf_counter() - setup
    with TreeMemory(interval=0.05) as memory:
        begin, cpu = time.perf_counter(), tree_cpu_seconds()
        if kind.startswith("plain:"):
            result.update(plain_decode(path, kind.split(":")[1]))
        elif kind.startswith(("frames:", "sparse:")):
            from modeling_testa.video_decoding import sample_frame_indices
            from modeling_testa.video_decoding_worker import PyAVReader

            num_frames = pipe.video_processor.num_frames
            if kind.startswith("frames:"):
                wanted = window_frames(path, num_frames)
            else:  # the whole video as one clip: the processor's uniform sampling
                total = PyAVReader(str(path), None).metadata["total_num_frames"]
                wanted = sorted(set(sample_frame_indices(total, num_frames).tolist()))
            begin, cpu = time.perf_counter(), tree_cpu_seconds()
            reader = PyAVReader(str(path), None, seek=kind.endswith(":seek"))
            result["frames"] = sum(1 for _ in reader.frames(wanted))
            result["seeks"] = reader.seeks
        elif kind.startswith("moment:"):  # a strip of 6 frames at 50:00-50:20, as the app shows a moment
            from testa_search.moments import moment_frames

            backend = kind.split(":")[1]
            for call in ("first_call", "second_call"):  # the first one starts the decoder helper
                started = time.perf_counter()
                moment_frames(path, 3000.0, 3020.0, num_frames=6, backend=backend)
                result[f"{call}_seconds"] = time.perf_counter() - started
        elif kind.startswith("stream:"):
            from testa_search.moments import (
                WindowStream,
                plan_windows,
                processor_frame_steps,
                processor_stream_options,
            )

            processor = pipe.video_processor
            prepare, finish = processor_frame_steps(processor)
            options = {**processor_stream_options(processor), "backend": kind.split(":")[1]}
            stream = WindowStream(path, lambda duration: plan_windows(duration, WINDOW, STRIDE), processor.num_frames,
                                  prepare, finish, **options)
            result["windows"] = result["failed"] = 0
            for clip in stream:  # each window dropped once counted (an index hands it to the encoder)
                result["windows"] += 1
                result["failed"] += clip.error is not None
        elif kind.startswith("index"):
            index = pipe.encode_videos([str(path)], window=WINDOW, stride=STRIDE, batch_size=8, progress_bar=False)
            result.update(index.stats, rows=len(index), failed=len(index.failures))
        elif kind.startswith("train.index:"):
            from testa_search.cli.index import main as index_main

            copy = path.with_name(path.stem + ".copy.mp4")
            if not copy.exists():
                os.link(path, copy)
            listing = Path(args.scratch) / "videos.txt"
            listing.write_text(f"{path}\n{copy}\n")
            store = Path(args.scratch) / f"store-{kind.split(':')[1]}"
            index_main(["--model", args.model, "--videos", str(listing), "--store", str(store), "--window",
                        str(WINDOW), "--stride", str(STRIDE), "--num-workers", kind.split(":")[1], "--batch-size",
                        "8"])
        result["seconds"], result["cpu_seconds"] = time.perf_counter() - begin, tree_cpu_seconds() - cpu
    result.update(start=memory.start, peak=memory.peak, high_water=high_water(), processes=memory.process_peaks)
    return result


def run_child(kind: str, name: str, args) -> dict:
    """`measure` in a fresh process; its JSON result."""
    command = [sys.executable, "-m", "benchmarks.long_video_memory", "--measure", kind, "--video", name,
               "--cache-dir", args.cache_dir, "--scratch", args.scratch, "--engine-cache", args.engine_cache,
               "--model", args.model]
    print(f"  {name} {kind} ...", flush=True)
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        raise RuntimeError(f"{kind} on {name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------- report


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.machine()


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def median_of(results: list[dict], name: str, kind: str) -> dict | None:
    """The run of `kind` on `name` with the median wall time (of the rounds)."""
    runs = sorted((r for r in results if r["video_name"] == name and r["kind"] == kind), key=lambda r: r["seconds"])
    return runs[len(runs) // 2] if runs else None


def report(results: list[dict], backends: list[str]) -> None:
    by = {(r["video_name"], r["kind"]): median_of(results, r["video_name"], r["kind"]) for r in results}
    names = list(dict.fromkeys(r["video_name"] for r in results))
    rounds = max(sum(r["kind"] == "plain:pyav" and r["video_name"] == name for r in results) for name in names)
    print(f"\n### Decoding: the library's against the decoder's own plain decode (same file, same threads; median of "
          f"{rounds} alternating rounds)\n")
    print("| video | decoder | plain decode, s (fps) | library decode for the index, s | library vs plain (wall) | "
          "library vs plain (CPU) | peak of the library's decode (tree), GiB | its decoder process, MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for backend in backends:
            plain, stream = by.get((name, f"plain:{backend}")), by.get((name, f"stream:{backend}"))
            if not plain or not stream:
                continue
            helper = max([peak for label, peak in stream["processes"].values() if label != "main"], default=0)
            print(f"| {name} | {backend} | {plain['seconds']:.0f} ({plain['frames'] / plain['seconds']:.0f}) | "
                  f"{stream['seconds']:.0f} | {plain['seconds'] / stream['seconds']:.2f}x | "
                  f"{plain['cpu_seconds'] / stream['cpu_seconds']:.2f}x | {gib(stream['peak'])} | "
                  f"{helper / MIB:.0f} |")
    rows = [(name, what, by[(name, f"{kind}:skip")], by[(name, f"{kind}:seek")]) for name in names
            for kind, what in (("frames", "the windows' frames"), ("sparse", "one clip of the whole video"))
            if (name, f"{kind}:skip") in by and (name, f"{kind}:seek") in by]
    if rows:
        print("\n### PyAV: skipping unneeded non-reference frames only, and with seeking to a distant frame's "
              "keyframe\n")
        print("| video | frames read | skipping only, s | skipping + seeking, s (seeks) | speed-up (wall) | "
              "speed-up (CPU) |")
        print("|---|---|---:|---:|---:|---:|")
        for name, what, skip, seek in rows:
            print(f"| {name}: {what} | {skip['frames']} | {skip['seconds']:.1f} | {seek['seconds']:.1f} "
                  f"({seek['seeks']}) | {skip['seconds'] / seek['seconds']:.2f}x | "
                  f"{skip['cpu_seconds'] / seek['cpu_seconds']:.2f}x |")
    print(f"\n### Indexing (windows of {WINDOW:g} s every {STRIDE:g} s)\n")
    print("| video | runtime | windows | wall, s | s per hour of video | waiting for decoding | encoder, s | "
          "CPU, s | tree at start, GiB | tree peak, GiB | sum of process peaks, GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for kind, runtime in (("index", "PyTorch fp32"), ("index:fast", "OpenVINO int8")):
            r = by.get((name, kind))
            if not r:
                continue
            hours = VIDEOS[name][2] / 3600
            print(f"| {name} | {runtime} | {r['rows']} | {r['seconds']:.0f} | {r['seconds'] / hours:.0f} | "
                  f"{100 * r['decode_wait_seconds'] / r['seconds']:.0f}% | {r['encode_seconds']:.0f} | "
                  f"{r['cpu_seconds']:.0f} | {gib(r['start'])} | {gib(r['peak'])} | {gib(r['high_water'])} |")
    for name in names:
        for backend in backends:
            r = by.get((name, f"moment:{backend}"))
            if r:
                print(f"\nA strip of 6 frames at 50:00-50:20 of {name} (`moment_frames`, {backend}): "
                      f"{r['first_call_seconds']:.2f} s in a fresh process (decoder helper started), "
                      f"{r['second_call_seconds']:.2f} s the next time.")
    short, ten = by.get(("720p-2.5min", "index")), by.get(("720p-10min", "index"))
    if short and ten:
        print(f"\nGrowth: 10 min of 720p peaked at {gib(ten['peak'])} GiB, 2.5 min at {gib(short['peak'])} GiB: "
              f"{(ten['peak'] - short['peak']) / MIB:+.0f} MiB.")
    for name in names:
        zero, two = by.get((name, "train.index:0")), by.get((name, "train.index:2"))
        if zero and two:
            print(f"\ntrain.index --window on two copies of {name}: tree peak {gib(zero['peak'])} GiB with 0 decode "
                  f"workers, {gib(two['peak'])} GiB with 2 ({(two['peak'] - zero['peak']) / 2 / MIB:.0f} MiB more per "
                  f"worker); wall {zero['seconds']:.0f} s and {two['seconds']:.0f} s.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a retrieval model folder (e.g. outputs/demo/runs/b/final)")
    parser.add_argument("--videos", default="360p,720p,1080p,720p-2.5min,720p-10min")
    parser.add_argument("--backends", default="pyav,decord")
    parser.add_argument("--skip", default="", help="measurements to leave out, e.g. plain:decord,train.index")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the decoding comparisons")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "testa" / "long_videos"))
    parser.add_argument("--engine-cache", default=str(Path.home() / ".cache" / "testa" / "engines"))
    parser.add_argument("--json", default=None, help="also write every measurement here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--video", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        result = measure(args.measure, video_path(Path(args.cache_dir), args.video), args)
        print(json.dumps(result))
        return
    backends = args.backends.split(",")
    skip = set(filter(None, args.skip.split(",")))
    names = args.videos.split(",")
    cache = Path(args.cache_dir)
    for name in names:
        video_path(cache, name)
    results = []
    with tempfile.TemporaryDirectory(prefix="testa-long-video-") as scratch:
        args.scratch = scratch
        for name in names:
            kinds = []
            if name in ("360p", "720p", "1080p"):
                for _ in range(args.rounds):  # alternating, so that both see the same load on a shared machine
                    for backend in backends:
                        kinds += [f"plain:{backend}", f"stream:{backend}"]
                    kinds += ["frames:skip", "frames:seek", "sparse:skip", "sparse:seek"]
                kinds += ["index"]
                if name == "360p":
                    kinds += [f"moment:{backend}" for backend in backends]
                    kinds += ["index:fast", "train.index:0", "train.index:2"]
            else:
                kinds = ["index"]
            for kind in kinds:
                if kind in skip or kind.split(":")[0] in skip:
                    continue
                result = run_child(kind, name, args)
                result["video_name"] = name
                results.append(result)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"\n{cpu_name()}, {os.cpu_count()} cores; model: {args.model}")
    report(results, backends)


if __name__ == "__main__":
    main()
