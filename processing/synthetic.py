"""A deterministic generator of a long-form synthetic video-language dataset (the demo's and the tests' default data).

Every video is a sequence of 3-6 *events* on a dark background. In each event one coloured shape (7 colours x 6
shapes) does one thing: moves across the frame (4 directions), gets bigger, gets smaller, turns another colour, or
stays still. Each video has a paragraph caption, one sentence per event::

    first, a red circle moves from left to right. then a blue ring gets bigger. finally, a white square stays still.

Videos come in *families* of ``family_size`` that share their first (or, in every second family, their last) one or
two events and differ elsewhere, and every family lies entirely in one split. So a test set always holds videos whose
captions start (or end) with the same sentences: telling them apart needs the whole timeline. The colour/shape
sequence of every video is unique, and every event lasts at least 14% of its video, so a sampler that takes one frame
from each of 8 equal segments sees every event.

Output (all paths in the jsonl files are **relative to DIR**; :func:`processing.load_split` resolves them)::

    DIR/train.jsonl, val.jsonl, test.jsonl         {"video": "videos/synth00000.mp4", "text": ..., "video_id": ...}
    DIR/qa_train.jsonl, qa_val.jsonl, qa_test.jsonl {"video", "question", "answer", "video_id"}
    DIR/videos/synthNNNNN.mp4                       H.264 (libx264, yuv420p), `size` x `size` px, `fps` frames/s
    DIR/metadata.json                               the generator settings and every video's events (ground truth)
    DIR/README.md                                   dataset card: `load_dataset(DIR)` / `load_dataset(DIR, "qa")`

Same arguments -> byte-identical jsonl / metadata files and identical decoded frames (the encoder runs with one
thread). Usage::

    python -m processing.synthetic --output-dir data/synthetic [--num-videos 64] [--seed 0]
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


# Every word used in captions, questions and answers is a whole token of the bert-base-uncased vocabulary.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 190, 60),
    "blue": (40, 90, 240),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 210),
    "orange": (250, 140, 20),
    "white": (240, 240, 240),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross", "ring")
ACTIONS: dict[str, str] = {  # action -> caption phrase ("{to}" is the new colour of "turns")
    "moves_right": "moves from left to right",
    "moves_left": "moves from right to left",
    "moves_down": "moves from top to bottom",
    "moves_up": "moves from bottom to top",
    "grows": "gets bigger",
    "shrinks": "gets smaller",
    "turns": "turns {to}",
    "stays": "stays still",
}
ACTION_ANSWERS: dict[str, str] = {  # action -> answer of "what does the X do?"
    "moves_right": "moves right",
    "moves_left": "moves left",
    "moves_down": "moves down",
    "moves_up": "moves up",
    "grows": "gets bigger",
    "shrinks": "gets smaller",
    "turns": "turns {to}",
    "stays": "stays still",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
BACKGROUND = (20, 20, 28)
MIN_EVENT_WEIGHT, MAX_EVENT_WEIGHT = 0.9, 1.1  # relative event lengths before normalisation


@dataclass
class Event:
    """One event: a `colour` `shape` does `action` during frames [`start`, `end`)."""

    colour: str
    shape: str
    action: str
    to_colour: str | None  # the new colour of a "turns" event, else None
    lane: float  # fraction of the frame: the row of horizontal moves, the column of the other actions
    radius: float  # fraction of the frame size (half-width of the shape)
    start: int = 0
    end: int = 0

    @property
    def identity(self) -> tuple[str, str]:
        return (self.colour, self.shape)


@dataclass
class VideoSpec:
    """Everything needed to render one video and write its captions."""

    video_id: str
    split: str
    family: int
    shared: str  # "prefix" or "suffix": which end of the timeline the family shares
    fps: int
    size: int
    num_frames: int
    events: list[Event] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps

    @property
    def video_path(self) -> str:
        """Path of the mp4, relative to the dataset directory."""
        return f"videos/{self.video_id}.mp4"


# ----------------------------------------------------------------------------------------------------------------
# captions and questions


def event_sentence(event: Event, index: int, num_events: int) -> str:
    """The caption sentence of one event, e.g. ``"then a blue ring gets bigger."``."""
    phrase = ACTIONS[event.action].format(to=event.to_colour)
    lead = "first," if index == 0 else ("finally," if index == num_events - 1 else "then")
    article = "an" if event.colour[0] in "aeiou" else "a"
    return f"{lead} {article} {event.colour} {event.shape} {phrase}."


def paragraph(events: list[Event]) -> str:
    """The paragraph caption: the event sentences joined with spaces (as the paper joins ActivityNet sentences)."""
    return " ".join(event_sentence(e, i, len(events)) for i, e in enumerate(events))


def action_answer(event: Event) -> str:
    return ACTION_ANSWERS[event.action].format(to=event.to_colour)


def qa_pairs(events: list[Event], rng: random.Random, num_questions: int = 4) -> list[tuple[str, str]]:
    """Questions about the timeline whose answers follow from the caption (and the video).

    The first question is always the event count; the others are drawn (without replacement, kept in a fixed order)
    from: the shape after / before an event, the colour of the shape after an event, the first / last shape, the
    colour of the last shape, what an event's shape does, which shape moves last, what colour a shape turns.
    Shapes are named by their colour and shape, which are unique within a video.
    """
    n = len(events)

    def name(e: Event) -> str:
        return f"the {e.colour} {e.shape}"

    i, j, k, a = rng.randrange(n - 1), rng.randrange(n - 1), rng.randrange(1, n), rng.randrange(n)
    pool: list[tuple[str, str]] = [
        (f"what shape appears after {name(events[i])}?", events[i + 1].shape),
        (f"what colour is the shape after {name(events[j])}?", events[j + 1].colour),
        (f"what shape appears before {name(events[k])}?", events[k - 1].shape),
        ("what shape appears first?", events[0].shape),
        ("what shape appears last?", events[-1].shape),
        ("what colour is the last shape?", events[-1].colour),
        (f"what does {name(events[a])} do?", action_answer(events[a])),
    ]
    movers = [e for e in events if e.action.startswith("moves")]
    if movers:
        pool.append(("which shape moves last?", movers[-1].shape))
    turners = [e for e in events if e.action == "turns"]
    if turners:
        t = turners[rng.randrange(len(turners))]
        pool.append((f"what colour does {name(t)} turn?", str(t.to_colour)))
    picked = sorted(rng.sample(range(len(pool)), min(num_questions - 1, len(pool))))
    return [("how many events happen in the video?", NUMBER_WORDS[n])] + [pool[p] for p in picked]


# ----------------------------------------------------------------------------------------------------------------
# specs


def _random_event(rng: random.Random, taken: set[tuple[str, str]]) -> Event:
    """An event whose identity (colour, shape) -- and, for "turns", the identity it turns into -- is not in `taken`."""
    while True:
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        if (colour, shape) in taken:
            continue
        action = rng.choice(list(ACTIONS))
        to_colour = None
        if action == "turns":
            options = [c for c in COLOURS if c != colour and (c, shape) not in taken]
            if not options:
                continue
            to_colour = rng.choice(options)
        return Event(colour, shape, action, to_colour, lane=round(rng.uniform(0.3, 0.7), 3),
                     radius=round(rng.uniform(0.12, 0.17), 3))


def _event_taken(events: list[Event]) -> set[tuple[str, str]]:
    taken = {e.identity for e in events}
    taken |= {(e.to_colour, e.shape) for e in events if e.to_colour}
    return taken


def split_families(num_families: int, val_fraction: float, test_fraction: float, rng: random.Random) -> list[str]:
    """Assigns every family a split; val and test get at least one family each when there are 3 or more."""
    n_val = round(num_families * val_fraction)
    n_test = round(num_families * test_fraction)
    if num_families >= 3:
        n_val = max(n_val, 1) if val_fraction > 0 else 0
        n_test = max(n_test, 1) if test_fraction > 0 else 0
    n_train = num_families - n_val - n_test
    if n_train < 1:
        raise ValueError(
            f"{num_families} families cannot be split with val_fraction={val_fraction}, "
            f"test_fraction={test_fraction}: use more videos or smaller fractions"
        )
    splits = ["train"] * n_train + ["val"] * n_val + ["test"] * n_test
    rng.shuffle(splits)
    return splits


def make_specs(
    num_videos: int = 64,
    seed: int = 0,
    fps: int = 2,
    size: int = 96,
    min_duration: float = 30.0,
    max_duration: float = 120.0,
    min_events: int = 3,
    max_events: int = 6,
    family_size: int = 4,
    val_fraction: float = 0.125,
    test_fraction: float = 0.25,
) -> list[VideoSpec]:
    """Draws every video's events, timing and split (cheap: no pixels). Deterministic in its arguments."""
    if num_videos < 1:
        raise ValueError(f"num_videos must be >= 1, got {num_videos}")
    if not 2 <= min_events <= max_events <= 6:
        raise ValueError(f"need 2 <= min_events <= max_events <= 6, got {min_events}, {max_events}")
    if not 0 < min_duration <= max_duration:
        raise ValueError(f"need 0 < min_duration <= max_duration, got {min_duration}, {max_duration}")
    if fps < 1 or size < 16 or size % 2:
        raise ValueError(f"need fps >= 1 and an even size >= 16, got fps={fps}, size={size}")
    if family_size < 1:
        raise ValueError(f"family_size must be >= 1, got {family_size}")
    min_frames, max_frames = math.ceil(min_duration * fps), math.floor(max_duration * fps)
    if min_frames > max_frames or min_frames < 2 * max_events:
        raise ValueError(f"durations {min_duration}-{max_duration} s at {fps} fps leave too few frames")

    rng = random.Random(f"testa-synthetic-{seed}")
    num_families = math.ceil(num_videos / family_size)
    family_splits = split_families(num_families, val_fraction, test_fraction, rng)
    signatures: set[tuple[tuple[str, str], ...]] = set()
    specs: list[VideoSpec] = []
    for family in range(num_families):
        members = min(family_size, num_videos - family * family_size)
        shared_mode = "prefix" if family % 2 == 0 else "suffix"
        num_shared = rng.randint(1, min(2, min_events - 1))
        shared_events: list[Event] = []
        for _ in range(num_shared):
            shared_events.append(_random_event(rng, _event_taken(shared_events)))
        for _ in range(members):
            for _attempt in range(1000):
                n = rng.randint(max(min_events, num_shared + 1), max_events)
                own: list[Event] = []
                for _ in range(n - num_shared):
                    own.append(_random_event(rng, _event_taken(shared_events + own)))
                shared_copy = [Event(**asdict(e)) for e in shared_events]
                events = shared_copy + own if shared_mode == "prefix" else own + shared_copy
                signature = tuple(e.identity for e in events)
                if signature not in signatures:
                    signatures.add(signature)
                    break
            else:  # pragma: no cover - 42 identities leave plenty of room
                raise RuntimeError("could not draw a unique event sequence; lower num_videos")
            num_frames = rng.randint(min_frames, max_frames)
            weights = [rng.uniform(MIN_EVENT_WEIGHT, MAX_EVENT_WEIGHT) for _ in events]
            bounds = np.round(np.cumsum([0.0] + weights) / sum(weights) * num_frames).astype(int)
            for e, start, end in zip(events, bounds[:-1], bounds[1:]):
                e.start, e.end = int(start), int(end)
            specs.append(VideoSpec(f"synth{len(specs):05d}", family_splits[family], family, shared_mode, fps, size,
                                   num_frames, events))
    return specs


# ----------------------------------------------------------------------------------------------------------------
# rendering and encoding


def _shape_mask(shape: str, xx: np.ndarray, yy: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    dx, dy = xx - cx, yy - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return np.maximum(np.abs(dx), np.abs(dy)) <= 0.85 * r
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= 1.2 * r
    if shape == "triangle":  # apex up, base at cy + 0.8 r, half-width r at the base
        rel = (dy + r) / (1.8 * r)
        return (rel >= 0) & (rel <= 1) & (np.abs(dx) <= rel * r)
    if shape == "cross":
        thin = 0.33 * r
        return ((np.abs(dx) <= thin) & (np.abs(dy) <= r)) | ((np.abs(dy) <= thin) & (np.abs(dx) <= r))
    if shape == "ring":
        d2 = dx * dx + dy * dy
        return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)
    raise ValueError(f"unknown shape {shape!r}")


def event_state(event: Event, frame: int, size: int) -> tuple[float, float, float, str]:
    """Centre x, centre y, radius (pixels) and colour name of the event's shape at `frame`."""
    length = max(event.end - event.start - 1, 1)
    p = min(max((frame - event.start) / length, 0.0), 1.0)
    r = event.radius * size
    margin = r + 1.0
    lane = event.lane * size
    colour = event.colour
    cx, cy = lane, size / 2
    if event.action in ("moves_right", "moves_left"):
        q = p if event.action == "moves_right" else 1 - p
        cx, cy = margin + q * (size - 2 * margin), lane
    elif event.action in ("moves_down", "moves_up"):
        q = p if event.action == "moves_down" else 1 - p
        cx, cy = lane, margin + q * (size - 2 * margin)
    elif event.action in ("grows", "shrinks"):
        q = p if event.action == "grows" else 1 - p
        r = size * (0.06 + q * 0.22)
        cx = min(max(lane, r + 1), size - r - 1)
    elif event.action == "turns" and p >= 0.5:
        colour = str(event.to_colour)
    return cx, cy, r, colour


def render_frames(spec: VideoSpec) -> Iterator[np.ndarray]:
    """Yields the video's frames, `(size, size, 3)` uint8 RGB, in order. A pure function of `spec`."""
    size = spec.size
    coords = np.arange(size, dtype=np.float32) + 0.5
    xx, yy = np.meshgrid(coords, coords)
    background = np.empty((size, size, 3), dtype=np.uint8)
    background[:] = BACKGROUND
    events = iter(spec.events)
    event = next(events)
    for t in range(spec.num_frames):
        while t >= event.end:
            event = next(events)
        cx, cy, r, colour = event_state(event, t, size)
        frame = background.copy()
        frame[_shape_mask(event.shape, xx, yy, cx, cy, r)] = COLOURS[colour]
        yield frame


def write_mp4(frames: Iterator[np.ndarray], path: str, fps: int, size: int, crf: int = 20,
              keyframe_interval: int | None = None) -> None:
    """Writes `(size, size, 3)` uint8 RGB frames as H.264 mp4 with PyAV's bundled libx264 (preset fast, one thread),
    through a temporary file so that `path` never holds a half-written video. `keyframe_interval` defaults to 10 s."""
    import av

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.mp4"
    with av.open(tmp, mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "fast", "crf": str(crf), "g": str(keyframe_interval or 10 * fps)}
        stream.codec_context.thread_count = 1  # deterministic bitstream, and fair to a shared CPU
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)


def encode_video(spec: VideoSpec, path: str, crf: int = 20) -> None:
    """Renders `spec` and writes it as H.264 mp4 (:func:`write_mp4`)."""
    write_mp4(render_frames(spec), path, spec.fps, spec.size, crf)


def _encode_job(job: tuple[VideoSpec, str, int]) -> str:
    spec, path, crf = job
    encode_video(spec, path, crf)
    return spec.video_id


def write_videos(videos_dir: str, prefix: str, jobs: list[tuple], encode_job, num_workers: int, progress: bool,
                 desc: str) -> None:
    """Encodes ``jobs`` (``(video, path, crf)``, written by the module-level ``encode_job``) into `videos_dir`, in
    ``num_workers`` processes with a progress bar, after removing the ``{prefix}*.mp4`` files there that no job writes
    (left by an earlier, larger run). Shared by this generator and :mod:`processing.short_events`."""
    from tqdm.auto import tqdm

    os.makedirs(videos_dir, exist_ok=True)
    wanted = {os.path.basename(path) for _, path, _ in jobs}
    for name in os.listdir(videos_dir):
        if name.startswith(prefix) and name.endswith(".mp4") and name not in wanted:
            os.remove(os.path.join(videos_dir, name))
    bar = tqdm(total=len(jobs), desc=desc, unit="video", disable=not progress)
    if num_workers > 1:
        # never `fork`: this process may run threads by now (tqdm's monitor), and a child forked from a
        # multi-threaded process can deadlock (modeling_testa.process_start.WORKER_START_METHOD)
        from modeling_testa.process_start import worker_context

        with worker_context((encode_job.__module__,)).Pool(num_workers) as pool:
            for _ in pool.imap_unordered(encode_job, jobs, chunksize=8):
                bar.update()
    else:
        for job in jobs:
            encode_job(job)
            bar.update()
    bar.close()


# ----------------------------------------------------------------------------------------------------------------
# writing the dataset


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


DATASET_CARD = """---
configs:
- config_name: retrieval
  default: true
  data_files:
  - split: train
    path: train.jsonl
  - split: validation
    path: val.jsonl
  - split: test
    path: test.jsonl
- config_name: qa
  data_files:
  - split: train
    path: qa_train.jsonl
  - split: validation
    path: qa_val.jsonl
  - split: test
    path: qa_test.jsonl
---

# Synthetic long-form video-language data for TESTA

Generated by `python -m processing.synthetic {args}`.

{num_videos} videos ({durations}), {fps} fps, {size}x{size} px, 3-6 events each: coloured shapes that move, grow,
shrink, change colour or stay still. Families of videos share their first (or last) events, so only the whole
timeline tells them apart.

| split | videos | QA pairs |
|---|---|---|
{table}

Retrieval chance level: R@1 = 1/{num_test} on the test split.
Rows: `{{"video", "text", "video_id"}}` (config `retrieval`, the default) and `{{"video", "question", "answer",
"video_id"}}` (config `qa`). The `video` paths are relative to this directory: load with
`processing.load_split(DIR, "test")` (or `load_split(DIR, "test", task="qa")`), which makes them absolute.
`metadata.json` lists every video's events with their frame ranges.
"""


def generate_synthetic_dataset(
    output_dir: str,
    num_videos: int = 64,
    seed: int = 0,
    fps: int = 2,
    size: int = 96,
    min_duration: float = 30.0,
    max_duration: float = 120.0,
    min_events: int = 3,
    max_events: int = 6,
    family_size: int = 4,
    val_fraction: float = 0.125,
    test_fraction: float = 0.25,
    questions_per_video: int = 4,
    crf: int = 20,
    num_workers: int = 1,
    progress: bool = True,
) -> dict:
    """Writes the synthetic dataset to `output_dir` (see the module docstring) and returns a summary dict.

    Args:
        output_dir: destination directory (created). Stale ``videos/synth*.mp4`` files of an earlier, larger run are
            removed.
        num_videos: number of videos over all splits.
        seed: random seed; the same arguments give the same dataset.
        fps, size: frame rate and (square, even) frame size of the videos.
        min_duration, max_duration: video length range in seconds.
        min_events, max_events: events per video (2 <= min <= max <= 6).
        family_size: videos per family (they share 1-2 events at the start or end of the timeline).
        val_fraction, test_fraction: share of families in val and test (at least one family each when possible).
        questions_per_video: QA pairs per video (the first is always the event count).
        crf: x264 quality (lower = larger files, truer colours).
        num_workers: encoding processes (each video is encoded with one thread).
        progress: show a tqdm progress bar.

    Returns:
        ``{"videos": {split: n}, "qa_pairs": {split: n}, "seconds": float, "output_dir": str, "chance_r1": float}``.
    """
    start_time = time.perf_counter()
    specs = make_specs(num_videos, seed, fps, size, min_duration, max_duration, min_events, max_events, family_size,
                       val_fraction, test_fraction)
    jobs = [(s, os.path.join(output_dir, s.video_path), crf) for s in specs]
    write_videos(os.path.join(output_dir, "videos"), "synth", jobs, _encode_job, num_workers, progress,
                 "synthetic videos")

    splits = ("train", "val", "test")
    retrieval = {s: [] for s in splits}
    qa = {s: [] for s in splits}
    for spec in specs:
        retrieval[spec.split].append({"video": spec.video_path, "text": paragraph(spec.events),
                                      "video_id": spec.video_id})
        qa_rng = random.Random(f"testa-synthetic-qa-{seed}-{spec.video_id}")
        for question, answer in qa_pairs(spec.events, qa_rng, questions_per_video):
            qa[spec.split].append({"video": spec.video_path, "question": question, "answer": answer,
                                   "video_id": spec.video_id})
    for split in splits:
        write_jsonl(os.path.join(output_dir, f"{split}.jsonl"), retrieval[split])
        write_jsonl(os.path.join(output_dir, f"qa_{split}.jsonl"), qa[split])

    settings = dict(num_videos=num_videos, seed=seed, fps=fps, size=size, min_duration=min_duration,
                    max_duration=max_duration, min_events=min_events, max_events=max_events, family_size=family_size,
                    val_fraction=val_fraction, test_fraction=test_fraction, questions_per_video=questions_per_video,
                    crf=crf)
    metadata = {
        "generator": "processing.synthetic",
        "format_version": 1,
        "settings": settings,
        "colours": COLOURS,
        "background": BACKGROUND,
        "videos": [
            {"video_id": s.video_id, "video": s.video_path, "split": s.split, "family": s.family,
             "shared": s.shared, "fps": s.fps, "size": s.size, "num_frames": s.num_frames,
             "duration": s.duration, "events": [asdict(e) for e in s.events]}
            for s in specs
        ],
    }
    with open(os.path.join(output_dir, "metadata.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")

    durations = [s.duration for s in specs]
    args = f"--output-dir DIR --num-videos {num_videos} --seed {seed}"
    table = "\n".join(f"| {s} | {len(retrieval[s])} | {len(qa[s])} |" for s in splits)
    num_test = max(len(retrieval["test"]), 1)
    with open(os.path.join(output_dir, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(DATASET_CARD.format(args=args, num_videos=len(specs), fps=fps, size=size, table=table,
                                    durations=f"{min(durations):.1f}-{max(durations):.1f} s", num_test=num_test))
    return {
        "videos": {s: len(retrieval[s]) for s in splits},
        "qa_pairs": {s: len(qa[s]) for s in splits},
        "seconds": time.perf_counter() - start_time,
        "output_dir": output_dir,
        "chance_r1": 1.0 / num_test,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m processing.synthetic",
        description="Generate the deterministic long-form synthetic video-language dataset (mp4 + jsonl).",
    )
    parser.add_argument("--output-dir", required=True, help="destination directory")
    parser.add_argument("--num-videos", type=int, default=64, help="videos over all splits (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--fps", type=int, default=2, help="frames per second (default 2)")
    parser.add_argument("--size", type=int, default=96, help="square frame size in pixels, even (default 96)")
    parser.add_argument("--min-duration", type=float, default=30.0, help="shortest video in seconds (default 30)")
    parser.add_argument("--max-duration", type=float, default=120.0, help="longest video in seconds (default 120)")
    parser.add_argument("--min-events", type=int, default=3, help="fewest events per video (default 3)")
    parser.add_argument("--max-events", type=int, default=6, help="most events per video (default 6, the maximum)")
    parser.add_argument("--family-size", type=int, default=4, help="videos sharing start/end events (default 4)")
    parser.add_argument("--val-fraction", type=float, default=0.125, help="share of families in val (0.125)")
    parser.add_argument("--test-fraction", type=float, default=0.25, help="share of families in test (0.25)")
    parser.add_argument("--questions-per-video", type=int, default=4, help="QA pairs per video (default 4)")
    parser.add_argument("--crf", type=int, default=20, help="x264 constant rate factor (default 20)")
    parser.add_argument("--num-workers", type=int, default=1, help="encoding processes (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    summary = generate_synthetic_dataset(
        args.output_dir, num_videos=args.num_videos, seed=args.seed, fps=args.fps, size=args.size,
        min_duration=args.min_duration, max_duration=args.max_duration, min_events=args.min_events,
        max_events=args.max_events, family_size=args.family_size, val_fraction=args.val_fraction,
        test_fraction=args.test_fraction, questions_per_video=args.questions_per_video, crf=args.crf,
        num_workers=args.num_workers, progress=not args.no_progress,
    )
    videos, qa = summary["videos"], summary["qa_pairs"]
    print(
        f"wrote {sum(videos.values())} videos (train {videos['train']}, val {videos['val']}, test {videos['test']}) "
        f"and {sum(qa.values())} QA pairs to {args.output_dir} in {summary['seconds']:.1f} s; "
        f"test retrieval chance R@1 = {summary['chance_r1']:.1%}"
    )
    return summary


if __name__ == "__main__":
    main()
