"""Shrink videos before training: shorter side `--size` (aspect ratio kept, never upscaled), fixed `--fps`, H.264, no
audio -- what the original TESTA `data/compress.py` did with ffmpeg (DiDeMo at 30 fps, ActivityNet at 6 fps, 224 px).

Uses the ffmpeg binary when one is on PATH (``--backend auto``) and PyAV's bundled FFmpeg otherwise. The output tree
mirrors the input tree; files get the ``.mp4`` extension (files without extension, like QuerYD's, keep their name).
Existing outputs are skipped unless ``--overwrite``; failures are counted and listed, not fatal.

    python -m processing.compress_videos --input-dir raw/ --output-dir videos_224/ [--size 224] [--fps 6]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing import get_context


VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v", ".flv", ".mpg", ".mpeg", "")


def output_size(width: int, height: int, size: int) -> tuple[int, int]:
    """(width, height) with the shorter side `size` (not upscaled), the other side scaled and rounded to even."""
    short = min(width, height)
    scale = min(1.0, size / short)

    def even(x: float) -> int:
        return max(2, int(round(x / 2)) * 2)

    return even(width * scale), even(height * scale)


def _compress_pyav(src: str, dst: str, size: int, fps: float, crf: int) -> None:
    import av

    with av.open(src) as inp:
        if not inp.streams.video:
            raise ValueError("no video stream")
        stream_in = inp.streams.video[0]
        stream_in.thread_type = "AUTO"
        width, height = output_size(stream_in.codec_context.width, stream_in.codec_context.height, size)
        rate = Fraction(fps).limit_denominator(1001)
        with av.open(dst, mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"preset": "fast", "crf": str(crf)}
            tick, previous = 0, None
            for frame in inp.decode(stream_in):
                t = frame.time if frame.time is not None else 0.0
                # output tick k shows the latest input frame at or before k / fps (1 us tolerance for float times)
                while previous is not None and float(tick / rate) < t - 1e-6:
                    for packet in stream.encode(_resized(previous, width, height, tick, 1 / rate)):
                        out.mux(packet)
                    tick += 1
                previous = frame
            if previous is not None:
                end = (previous.time or 0.0) + 1 / float(stream_in.average_rate or rate)
                while tick == 0 or tick / rate < end - 1e-9:
                    for packet in stream.encode(_resized(previous, width, height, tick, 1 / rate)):
                        out.mux(packet)
                    tick += 1
            for packet in stream.encode():
                out.mux(packet)


def _resized(frame, width: int, height: int, pts: int, time_base: Fraction):
    new = frame.reformat(width=width, height=height, format="yuv420p", interpolation="BICUBIC")
    new.pts, new.time_base = pts, time_base
    return new


def _compress_ffmpeg(src: str, dst: str, size: int, fps: float, crf: int) -> None:
    scale = (f"scale='if(gt(iw,ih),-2,min({size},ih))':'if(gt(iw,ih),min({size},ih),-2)'"
             f":flags=bicubic,fps={fps}")
    cmd = ["ffmpeg", "-nostdin", "-loglevel", "error", "-y", "-i", src, "-vf", scale, "-an", "-c:v", "libx264",
           "-preset", "fast", "-crf", str(crf), "-pix_fmt", "yuv420p", "-f", "mp4", dst]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr.strip()[-500:] or f"ffmpeg exited with {result.returncode}")


def compress_video(src: str, dst: str, size: int = 224, fps: float = 6, crf: int = 23, backend: str = "auto") -> str:
    """Compresses one video to `dst` (written atomically); returns the backend used."""
    if backend == "auto":
        backend = "ffmpeg" if shutil.which("ffmpeg") else "pyav"
    if backend not in ("ffmpeg", "pyav"):
        raise ValueError(f"backend must be 'auto', 'ffmpeg' or 'pyav', got {backend!r}")
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    tmp = dst + ".part"
    try:
        (_compress_ffmpeg if backend == "ffmpeg" else _compress_pyav)(src, tmp, size, fps, crf)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return backend


@dataclass
class CompressReport:
    done: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)


def _job(job: tuple[str, str, int, float, int, str]) -> tuple[str, str | None]:
    src, dst, size, fps, crf, backend = job
    try:
        compress_video(src, dst, size, fps, crf, backend)
        return src, None
    except Exception as error:  # reported, not fatal: one broken file must not stop a long run
        return src, f"{type(error).__name__}: {error}"


def compress_tree(input_dir: str, output_dir: str, size: int = 224, fps: float = 6, crf: int = 23,
                  backend: str = "auto", num_workers: int = 1, overwrite: bool = False,
                  progress: bool = True) -> CompressReport:
    """Compresses every video under `input_dir` into the same relative path under `output_dir`."""
    from tqdm.auto import tqdm

    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"input directory not found: {input_dir!r}")
    report, jobs = CompressReport(), []
    for root, _, files in os.walk(input_dir):
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext.lower() not in VIDEO_EXTENSIONS or name.endswith(".part"):
                continue
            rel = os.path.relpath(os.path.join(root, name), input_dir)
            dst = os.path.join(output_dir, os.path.dirname(rel), stem + ".mp4" if ext else name)
            if os.path.exists(dst) and not overwrite:
                report.skipped += 1
                continue
            jobs.append((os.path.join(root, name), dst, size, fps, crf, backend))
    bar = tqdm(total=len(jobs), desc="compress", unit="video", disable=not progress)
    if num_workers > 1:
        with get_context("spawn").Pool(num_workers) as pool:
            results = pool.imap_unordered(_job, jobs)
            for src, error in results:
                _count(report, src, error)
                bar.update()
    else:
        for job in jobs:
            _count(report, *_job(job))
            bar.update()
    bar.close()
    return report


def _count(report: CompressReport, src: str, error: str | None) -> None:
    if error is None:
        report.done += 1
    else:
        report.failed.append((src, error))


def main(argv: list[str] | None = None) -> CompressReport:
    parser = argparse.ArgumentParser(prog="python -m processing.compress_videos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-dir", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--size", type=int, default=224, help="shorter side in pixels (default 224)")
    parser.add_argument("--fps", type=float, default=6, help="output frame rate (ActivityNet 6, DiDeMo 30)")
    parser.add_argument("--crf", type=int, default=23)
    parser.add_argument("--backend", choices=("auto", "ffmpeg", "pyav"), default="auto")
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    report = compress_tree(args.input_dir, args.output_dir, args.size, args.fps, args.crf, args.backend,
                           args.num_workers, args.overwrite, not args.no_progress)
    print(f"compressed {report.done}, skipped {report.skipped} existing, failed {len(report.failed)}")
    for src, error in report.failed[:10]:
        print(f"  FAILED {src}: {error}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
