"""A synthetic long-video retrieval task where the number of sampled frames matters (the demo's task).

Every video is a timeline of ``num_scenes`` long *scenes*, each a full-frame colour, and a few short *flashes*: a
square of another colour that appears in the middle of the frame for a moment. Each flash lasts between
``min_flash`` and ``max_flash`` of the video -- less than 1/8 of it by default -- so a sampler that takes one frame
from each of 8 equal segments misses many of them, while 16 frames catch every flash that lasts 1/16 of the video or
longer, and 32 frames catch them all. The paragraph caption names everything in order::

    first the screen is red. a blue square flashes. then the screen is green. finally the screen is yellow. a white
    square flashes.

Videos come in *families* of ``family_size`` that share their scenes and differ only in their flashes (colours and
moments), and every family lies in one split. So each test paragraph has ``family_size - 1`` distractors that only its
flashes rule out.

Chance levels, with ``N`` test videos and families of ``F`` (the demo: ``N = 128``, ``F = 4``):

* random ranking: R@1 = 1/N (0.8%);
* a model that reads the scenes perfectly but no flash: R@1 = 1/F (25%) -- the *scene-only* level;
* a model that reads the scenes and every flash it is shown: up to 100% with enough frames. With uniform sampling,
  a flash of length ``L`` (a fraction of the video) is seen by ``T`` frames with probability ``min(1, T * L)``:
  ``metadata.json`` records, for 8, 16 and 32 frames, which flashes a uniform sampler sees (``seen_by``), and the
  dataset card gives the share of flashes seen at each frame count.

Output (same layout and loader as :mod:`processing.synthetic`, retrieval only)::

    DIR/train.jsonl, val.jsonl, test.jsonl   {"video": "videos/flash00000.mp4", "text": ..., "video_id": ...}
    DIR/videos/flashNNNNN.mp4                H.264, `size` x `size` px, `fps` frames/s
    DIR/metadata.json, DIR/README.md

Deterministic in its arguments, and fast (64 px videos, 2 encoding processes: about 20 s for 512 videos)::

    python -m processing.short_events --output-dir data/short_events [--num-videos 512] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from .synthetic import COLOURS, split_families, write_jsonl, write_mp4, write_videos


#: frame counts whose uniform sampling is recorded in the metadata (``seen_by``) and the dataset card
SAMPLED_FRAME_COUNTS: tuple[int, ...] = (8, 16, 32)


@dataclass
class Flash:
    """A `colour` square in the middle of the frame during frames [`start`, `end`)."""

    colour: str
    start: int
    end: int


@dataclass
class Scene:
    """The whole frame is `colour` during frames [`start`, `end`); `flashes` happen inside it."""

    colour: str
    start: int
    end: int
    flashes: list[Flash] = field(default_factory=list)


@dataclass
class ShortEventVideo:
    video_id: str
    split: str
    family: int
    fps: int
    size: int
    num_frames: int
    scenes: list[Scene] = field(default_factory=list)

    @property
    def video_path(self) -> str:
        return f"videos/{self.video_id}.mp4"

    @property
    def flashes(self) -> list[Flash]:
        return [f for s in self.scenes for f in s.flashes]


def uniform_sample_positions(num_frames: int, samples: int) -> list[int]:
    """The frames that uniform sampling takes (the middle of each of `samples` equal segments): the video
    processor's own rule, ``sample_frame_indices(..., strategy="uniform")``."""
    from modeling_testa.video_decoding import sample_frame_indices

    return sample_frame_indices(num_frames, samples, strategy="uniform").tolist()


def caption(video: ShortEventVideo) -> str:
    """The paragraph: one sentence per scene and per flash, in time order."""
    sentences = []
    for i, scene in enumerate(video.scenes):
        lead = "first" if i == 0 else ("finally" if i == len(video.scenes) - 1 else "then")
        sentences.append(f"{lead} the screen is {scene.colour}.")
        sentences += [f"a {flash.colour} square flashes." for flash in scene.flashes]
    return " ".join(sentences)


QA_QUESTIONS = ("what colour is the screen first?", "what colour is the screen at the end?",
                "what colour is the first square?")
"""The questions `qa_rows` asks of every video: its first scene's, its last scene's and its first flash's colour."""


def qa_rows(row: dict) -> list[dict]:
    """The `QA_QUESTIONS` about one video, answered from its paragraph (`caption`'s sentences), as QA rows
    ``{"video", "question", "answer", "video_id"}``."""
    sentences = [sentence.strip() for sentence in row["text"].split(".") if sentence.strip()]
    scenes = [sentence.split()[-1] for sentence in sentences if " the screen is " in sentence]
    flashes = [sentence.split()[1] for sentence in sentences if sentence.endswith(" square flashes")]
    answers = (scenes[0], scenes[-1], flashes[0]) if scenes and flashes else ()
    return [{"video": row["video"], "question": question, "answer": answer, "video_id": row["video_id"]}
            for question, answer in zip(QA_QUESTIONS, answers)]


def write_qa_splits(data_dir: str, splits: tuple[str, ...] = ("train", "test")) -> dict[str, int]:
    """Writes ``qa_<split>.jsonl`` next to each ``<split>.jsonl`` of a short-event dataset (`qa_rows` of every
    video) and returns the rows written per split."""
    import json

    counts = {}
    for split in splits:
        with open(os.path.join(data_dir, f"{split}.jsonl")) as f:
            rows = [qa for line in f if line.strip() for qa in qa_rows(json.loads(line))]
        write_jsonl(os.path.join(data_dir, f"qa_{split}.jsonl"), rows)
        counts[split] = len(rows)
    return counts


def make_videos(
    num_videos: int = 512,
    seed: int = 0,
    fps: int = 4,
    size: int = 64,
    min_frames: int = 96,
    max_frames: int = 144,
    num_scenes: int = 3,
    min_flashes: int = 2,
    max_flashes: int = 3,
    min_flash: float = 1 / 20,
    max_flash: float = 1 / 10,
    family_size: int = 4,
    val_fraction: float = 0.0,
    test_fraction: float = 0.25,
) -> list[ShortEventVideo]:
    """Draws every video's scenes, flashes, timing and split (no pixels). Deterministic in its arguments."""
    colours = list(COLOURS)
    if num_videos < 1 or family_size < 1:
        raise ValueError(f"need num_videos >= 1 and family_size >= 1, got {num_videos}, {family_size}")
    if not 1 <= num_scenes <= len(colours):
        raise ValueError(f"num_scenes must be in 1..{len(colours)}, got {num_scenes}")
    if not 0 <= min_flashes <= max_flashes <= 2 * num_scenes:
        raise ValueError(f"need 0 <= min_flashes <= max_flashes <= 2 * num_scenes (two flashes per scene at most), "
                         f"got {min_flashes}, {max_flashes}")
    if not 0 < min_flash <= max_flash <= 1 / 8:
        raise ValueError(f"need 0 < min_flash <= max_flash <= 1/8 (short events), got {min_flash}, {max_flash}")
    if fps < 1 or size < 16 or size % 2 or not 0 < min_frames <= max_frames:
        raise ValueError(f"need fps >= 1, an even size >= 16 and 0 < min_frames <= max_frames; got fps={fps}, "
                         f"size={size}, frames {min_frames}-{max_frames}")
    if round(min_flash * min_frames) < 1:
        raise ValueError(f"min_flash={min_flash} of {min_frames} frames is less than one frame")

    rng = random.Random(f"testa-short-events-{seed}")
    num_families = math.ceil(num_videos / family_size)
    splits = split_families(num_families, val_fraction, test_fraction, rng)
    signatures: set[tuple] = set()
    videos: list[ShortEventVideo] = []
    for family in range(num_families):
        scene_colours = [rng.choice(colours)]
        while len(scene_colours) < num_scenes:  # consecutive scenes differ
            scene_colours.append(rng.choice([c for c in colours if c != scene_colours[-1]]))
        for _ in range(min(family_size, num_videos - family * family_size)):
            for _attempt in range(1000):
                video = _draw_member(rng, scene_colours, fps, size, min_frames, max_frames, min_flashes, max_flashes,
                                     min_flash, max_flash, colours)
                signature = tuple((s.colour, tuple(f.colour for f in s.flashes)) for s in video.scenes)
                if signature not in signatures:
                    signatures.add(signature)
                    break
            else:  # pragma: no cover - thousands of flash colourings per scene sequence
                raise RuntimeError("could not draw a unique video; lower num_videos or raise max_flashes")
            video.video_id, video.split, video.family = f"flash{len(videos):05d}", splits[family], family
            videos.append(video)
    return videos


def _draw_member(rng, scene_colours, fps, size, min_frames, max_frames, min_flashes, max_flashes, min_flash,
                 max_flash, colours) -> ShortEventVideo:
    num_frames = rng.randint(min_frames, max_frames)
    weights = [rng.uniform(0.8, 1.2) for _ in scene_colours]
    bounds = np.round(np.cumsum([0.0] + weights) / sum(weights) * num_frames).astype(int)
    scenes = [Scene(c, int(a), int(b)) for c, a, b in zip(scene_colours, bounds[:-1], bounds[1:])]
    num_flashes = rng.randint(min_flashes, max_flashes)
    hosts = sorted(rng.sample(list(range(len(scenes))) * 2, k=num_flashes))  # at most two flashes per scene
    for index, scene in enumerate(scenes):
        count = hosts.count(index)
        if not count:
            continue
        lengths = [max(1, round(rng.uniform(min_flash, max_flash) * num_frames)) for _ in range(count)]
        # flashes sit inside their scene, one frame clear of its edges and of each other
        slack = (scene.end - scene.start) - sum(lengths) - (count + 1)
        if slack < 0:
            raise ValueError(f"a scene of {scene.end - scene.start} frames cannot hold {count} flashes; "
                             "use longer videos or fewer / shorter flashes")
        gaps = sorted(rng.randint(0, slack) for _ in range(count))
        position, used = scene.start + 1, 0
        for gap, length in zip(gaps, lengths):
            start = position + gap - used
            colour = rng.choice([c for c in colours if c != scene.colour])
            scene.flashes.append(Flash(colour, start, start + length))
            position, used = start + length + 1, gap
    return ShortEventVideo("", "", 0, fps, size, num_frames, scenes)


def render_frames(video: ShortEventVideo) -> Iterator[np.ndarray]:
    """Yields the `(size, size, 3)` uint8 RGB frames; a flash covers the middle half of the frame."""
    for t in range(video.num_frames):
        yield render_frame(video, t)


def render_frame(video: ShortEventVideo, t: int) -> np.ndarray:
    """Frame ``t`` of ``video`` as `(size, size, 3)` uint8 RGB (what :func:`render_frames` yields at ``t``)."""
    scene = next((s for s in video.scenes if s.start <= t < s.end), None)
    if scene is None:
        raise ValueError(f"frame {t} is outside video {video.video_id!r} of {video.num_frames} frames")
    lo, hi = video.size // 4, video.size - video.size // 4
    frame = np.empty((video.size, video.size, 3), dtype=np.uint8)
    frame[:] = COLOURS[scene.colour]
    for flash in scene.flashes:
        if flash.start <= t < flash.end:
            frame[lo:hi, lo:hi] = COLOURS[flash.colour]
    return frame


def encode_video(video: ShortEventVideo, path: str, crf: int = 20) -> None:
    """Writes `video` as H.264 mp4 (:func:`processing.synthetic.write_mp4`), a keyframe a second: cheap seeks."""
    write_mp4(render_frames(video), path, video.fps, video.size, crf, keyframe_interval=video.fps)


def _encode_job(job: tuple[ShortEventVideo, str, int]) -> str:
    video, path, crf = job
    encode_video(video, path, crf)
    return video.video_id


def seen_flashes(video: ShortEventVideo, samples: int) -> list[bool]:
    """For each flash, whether uniform sampling of `samples` frames takes one of its frames."""
    taken = uniform_sample_positions(video.num_frames, samples)
    return [any(f.start <= t < f.end for t in taken) for f in video.flashes]


DATASET_CARD = """---
configs:
- config_name: retrieval
  default: true
  data_files:
  - split: train
    path: train.jsonl
  - split: test
    path: test.jsonl
---

# Short events: synthetic long-video retrieval where the frame count matters

Generated by `python -m processing.short_events {args}`.

{num_videos} videos of {frames} frames at {fps} fps, {size}x{size} px. Each has {num_scenes} full-frame colour scenes
and {flashes} flashes (a colour square in the middle of the frame) lasting {flash_range} of the video. Families of
{family_size} videos share their scenes and differ only in their flashes.

| split | videos |
|---|---|
{table}

Chance levels on the test split: random R@1 = 1/{num_test} = {chance:.1%}; scene-only R@1 = 1/{family_size} =
{scene_only:.0%} (a model that reads the scenes but no flash).

Share of flashes that uniform sampling of T frames sees: {seen}.
"""


def generate_short_events_dataset(
    output_dir: str,
    num_videos: int = 512,
    seed: int = 0,
    fps: int = 4,
    size: int = 64,
    min_frames: int = 96,
    max_frames: int = 144,
    num_scenes: int = 3,
    min_flashes: int = 2,
    max_flashes: int = 3,
    min_flash: float = 1 / 20,
    max_flash: float = 1 / 10,
    family_size: int = 4,
    test_fraction: float = 0.25,
    crf: int = 20,
    num_workers: int = 2,
    progress: bool = True,
) -> dict:
    """Writes the dataset to `output_dir` (see the module docstring) and returns a summary dict with the chance
    levels and, per frame count in :data:`SAMPLED_FRAME_COUNTS`, the share of flashes uniform sampling sees."""
    start_time = time.perf_counter()
    videos = make_videos(num_videos, seed, fps, size, min_frames, max_frames, num_scenes, min_flashes, max_flashes,
                         min_flash, max_flash, family_size, 0.0, test_fraction)
    jobs = [(v, os.path.join(output_dir, v.video_path), crf) for v in videos]
    write_videos(os.path.join(output_dir, "videos"), "flash", jobs, _encode_job, num_workers, progress,
                 "short-event videos")

    rows = {"train": [], "test": []}
    for v in videos:
        rows[v.split].append({"video": v.video_path, "text": caption(v), "video_id": v.video_id})
    for split, split_rows in rows.items():
        write_jsonl(os.path.join(output_dir, f"{split}.jsonl"), split_rows)

    seen = {}
    for samples in SAMPLED_FRAME_COUNTS:
        flags = [s for v in videos for s in seen_flashes(v, samples)]
        seen[samples] = sum(flags) / max(1, len(flags))
    settings = dict(num_videos=num_videos, seed=seed, fps=fps, size=size, min_frames=min_frames,
                    max_frames=max_frames, num_scenes=num_scenes, min_flashes=min_flashes, max_flashes=max_flashes,
                    min_flash=min_flash, max_flash=max_flash, family_size=family_size, test_fraction=test_fraction,
                    crf=crf)
    metadata = {
        "generator": "processing.short_events",
        "format_version": 1,
        "settings": settings,
        "colours": COLOURS,
        "seen_share": {str(k): v for k, v in seen.items()},
        "videos": [
            {"video_id": v.video_id, "video": v.video_path, "split": v.split, "family": v.family, "fps": v.fps,
             "size": v.size, "num_frames": v.num_frames, "scenes": [asdict(s) for s in v.scenes],
             "seen_by": {str(k): seen_flashes(v, k) for k in SAMPLED_FRAME_COUNTS}}
            for v in videos
        ],
    }
    with open(os.path.join(output_dir, "metadata.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")
    num_test = max(1, len(rows["test"]))
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(DATASET_CARD.format(
            args=f"--output-dir DIR --num-videos {num_videos} --seed {seed}", num_videos=len(videos),
            frames=f"{min_frames}-{max_frames}", fps=fps, size=size, num_scenes=num_scenes,
            flashes=f"{min_flashes}-{max_flashes}", flash_range=f"{min_flash:.3f}-{max_flash:.3f}",
            family_size=family_size, table="\n".join(f"| {s} | {len(r)} |" for s, r in rows.items()),
            num_test=num_test, chance=1 / num_test, scene_only=1 / family_size,
            seen=", ".join(f"T={k}: {v:.0%}" for k, v in seen.items())))
    return {
        "videos": {s: len(r) for s, r in rows.items()},
        "seconds": time.perf_counter() - start_time,
        "output_dir": output_dir,
        "chance_r1": 1.0 / num_test,
        "scene_only_r1": 1.0 / family_size,
        "seen_share": seen,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m processing.short_events",
                                     description="Generate the short-event synthetic retrieval dataset.")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-videos", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family-size", type=int, default=4)
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument("--num-workers", type=int, default=2, help="encoding processes (default 2)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    summary = generate_short_events_dataset(args.output_dir, num_videos=args.num_videos, seed=args.seed,
                                            family_size=args.family_size, test_fraction=args.test_fraction,
                                            num_workers=args.num_workers, progress=not args.no_progress)
    seen = ", ".join(f"{k} frames see {v:.0%}" for k, v in summary["seen_share"].items())
    print(f"wrote {sum(summary['videos'].values())} videos (train {summary['videos']['train']}, test "
          f"{summary['videos']['test']}) to {args.output_dir} in {summary['seconds']:.1f} s; chance R@1 "
          f"{summary['chance_r1']:.1%}, scene-only R@1 {summary['scene_only_r1']:.0%}; flashes: {seen}")
    return summary


if __name__ == "__main__":
    main()
