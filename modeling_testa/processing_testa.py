"""Processor for TESTA: the BERT-uncased tokenizer with BLIP's `[DEC]`/`[ENC]` tokens plus `TestaVideoProcessor`."""

import json
import os
import re
from pathlib import Path
from typing import Any

from transformers import BertTokenizer
from transformers.processing_utils import ProcessorMixin

from .saved_tokenizer import cap_tokenizer_length, text_limit_in
from .video_inputs import VIDEO_SUFFIXES, text_list
from .video_processing_testa import TestaVideoProcessor


VOCAB_FILE = Path(__file__).with_name("vocab.txt")
"""The bert-base-uncased WordPiece vocabulary (30522 entries) shipped with the package."""

DEC_TOKEN = "[DEC]"
"""BLIP's decoder start token (`bos_token`), id 30522: replaces `[CLS]` in decoder inputs."""

ENC_TOKEN = "[ENC]"
"""BLIP's video-grounded encoder token, id 30523: replaces `[CLS]` for ITM and VQA question encoding."""

TASK_TEXT_SETTINGS: dict[str, dict[str, Any]] = {
    # paragraph-to-video retrieval (configs/*.yaml `max_words`; padding="max_length" as in the original)
    "queryd": {"max_length": 128, "padding": "max_length"},
    "didemo": {"max_length": 64, "padding": "max_length"},
    "activitynet": {"max_length": 64, "padding": "max_length"},
    "condensed_movies": {"max_length": 32, "padding": "max_length"},
    # pretraining captions and ActivityNet-QA questions
    "pretrain": {"max_length": 30, "padding": "max_length"},
    "activitynet_qa": {"max_length": 35, "padding": "longest"},
}
"""Text length (tokens, `[CLS]`/`[SEP]` included) and padding per task, as used by the original TESTA code."""

TASK_CAPTION_WORDS: dict[str, int] = {"queryd": 128, "activitynet": 50, "condensed_movies": 50, "pretrain": 50}
"""Word limit of the original `pre_caption` per task (DiDeMo captions were not cleaned; QA questions use 50)."""

_CAPTION_SYMBOLS = re.compile(r"[!\"()*#~]")
_SPACES = re.compile(r"\s{2,}")


def pre_caption(caption: str, max_words: int = 50) -> str:
    """The released TESTA caption cleaning: adapted from TESTA `data/utils.py` L11-L30 (`pre_caption`).

    Lower-cases, replaces each of ``!"()*#~`` by a space, collapses runs of whitespace, strips surrounding spaces and
    newlines, and keeps at most `max_words` space-separated words. (TESTA keeps `.`, `:` and `;`, unlike BLIP.)

    Args:
        caption (`str`): raw caption or paragraph.
        max_words (`int`, defaults to 50): word limit.

    Returns:
        `str`: the cleaned caption.
    """
    caption = _CAPTION_SYMBOLS.sub(" ", caption.lower())
    caption = _SPACES.sub(" ", caption)
    caption = caption.rstrip("\n").strip(" ")
    words = caption.split(" ")
    if len(words) > max_words:
        caption = " ".join(words[:max_words])
    return caption


def build_testa_tokenizer(vocab_file: str | os.PathLike | None = None, **kwargs: Any) -> BertTokenizer:
    """Builds the TESTA/BLIP text tokenizer offline from a WordPiece `vocab.txt`.

    This is `bert-base-uncased` (lower-casing, accent stripping, WordPiece) with `[DEC]` added as `bos_token`
    (id 30522) and `[ENC]` as an extra special token (id 30523), so `len(tokenizer) == 30524`, matching BLIP's
    `init_tokenizer`. The `[ENC]` id is also available as `tokenizer.enc_token_id`.

    Args:
        vocab_file (`str` or `os.PathLike`, *optional*): the vocabulary, one token per line; defaults to the
            `vocab.txt` shipped next to this module.
        **kwargs: passed to `BertTokenizer` (e.g. `model_max_length`).

    Returns:
        `BertTokenizer`: the tokenizer.
    """
    path = Path(vocab_file) if vocab_file is not None else VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"WordPiece vocabulary not found: {str(path)!r}. Pass `vocab_file=` (bert-base-uncased's vocab.txt) or "
            "load a saved processor with `TestaProcessor.from_pretrained`."
        )
    # transformers v5 silently ignores `vocab_file=`: the vocabulary must be passed as `vocab=`.
    kwargs.setdefault("do_lower_case", True)
    kwargs.setdefault("model_max_length", 512)
    tokenizer = BertTokenizer(vocab=str(path), **kwargs)
    tokenizer.add_special_tokens({"bos_token": DEC_TOKEN, "additional_special_tokens": [ENC_TOKEN]})
    tokenizer.enc_token_id = tokenizer.convert_tokens_to_ids(ENC_TOKEN)
    return tokenizer


class TestaProcessor(ProcessorMixin):
    r"""
    Processor for TESTA: wraps a [`TestaVideoProcessor`] (videos -> `pixel_values`) and a BERT-uncased tokenizer with
    BLIP's `[DEC]` and `[ENC]` tokens (text -> `input_ids`, `attention_mask`).

    `TestaProcessor()` builds both offline: the default video processor and [`build_testa_tokenizer`] on the shipped
    vocabulary.

    Args:
        video_processor ([`TestaVideoProcessor`], *optional*): defaults to `TestaVideoProcessor()`.
        tokenizer ([`BertTokenizer`], *optional*): defaults to `build_testa_tokenizer()`.
        task (`str`, *optional*): the default `task` of calls (see below); saved in `processor_config.json`.
        clean_text (`bool`, defaults to `False`): the default `clean_text` of calls; saved in `processor_config.json`.

    Calling it (`processor(text=..., videos=..., task=None, clean_text=None, **kwargs)`):

    - `text` (`str` or `list[str]`) is tokenized with truncation. Without `task` the batch is padded to its longest
      sequence and truncated to 64 tokens; with `task` the original setting of that task is used (see
      `TASK_TEXT_SETTINGS`: QuerYD 128, DiDeMo 64, ActivityNet 64, Condensed Movies 32, padded to `max_length`).
      Explicit `max_length=`/`padding=` arguments win over the task's; a tokenizer `model_max_length` below the
      default length (e.g. set by Sentence Transformers' `max_seq_length`) lowers it.
    - `clean_text=True` applies the original caption cleaning ([`pre_caption`]) first, with the task's word limit
      (50 by default).
    - `task` and `clean_text` left at `None` take the processor's settings (`processor.task`, `processor.clean_text`),
      so that a folder saved with e.g. `TestaProcessor(task="didemo", clean_text=True)` tokenizes that way when loaded.
    - `videos` go to the video processor (any of its inputs and keyword arguments, e.g. `num_frames=8`).

    Returns a `BatchFeature` with `input_ids`, `attention_mask` (no `token_type_ids`) and `pixel_values`.
    """

    text_kwargs = {
        "padding": "longest",
        "truncation": True,
        "max_length": 64,
        "return_token_type_ids": False,
        "return_tensors": "pt",
    }

    def __init__(
        self,
        video_processor: TestaVideoProcessor | None = None,
        tokenizer: BertTokenizer | None = None,
        task: str | None = None,
        clean_text: bool = False,
        **kwargs: Any,
    ) -> None:
        if video_processor is None:
            video_processor = TestaVideoProcessor()
        if tokenizer is None:
            tokenizer = build_testa_tokenizer()
        kwargs.pop("auto_map", None)  # export metadata of a saved folder, written again by `to_json_string`
        _check_task(task)
        if not isinstance(clean_text, bool):
            raise ValueError(f"`clean_text` must be True or False, got {clean_text!r}.")
        super().__init__(video_processor=video_processor, tokenizer=tokenizer, **kwargs)
        self.task, self.clean_text = task, clean_text
        if getattr(self.tokenizer, "enc_token_id", None) is None and ENC_TOKEN in self.tokenizer.get_vocab():
            self.tokenizer.enc_token_id = self.tokenizer.convert_tokens_to_ids(ENC_TOKEN)

    @property
    def enc_token_id(self) -> int | None:
        """Id of `[ENC]` (30523 with the default tokenizer)."""
        return self.tokenizer.convert_tokens_to_ids(ENC_TOKEN) if ENC_TOKEN in self.tokenizer.get_vocab() else None

    @property
    def dec_token_id(self) -> int | None:
        """Id of `[DEC]`, the `bos_token` (30522 with the default tokenizer)."""
        return self.tokenizer.bos_token_id

    @property
    def model_input_names(self) -> list[str]:
        """`["input_ids", "attention_mask", "pixel_values"]`."""
        return ["input_ids", "attention_mask", "pixel_values"]

    def __call__(
        self,
        text: str | list[str] | None = None,
        videos: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Tokenizes `text` and/or processes `videos`; see the class docstring.

        Args:
            text (`str` or `list[str]`, *optional*): captions, paragraphs, queries or questions.
            videos (*optional*): anything [`TestaVideoProcessor`] accepts.
            task (`str`, *optional*, keyword only): one of `TASK_TEXT_SETTINGS` (`"queryd"`, `"didemo"`, `"activitynet"`,
                `"condensed_movies"`, `"pretrain"`, `"activitynet_qa"`) to use the original text length and padding;
                defaults to `self.task`.
            clean_text (`bool`, *optional*, keyword only): apply [`pre_caption`] before tokenizing; defaults to `self.clean_text`.
            **kwargs: tokenizer arguments (`max_length`, `padding`, `return_tensors`, ...) and video-processor
                arguments (`num_frames`, `frame_sampling`, `return_metadata`, ...), or `text_kwargs={...}` /
                `videos_kwargs={...}`.

        Returns:
            `BatchFeature` with `input_ids`, `attention_mask` and/or `pixel_values` (plus `video_metadata` when
            `return_metadata=True`).
        """
        if text is None and videos is None:
            raise ValueError("TestaProcessor needs `text`, `videos`, or both.")
        # keyword arguments, not parameters: transformers reserves explicit `__call__` parameters for runtime inputs,
        # and processor attributes (saved in processor_config.json) are overridden through kwargs
        task = kwargs.pop("task", None)
        clean_text = kwargs.pop("clean_text", None)
        task = self.task if task is None else task
        clean_text = self.clean_text if clean_text is None else clean_text
        _check_task(task)
        if text is not None:
            texts, single = text_list(text, "text", allow_empty=True)
            check_not_video_paths(texts)
            if clean_text:
                max_words = TASK_CAPTION_WORDS.get(task, 50)
                texts = [pre_caption(t, max_words) for t in texts]
            text = texts[0] if single else texts
            explicit = dict(kwargs.get("text_kwargs", {}))
            explicit.update({k: v for k, v in kwargs.items() if k in ("max_length", "padding")})
            settings = dict(TASK_TEXT_SETTINGS[task]) if task is not None else {}
            # a tokenizer limit set below the default length (e.g. Sentence Transformers' `max_seq_length`) wins
            default_length = settings.get("max_length", self.text_kwargs["max_length"])
            limit = getattr(self.tokenizer, "model_max_length", None)
            if isinstance(limit, int) and limit < default_length:
                settings["max_length"] = limit
            settings = {k: v for k, v in settings.items() if k not in explicit}
            if settings:
                kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), **settings}
        return super().__call__(text=text, videos=videos, **kwargs)

    # -- saving -------------------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """`ProcessorMixin.save_pretrained`; when the model is already saved in the folder, the tokenizer's
        `model_max_length` is capped at its text limit (the model's `save_pretrained` does the same in the other
        order), so generic code (Sentence Transformers' `max_seq_length`) reads the real limit."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        limit = text_limit_in(save_directory)
        if limit is not None:
            cap_tokenizer_length(save_directory, limit)
        return result

    def to_dict(self) -> dict[str, Any]:
        """The processor's settings (its video processor's included), without the export metadata `auto_map`: equal
        for a processor and its saved and reloaded copy, before and after saving (`to_json_string` adds `auto_map`)."""
        output = super().to_dict()
        output.pop("auto_map", None)  # set on the object by transformers' `custom_object_save` while saving
        return output

    def to_json_string(self) -> str:
        """`to_dict()` with the `auto_map` of this class and of the video processor, as JSON: the content of
        `processor_config.json`, which `AutoProcessor`/`AutoVideoProcessor` read to load the saved remote code."""
        dictionary = self.to_dict()
        if self._auto_class is not None:
            module = type(self).__module__.rsplit(".", 1)[-1]
            dictionary["auto_map"] = {self._auto_class: f"{module}.{type(self).__name__}"}
        video_auto_map = getattr(self.video_processor, "remote_code_auto_map", lambda: None)()
        if video_auto_map and isinstance(dictionary.get("video_processor"), dict):
            dictionary["video_processor"]["auto_map"] = video_auto_map
        return json.dumps(dictionary, indent=2, sort_keys=True) + "\n"


def load_testa_processor(source: str | os.PathLike, trust_remote_code: bool | None = None, **kwargs: Any) -> "TestaProcessor":
    """Loads a saved `TestaProcessor` with this module's own classes (`TestaVideoProcessor` from the nested
    `processor_config.json`, the tokenizer from `tokenizer.json`).

    The tokenizer goes through `AutoTokenizer`, which reads the folder's `config.json` (and its `auto_map`):
    `trust_remote_code` is passed to it, so that a folder whose custom code the caller already trusts is never
    asked about again ("Do you wish to run the custom code?") nor, without a terminal, refused.

    Args:
        source (`str` or `os.PathLike`): a folder or Hub repo holding a saved processor.
        trust_remote_code (`bool`, *optional*): the caller's answer for the custom code of `source`.
    """
    from transformers import AutoTokenizer

    video_processor = TestaVideoProcessor.from_pretrained(source, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    return TestaProcessor(video_processor=video_processor, tokenizer=tokenizer)


VIDEO_FILE_NAME = re.compile(r"^\S+(" + "|".join(re.escape(s) for s in VIDEO_SUFFIXES) + ")$", re.IGNORECASE)
"""A text that is only a video file name: no caption or question looks like this, but a video path that a caller
(e.g. Sentence Transformers, for a file that does not exist or an extension it does not know) passed as text does."""


def check_not_video_paths(texts: list[str]) -> None:
    """Raises `ValueError` for a text that is a video file name: embedding a path as text gives a silently wrong
    answer. Pass videos as videos (with Sentence Transformers: `{"video": path}`)."""
    for i, text in enumerate(texts):
        if isinstance(text, str) and VIDEO_FILE_NAME.match(text.strip()):
            state = "does not exist" if not os.path.exists(text.strip()) else "exists"
            raise ValueError(
                f"text[{i}] = {text!r} is a video file name, not text (the file {state}). Pass videos as videos: with "
                "Sentence Transformers, `model.encode_document([{'video': path}])`; a missing file then raises "
                "naming it."
            )


def _check_task(task: str | None) -> None:
    if task is not None and task not in TASK_TEXT_SETTINGS:
        raise ValueError(f"Unknown task={task!r}; use one of {sorted(TASK_TEXT_SETTINGS)} or None.")


TestaProcessor.register_for_auto_class()

__all__ = [
    "DEC_TOKEN",
    "ENC_TOKEN",
    "TASK_CAPTION_WORDS",
    "TASK_TEXT_SETTINGS",
    "check_not_video_paths",
    "load_testa_processor",
    "TestaProcessor",
    "build_testa_tokenizer",
    "pre_caption",
]
