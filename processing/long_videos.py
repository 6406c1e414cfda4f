"""Long videos with short events at known times: a moment-retrieval task we can generate and run here.

Every long video is a black background of ``seconds`` seconds into which ``events_per_video`` *events* are placed at
random, non-overlapping times. An event is a whole video of the short-event generator (:mod:`processing.short_events`:
three full-frame colour scenes and a few flashing squares, 24-36 s at 4 fps), and its query is that video's paragraph
("first the screen is red. a blue square flashes. then ..."), so a model trained on short events reads it. The task:
find the video and the time of the event a query describes, among all the long videos.

Output, in the ActivityNet Captions builder's row format (so `train.moment_evaluation` scores it directly)::

    DIR/test.jsonl    {"video": "videos/long00000.mp4", "video_id", "text", "sentences": [paragraph per event],
                       "timestamps": [[start, end] seconds per event], "duration"}
    DIR/videos/longNNNNN.mp4    H.264, `size` x `size` px, `fps` frames/s
    DIR/README.md

Deterministic in its arguments::

    python -m processing.long_videos --output-dir data/long_videos [--num-videos 8] [--minutes 4] [--events 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .short_events import ShortEventVideo, caption, make_videos, render_frames
from .synthetic import write_mp4


BACKGROUND = (0, 0, 0)  # black: no colour of the captions


@dataclass
class LongVideo:
    """`events` start at the given frames of a `num_frames`-frame black video at `fps`."""

    video_id: str
    fps: int
    size: int
    num_frames: int
    events: list[tuple[ShortEventVideo, int]]

    def moments(self) -> list[tuple[float, float]]:
        """`(start, end)` seconds of every event."""
        return [(start / self.fps, (start + event.num_frames) / self.fps) for event, start in self.events]


def plan_long_videos(num_videos: int = 8, seconds: float = 240, events_per_video: int = 3, seed: int = 0,
                     fps: int = 4, size: int = 64) -> list[LongVideo]:
    """Draws the events (short-event videos, all different) and their start frames. No pixels."""
    if num_videos < 1 or events_per_video < 1:
        raise ValueError(f"need num_videos >= 1 and events_per_video >= 1, got {num_videos}, {events_per_video}")
    num_frames = int(round(seconds * fps))
    events = make_videos(num_videos * events_per_video, seed=seed, fps=fps, size=size, family_size=1,
                         test_fraction=0.0)
    rng = random.Random(f"testa-long-videos-{seed}")
    videos = []
    for v in range(num_videos):
        chosen = events[v * events_per_video : (v + 1) * events_per_video]
        background = num_frames - sum(e.num_frames for e in chosen)
        if background < 0:
            raise ValueError(f"{events_per_video} events of up to {max(e.num_frames for e in chosen)} frames do not "
                             f"fit in {seconds} s at {fps} fps; use longer videos or fewer events")
        # the background frames split at random into the gaps before, between and after the events
        cuts = sorted(rng.randint(0, background) for _ in range(events_per_video))
        gaps = np.diff([0, *cuts]).tolist()
        starts, position = [], 0
        for gap, event in zip(gaps, chosen):
            position += gap
            starts.append(position)
            position += event.num_frames
        videos.append(LongVideo(f"long{v:05d}", fps, size, num_frames, list(zip(chosen, starts))))
    return videos


def render_long_video(video: LongVideo) -> Iterator[np.ndarray]:
    """The `(size, size, 3)` uint8 frames: black, with each event's frames at its place."""
    black = np.empty((video.size, video.size, 3), dtype=np.uint8)
    black[:] = BACKGROUND
    position = 0
    for event, start in video.events:
        for _ in range(start - position):
            yield black.copy()
        yield from render_frames(event)
        position = start + event.num_frames
    for _ in range(video.num_frames - position):
        yield black.copy()


def row(video: LongVideo, path: str) -> dict:
    """The video's row in the ActivityNet Captions builder's format."""
    sentences = [caption(event) for event, _ in video.events]
    return {"video": path, "video_id": video.video_id, "text": " ".join(sentences), "sentences": sentences,
            "timestamps": [[start, end] for start, end in video.moments()], "duration": video.num_frames / video.fps}


def generate_long_videos_dataset(output_dir: str, num_videos: int = 8, minutes: float = 4, events_per_video: int = 3,
                                 seed: int = 0, fps: int = 4, size: int = 64) -> list[dict]:
    """Writes the videos, ``test.jsonl`` and ``README.md`` (see the module docstring); returns the rows."""
    videos = plan_long_videos(num_videos, minutes * 60, events_per_video, seed, fps, size)
    rows = []
    for video in videos:
        relative = f"videos/{video.video_id}.mp4"
        write_mp4(render_long_video(video), os.path.join(output_dir, relative), fps, size, keyframe_interval=fps)
        rows.append(row(video, relative))
    with open(os.path.join(output_dir, "test.jsonl"), "w", encoding="utf-8") as f:
        for item in rows:
            f.write(json.dumps(item) + "\n")
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(f"# Long videos with short events\n\nGenerated by `python -m processing.long_videos --num-videos "
                f"{num_videos} --minutes {minutes:g} --events {events_per_video} --seed {seed}`: {num_videos} black "
                f"videos of {minutes:g} min at {fps} fps, {size}x{size} px, each with {events_per_video} short-event "
                f"videos at random times. One query per event (its paragraph); `timestamps` give its time.\n")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m processing.long_videos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-videos", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=4)
    parser.add_argument("--events", type=int, default=3, help="events per video")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = generate_long_videos_dataset(args.output_dir, args.num_videos, args.minutes, args.events, args.seed)
    print(f"wrote {len(rows)} videos, {sum(len(r['sentences']) for r in rows)} events, to {args.output_dir}")
    return rows


if __name__ == "__main__":
    main()
