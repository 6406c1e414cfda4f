"""Videos that look like real footage to a token matcher: static shots, frozen and repeated frames, slow pans, fades,
slides and flat colour scenes with cuts.

Random frames (what most tests feed) never repeat, so no two similarity scores are ever close. Real footage repeats
constantly: a static camera, a lecture slide held for a minute, a freeze frame, a 10 fps clip sampled at 25 fps, a
fade. Between such frames (and between the patches of a flat background) the matcher's scores differ only by rounding,
which is what makes merge decisions depend on the runtime (docs/inference.md, "Agreement between runtimes"). This
module makes those inputs, deterministically from a seed:

* :func:`realistic_clip` -- one ``(frames, height, width, 3)`` uint8 clip of a given :data:`KINDS` kind;
* :func:`realistic_pixel_values` -- the same clip as normalised ``(frames, 3, height, width)`` pixel values (CLIP mean
  and std, as `TestaVideoProcessor` gives them): the tensor-level variant for unit tests, no decoding involved;
* :func:`write_realistic_video` -- a clip as a real H.264 mp4 written by PyAV;
* :func:`write_realistic_set` / ``python -m processing.realistic_videos`` -- a folder of such mp4s (every kind in
  turn) with a ``videos.jsonl`` manifest.

    python -m processing.realistic_videos --output-dir outputs/realistic --num-videos 24 [--frames 64] [--size 96]

The kinds (each frame count is the number of frames written; a sampler later picks some of them):

==============  ===================================================================================================
``static``      one textured scene from a fixed camera; frames differ only by faint sensor noise (+-1 grey level)
``frozen``      slow motion, but each distinct frame is held for 3-6 frames (a low-frame-rate source, a freeze frame)
``pan``         a slow pan (1-2 px per frame) across a wide textured scene
``fade``        a scene fades to black, black holds, a second scene fades in and holds (a quarter each)
``slides``      2-4 slides (light background, dark text-like bars) held for many frames, hard cuts between them
``colour_cuts`` full-frame flat colours with hard cuts (every patch of a frame identical), as the demo's videos
==============  ===================================================================================================
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where it is used: generating videos needs only numpy and PyAV
    import torch


KINDS = ("static", "frozen", "pan", "fade", "slides", "colour_cuts")
"""The kinds of clip, in the order `write_realistic_set` cycles through them."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP's pixel mean and std (`transformers.image_utils.OPENAI_CLIP_MEAN`/`_STD`), what the video processor
normalises with."""


def _texture(rng: np.random.Generator, height: int, width: int, cells: int = 6) -> np.ndarray:
    """A smooth random colour image ``(height, width, 3)`` float in [0, 255]: coarse noise upsampled bilinearly, plus a
    few sharp-edged rectangles (objects with edges, as real scenes have)."""
    coarse = rng.uniform(30, 225, size=(cells + 1, cells + 1, 3))
    ys = np.linspace(0, cells, height)
    xs = np.linspace(0, cells, width)
    y0, x0 = np.minimum(ys.astype(int), cells - 1), np.minimum(xs.astype(int), cells - 1)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    image = top * (1 - fy) + bottom * fy
    for _ in range(3):
        h, w = rng.integers(height // 8, height // 3 + 1), rng.integers(width // 8, width // 3 + 1)
        y, x = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
        image[y : y + h, x : x + w] = rng.uniform(0, 255, size=3)
    return image


def _slide(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A presentation slide: a light background with a title bar and rows of dark "words"."""
    image = np.empty((height, width, 3))
    image[:] = rng.uniform(215, 250, size=3)
    margin = max(width // 12, 2)
    image[margin : margin + max(height // 10, 2), margin : width - margin] = rng.uniform(20, 90, size=3)
    row_height, y = max(height // 16, 1), margin + height // 6
    while y + row_height < height - margin:
        x = margin
        while x < width - margin:
            word = int(rng.integers(width // 16 + 1, width // 5 + 2))
            image[y : y + row_height, x : min(x + word, width - margin)] = rng.uniform(10, 60)
            x += word + max(width // 32, 1)
        y += 2 * row_height
    return image


def _held(frames: int, rng: np.random.Generator, shortest: int, longest: int) -> list[int]:
    """For every frame, the index of the distinct frame shown (each held for ``shortest`` to ``longest`` frames)."""
    held, shown = [], 0
    while len(held) < frames:
        held += [shown] * int(rng.integers(shortest, longest + 1))
        shown += 1
    return held[:frames]


def realistic_clip(kind: str, frames: int = 32, height: int = 64, width: int = 64, seed: int = 0) -> np.ndarray:
    """A ``(frames, height, width, 3)`` uint8 clip of ``kind`` (one of :data:`KINDS`), the same for the same
    arguments."""
    if kind not in KINDS:
        raise ValueError(f"Unknown realistic clip kind {kind!r}; allowed kinds are {', '.join(map(repr, KINDS))}.")
    if frames < 1 or height < 8 or width < 8:
        raise ValueError(f"A clip needs frames >= 1 and sides >= 8 pixels; got frames={frames}, {height}x{width}.")
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    if kind == "static":
        scene = _texture(rng, height, width)
        video = scene[None] + rng.integers(-1, 2, size=(frames, height, width, 3))
    elif kind == "frozen":
        wide = _texture(rng, height, width + frames)
        shown = _held(frames, rng, 3, 6)
        video = np.stack([wide[:, s * 2 : s * 2 + width] for s in shown])  # each distinct frame moved 2 px
    elif kind == "pan":
        speed = int(rng.integers(1, 3))
        wide = _texture(rng, height, width + speed * frames)
        video = np.stack([wide[:, t * speed : t * speed + width] for t in range(frames)])
    elif kind == "fade":
        first, second = _texture(rng, height, width), _texture(rng, height, width)
        half = max(frames // 2, 1)
        gains = [max(0.0, 1 - 2 * t / half) if t < half else min(1.0, 2 * (t - half) / max(frames - half, 1))
                 for t in range(frames)]
        video = np.stack([(first if t < half else second) * g for t, g in enumerate(gains)])
    elif kind == "slides":
        slides = [_slide(rng, height, width) for _ in range(int(rng.integers(2, 5)))]
        video = np.stack([slides[min(t * len(slides) // frames, len(slides) - 1)] for t in range(frames)])
    else:  # colour_cuts
        scenes = rng.uniform(0, 255, size=(int(rng.integers(2, 5)), 3))
        video = np.stack([np.broadcast_to(scenes[t * len(scenes) // frames], (height, width, 3)) for t in range(frames)])
    return np.clip(np.rint(video), 0, 255).astype(np.uint8)


def normalise(clip: np.ndarray) -> "torch.Tensor":
    """uint8 ``(frames, height, width, 3)`` -> float32 ``(frames, 3, height, width)`` normalised with the CLIP mean
    and std, as `TestaVideoProcessor` returns pixel values (without resizing)."""
    import torch

    pixels = torch.from_numpy(np.ascontiguousarray(clip)).permute(0, 3, 1, 2).float() / 255.0
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)
    return (pixels - mean) / std


def realistic_pixel_values(kind: str, frames: int = 8, size: int = 32, seed: int = 0) -> "torch.Tensor":
    """The tensor-level variant: :func:`realistic_clip` of ``kind`` as normalised ``(frames, 3, size, size)`` pixel
    values, ready for a `TestaVisionModel` (stack several for a batch). Repeated frames are bit-identical."""
    return normalise(realistic_clip(kind, frames, size, size, seed))


def write_realistic_video(path: str | Path, clip: np.ndarray, fps: int = 25, crf: int = 18) -> Path:
    """Writes a uint8 ``(frames, height, width, 3)`` clip as an H.264 mp4 (yuv420p, even sides) with PyAV."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames, height, width, _ = clip.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 with yuv420p needs even sides; the clip for {path} is {height}x{width}.")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for image in clip:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_realistic_set(output_dir: str | Path, num_videos: int = 24, frames: int = 64, size: int = 96,
                        fps: int = 25, seed: int = 0) -> list[dict]:
    """Writes ``num_videos`` mp4s to ``output_dir/videos`` (the kinds in turn, each video its own seed) and
    ``output_dir/videos.jsonl`` (one ``{"video", "kind", "seed"}`` row per file, paths relative to ``output_dir``);
    returns the rows."""
    output_dir = Path(output_dir)
    rows = []
    for index in range(num_videos):
        kind = KINDS[index % len(KINDS)]
        name = f"videos/{kind}{index:04d}.mp4"
        write_realistic_video(output_dir / name, realistic_clip(kind, frames, size, size, seed + index), fps=fps)
        rows.append({"video": name, "kind": kind, "seed": seed + index})
    (output_dir / "videos.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-videos", type=int, default=24)
    parser.add_argument("--frames", type=int, default=64, help="frames written per video")
    parser.add_argument("--size", type=int, default=96, help="width and height in pixels (even)")
    parser.add_argument("--fps", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = write_realistic_set(args.output_dir, args.num_videos, args.frames, args.size, args.fps, args.seed)
    print(f"wrote {len(rows)} videos ({', '.join(KINDS)}) to {Path(args.output_dir) / 'videos'}")
    return rows


if __name__ == "__main__":
    main()
