"""The short-events task (:mod:`processing.short_events`) as video question answering, rendered in memory.

Every video is a short-events timeline with one flash: three long colour scenes and, inside one of them, a flash
lasting 1/20 to 1/10 of the video. Each video gets one question with a one-word answer::

    what colour is the flash   -> purple

Two choices make the task learnable by a model trained from scratch on a CPU (issue 51's quality experiment), each
found in short exploratory runs (docs/video_llm_quality.md):

* **Scenes and flashes use disjoint palettes** (:data:`SCENE_COLOURS`, :data:`FLASH_COLOURS`), so the answer is
  "which flash colour shows anywhere", not "which colour shows briefly": the model need not compare durations.
* **The flash fills the frame** (:func:`render_flash_frame`), where the retrieval demo's flash is a square over the
  middle quarter. With the square, a tiny Qwen2.5-VL stayed at the answer prior for 400-1,100 steps, with disjoint
  palettes or without (one square patch in 4 of every merge unit, in one tubelet of 8); with the full frame it
  learned within a few hundred steps.

What the task keeps from short events is what the experiment is about: the flash is short, so the answer needs a
frame that shows it. Uniform sampling of T frames sees a flash of length L (a fraction of the video) with probability
about ``min(1, T * L)``, so more frames help, and a model that only guesses when it saw no flash scores
``1 / len(FLASH_COLOURS)`` on those questions (:func:`ceiling_accuracy`: an ideal viewer's expected accuracy).

No mp4 files: frames are rendered from the timeline and only the sampled ones are kept, as
``(frames, size, size, 3)`` uint8 arrays, which is what a video processor gets after decoding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from .short_events import ShortEventVideo, make_videos, uniform_sample_positions
from .synthetic import COLOURS

SCENE_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow")
FLASH_COLOURS: tuple[str, ...] = ("purple", "orange", "white")
QUESTION = "what colour is the flash"


@dataclass(frozen=True)
class Question:
    """The question about video ``video_index`` of a split; ``answer``: its flash's colour."""

    video_index: int
    answer: str

    @property
    def text(self) -> str:
        return QUESTION


def vocabulary() -> list[str]:
    """Every word the question and the answers use, in a fixed order."""
    return [*QUESTION.split(), *SCENE_COLOURS, *FLASH_COLOURS]


def recoloured(video: ShortEventVideo, rng: random.Random) -> ShortEventVideo:
    """``video``'s timing (scene bounds, flash start and length) with scenes drawn from :data:`SCENE_COLOURS`
    (consecutive scenes differ) and flashes from :data:`FLASH_COLOURS`."""
    scenes, previous = [], None
    for scene in video.scenes:
        colour = rng.choice([c for c in SCENE_COLOURS if c != previous])
        flashes = [replace(flash, colour=rng.choice(FLASH_COLOURS)) for flash in scene.flashes]
        scenes.append(replace(scene, colour=colour, flashes=flashes))
        previous = colour
    return replace(video, scenes=scenes)


def make_vqa_split(num_videos: int, seed: int, size: int = 56) -> tuple[list[ShortEventVideo], list[Question]]:
    """``num_videos`` one-flash timelines (`make_videos`' timing, recoloured by :func:`recoloured`) and one question
    each, deterministic in the arguments. Use different seeds for train, validation and test."""
    timelines = make_videos(num_videos, seed=seed, size=size, min_flashes=1, max_flashes=1, family_size=1,
                            test_fraction=0.0)
    rng = random.Random(f"testa-short-events-vqa-{seed}")
    videos = [recoloured(video, rng) for video in timelines]
    return videos, [Question(index, video.flashes[0].colour) for index, video in enumerate(videos)]


def render_flash_frame(video: ShortEventVideo, t: int) -> np.ndarray:
    """Frame ``t`` as ``(size, size, 3)`` uint8 RGB: the flash's colour over the whole frame while it lasts, the
    scene's otherwise."""
    scene = next((s for s in video.scenes if s.start <= t < s.end), None)
    if scene is None:
        raise ValueError(f"frame {t} is outside video {video.video_id!r} of {video.num_frames} frames")
    colour = next((flash.colour for flash in scene.flashes if flash.start <= t < flash.end), scene.colour)
    return np.broadcast_to(np.array(COLOURS[colour], dtype=np.uint8), (video.size, video.size, 3)).copy()


def sampled_frames(video: ShortEventVideo, num_frames: int) -> np.ndarray:
    """``(num_frames, size, size, 3)`` uint8: the frames uniform sampling takes (the video processor's rule)."""
    return np.stack([render_flash_frame(video, t) for t in uniform_sample_positions(video.num_frames, num_frames)])


def flash_seen(video: ShortEventVideo, num_frames: int) -> bool:
    """Whether one of the ``num_frames`` uniformly sampled frames shows one of ``video``'s flashes."""
    taken = uniform_sample_positions(video.num_frames, num_frames)
    return any(flash.start <= t < flash.end for flash in video.flashes for t in taken)


def ceiling_accuracy(videos: list[ShortEventVideo], questions: list[Question], num_frames: int) -> float:
    """The expected accuracy of an ideal viewer of exactly the ``num_frames`` uniformly sampled frames: it names the
    flash's colour when one of them shows it and guesses uniformly among :data:`FLASH_COLOURS` otherwise. An
    expected value: a model that guesses luckily can score above it."""
    guess = 1 / len(FLASH_COLOURS)
    return sum(1.0 if flash_seen(videos[q.video_index], num_frames) else guess for q in questions) / len(questions)


__all__ = ["FLASH_COLOURS", "QUESTION", "Question", "SCENE_COLOURS", "ceiling_accuracy", "flash_seen",
           "make_vqa_split", "recoloured", "render_flash_frame", "sampled_frames", "vocabulary"]
