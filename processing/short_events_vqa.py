"""The short-events task (:mod:`processing.short_events`) as video question answering, rendered in memory.

Every video is the short-events timeline (a few full-frame colour scenes and 2-3 short flashes of a colour square in
the middle of the frame, each lasting 1/20 to 1/10 of the video). Each video gets two questions with one-word
answers::

    is there a square in blue   -> yes   (blue: one of its flashes, drawn at random)
    is there a square in white  -> no    (white: a colour that appears nowhere in the video)

(The colour comes last, so the position that predicts the answer is the colour word itself: a tiny model trained
from scratch then needs no layer to carry the colour forward first.)

The flashes are spread over the video and short, so the answer to a "yes" question needs the frame that shows that
flash: with uniform sampling of T frames a flash of length L (a fraction of the video) is seen with probability
``min(1, T * L)`` (:func:`short_events.seen_flashes`). A model
that answers every question it can see perfectly and says "no" otherwise scores ``(1 + seen share) / 2``
(:func:`oracle_accuracy`): more frames help.

No mp4 files: frames are rendered from the timeline (:func:`short_events.render_frame`) and only the sampled ones
are kept, as ``(frames, size, size, 3)`` uint8 arrays, which is what a video processor gets after decoding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .short_events import ShortEventVideo, make_videos, render_frame, uniform_sample_positions
from .synthetic import COLOURS

ANSWERS: tuple[str, ...] = ("yes", "no")
QUESTION_WORDS: tuple[str, ...] = ("is", "there", "a", "in")


@dataclass(frozen=True)
class Question:
    """One question about one video: ``text`` ("is there a square in blue"), its one-word ``answer``, the ``colour``
    asked about, the ``kind`` ("square": a flash; "screen": a whole-frame scene), and for a "yes" square question the
    index of the flash (in `ShortEventVideo.flashes`) it is about."""

    video_index: int
    colour: str
    answer: str
    flash_index: int | None = None
    kind: str = "square"

    @property
    def text(self) -> str:
        return f"is there a {self.kind} in {self.colour}"


KINDS: tuple[str, ...] = ("square", "screen")


def vocabulary() -> list[str]:
    """Every word a question or an answer uses, in a fixed order."""
    return [*QUESTION_WORDS, *KINDS, *COLOURS, *ANSWERS]


def questions_for(video: ShortEventVideo, video_index: int, rng: random.Random,
                  kinds: tuple[str, ...] = ("square",)) -> list[Question]:
    """Per kind, a "yes" and a "no" question. "square": about one of ``video``'s flashes (one whose colour no scene
    has, where there is one: then only the flash shows it); "screen": about one of its scenes (long: any sampling
    sees every scene, an easy question that teaches a model trained from scratch to bind a colour word to the
    video). The "no" question asks about a colour absent from the video (the task's timelines use at most 6 of the 7
    colours, so one always exists)."""
    scene_colours = {scene.colour for scene in video.scenes}
    present = scene_colours | {flash.colour for flash in video.flashes}
    absent = [colour for colour in COLOURS if colour not in present]
    if not absent:
        raise ValueError(f"video {video.video_id} uses every colour; no 'no' question can be asked about it")
    questions = []
    for kind in kinds:
        if kind == "square":
            short = [i for i, flash in enumerate(video.flashes) if flash.colour not in scene_colours]
            flash_index = rng.choice(short or list(range(len(video.flashes))))
            questions.append(Question(video_index, video.flashes[flash_index].colour, "yes", flash_index))
        elif kind == "screen":
            questions.append(Question(video_index, rng.choice(video.scenes).colour, "yes", kind="screen"))
        else:
            raise ValueError(f"kind={kind!r}; allowed: {', '.join(map(repr, KINDS))}")
        questions.append(Question(video_index, rng.choice(absent), "no", kind=kind))
    return questions


def make_vqa_split(num_videos: int, seed: int, size: int = 112, kinds: tuple[str, ...] = ("square",)
                   ) -> tuple[list[ShortEventVideo], list[Question]]:
    """``num_videos`` short-events timelines (all in one split: `make_videos` with no test fraction) and their
    questions of ``kinds``, deterministic in the arguments. Use different seeds for train and test."""
    videos = make_videos(num_videos, seed=seed, size=size, test_fraction=0.0)
    rng = random.Random(f"testa-short-events-vqa-{seed}")
    questions = [q for index, video in enumerate(videos) for q in questions_for(video, index, rng, kinds)]
    return videos, questions


def sampled_frames(video: ShortEventVideo, num_frames: int) -> np.ndarray:
    """``(num_frames, size, size, 3)`` uint8: the frames uniform sampling takes (the video processor's rule)."""
    return np.stack([render_frame(video, t) for t in uniform_sample_positions(video.num_frames, num_frames)])


def colour_seen(video: ShortEventVideo, colour: str, num_frames: int) -> bool:
    """Whether any of the ``num_frames`` uniformly sampled frames shows ``colour`` (as a scene or a flash)."""
    taken = uniform_sample_positions(video.num_frames, num_frames)
    shown = [scene.colour for scene in video.scenes if any(scene.start <= t < scene.end for t in taken)]
    shown += [flash.colour for flash in video.flashes if any(flash.start <= t < flash.end for t in taken)]
    return colour in shown


def oracle_accuracy(videos: list[ShortEventVideo], questions: list[Question], num_frames: int) -> float:
    """The accuracy on square questions of a model that sees exactly the ``num_frames`` uniformly sampled frames
    and answers "yes" when the asked colour is in one of them, "no" otherwise: the ceiling at that frame count."""
    correct = sum(("yes" if colour_seen(videos[q.video_index], q.colour, num_frames) else "no") == q.answer
                  for q in questions)
    return correct / len(questions)


__all__ = ["ANSWERS", "KINDS", "Question", "colour_seen", "make_vqa_split", "oracle_accuracy", "questions_for", "sampled_frames",
           "vocabulary"]
