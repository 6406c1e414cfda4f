"""TESTA's matching head as a Sentence Transformers `CrossEncoder` input module: scores (text, video) pairs.

A folder written by `save_cross_encoder(model, processor, folder)` loads with
``CrossEncoder(folder, trust_remote_code=True)``; then ``ce.rank(paragraph, video_paths)`` re-ranks videos and
``ce.predict([(text, video), ...])`` scores pairs. A pair's score is the ITM "match" logit (or its softmax,
``itm_score="softmax"``) plus, by default, the cosine of the contrastive embeddings: `rank_videos`' score, computed by
the library's one implementation (`ranking.pair_scores`), so ``rank`` equals `rank_videos` over the same candidates
(order and scores; ties keep the candidates' order, as `ranking.ranked_order` does).

Every video is decoded and encoded once: its aggregated tokens and embedding are cached per path (``cache_size``
videos, least recently used first out), so Q queries over the same N candidates decode N videos, not Q x N. A video
is a path, ``{"video": path}``, or frames (array/tensor/list, encoded each time they are given).

This file is Hub remote code (it needs `sentence-transformers` installed): flat relative imports only.
"""

import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from sentence_transformers.base.modules import InputModule

from .modeling_testa import TestaForVideoTextRetrieval
from .processing_testa import TestaProcessor, load_testa_processor
from .ranking import check_itm_score, encode_video_batch, pair_scores
from .saving import SENTENCE_TRANSFORMERS_HEADS, write_sentence_transformers_files


def _is_video(item: Any) -> bool:
    """A pair element that can only be a video: ``{"video": ...}``, frames, or the path of an existing file."""
    if isinstance(item, dict):
        return "video" in item
    if isinstance(item, (str, os.PathLike)):
        return os.path.isfile(item)
    return not isinstance(item, str)


class TestaVideoTextMatcher(InputModule):
    """Scores (text, video) pairs with a TESTA retrieval model's matching head; see the module docstring.

    Args:
        model: a `TestaForVideoTextRetrieval`.
        processor: its `TestaProcessor`.
        itm_score (`str`, defaults to `"logit"`): `"logit"` or `"softmax"` (see `ranking.ITM_SCORES`).
        add_cosine (`bool`, defaults to `True`): add the contrastive cosine, as the original evaluation does.
        cache_size (`int`, defaults to 4096): videos whose tokens are kept (by path).
        batch_size (`int`, defaults to 32): pairs per matching-head forward.
    """

    config_keys = ["itm_score", "add_cosine", "cache_size", "batch_size"]
    config_file_name = "testa_cross_encoder_config.json"

    def __init__(self, model: TestaForVideoTextRetrieval, processor: TestaProcessor, itm_score: str = "logit",
                 add_cosine: bool = True, cache_size: int = 4096, batch_size: int = 32) -> None:
        super().__init__()
        check_itm_score(itm_score)
        self.model, self.processor = model, processor
        self.tokenizer = processor.tokenizer
        self.itm_score, self.add_cosine = itm_score, bool(add_cosine)
        self.cache_size, self.batch_size = int(cache_size), int(batch_size)
        self.cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.videos_encoded = 0  # how many videos were decoded and encoded (the cache's misses)

    @property
    def modalities(self) -> list[str]:
        return ["text", "video"]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_seq_length(self) -> int:
        return self.model.config.max_position_embeddings

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        """Tokenizes the texts of ``(text, video)`` pairs (either order) and keeps the videos for `forward`."""
        texts, videos = [], []
        for i, pair in enumerate(inputs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"inputs[{i}] must be a (text, video) pair, got {type(pair).__name__}.")
            first, second = pair
            text, video = (second, first) if _is_video(first) and not _is_video(second) else (first, second)
            if not isinstance(text, str):
                raise ValueError(f"inputs[{i}] has no text: a pair is (text, video), got ({type(first).__name__}, "
                                 f"{type(second).__name__}).")
            texts.append((prompt or "") + text)
            videos.append(video["video"] if isinstance(video, dict) else video)
        encoded = self.processor(text=texts, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "videos": videos}

    @torch.no_grad()
    def _encode(self, video: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens (1, T, D), embedding (1, P))`` of one video, from the cache when it is a path seen before."""
        key = os.path.abspath(os.fspath(video)) if isinstance(video, (str, os.PathLike)) else None
        if key is not None and key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        pixel_values = self.processor(videos=[video], return_tensors="pt")["pixel_values"]
        tokens, _, features = encode_video_batch(self.model, pixel_values.to(self.model.device, self.model.dtype))
        self.videos_encoded += 1
        encoded = (tokens, features)
        if key is not None and self.cache_size > 0:
            self.cache[key] = encoded
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return encoded

    @torch.no_grad()
    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        device = self.model.device
        input_ids = features["input_ids"].to(device)
        attention_mask = features["attention_mask"].to(device)
        encoded = [self._encode(video) for video in features["videos"]]
        tokens = torch.cat([t for t, _ in encoded])
        scores = pair_scores(self.model, input_ids, attention_mask, lambda index: tokens[index],
                             torch.cat([f for _, f in encoded]), itm_score=self.itm_score,
                             add_cosine=self.add_cosine, batch_size=self.batch_size)
        return {**features, "scores": scores}

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        save_cross_encoder(self.model, self.processor, output_path, **self.get_config_dict())

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             **kwargs: Any) -> "TestaVideoTextMatcher":
        hub = {"token": token, "cache_dir": cache_folder, "revision": revision, "local_files_only": local_files_only}
        if subfolder:
            hub["subfolder"] = subfolder
        config = cls.load_config(model_name_or_path, subfolder=subfolder, token=token, cache_folder=cache_folder,
                                 revision=revision, local_files_only=local_files_only)
        model = TestaForVideoTextRetrieval.from_pretrained(model_name_or_path, **hub).eval()
        processor = load_testa_processor(model_name_or_path, trust_remote_code=kwargs.get("trust_remote_code"), **hub)
        return cls(model, processor, **config)


def save_cross_encoder(model: Any, processor: Any, save_directory: str | os.PathLike, **options: Any) -> Path:
    """Saves `model` and `processor` as a Sentence Transformers `CrossEncoder` folder: the model's files, the
    re-ranker module's code (`cross_encoder.py`, with the model code it imports) and its settings.

    `CrossEncoder(save_directory, trust_remote_code=True)` then scores (text, video) pairs with the matching head
    (`.predict`, `.rank`). One folder cannot be both a `SentenceTransformer` and a `CrossEncoder` (one
    `modules.json`), so this is a second folder (or Hub repo) beside the model's own.

    Args:
        options: the re-ranker's settings (`itm_score`, `add_cosine`, `cache_size`, `batch_size`; see
            `TestaVideoTextMatcher`).
    """
    if type(model).__name__ not in SENTENCE_TRANSFORMERS_HEADS:
        raise TypeError(f"A re-ranker needs a retrieval model ({', '.join(SENTENCE_TRANSFORMERS_HEADS)}), got "
                        f"{type(model).__name__}.")
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sentence_bert_config.json").unlink(missing_ok=True)  # a bi-encoder's, if the folder held one
    write_sentence_transformers_files(directory, "cross-encoder")  # first: save_pretrained keeps a modules.json
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    from transformers.dynamic_module_utils import get_relative_import_files

    source = Path(__file__).resolve()
    for module in (source, *map(Path, get_relative_import_files(source))):
        target = directory / module.name
        if module.resolve() != target.resolve():
            shutil.copyfile(module, target)
    settings = {"itm_score": "logit", "add_cosine": True, "cache_size": 4096, "batch_size": 32, **options}
    (directory / "testa_cross_encoder_config.json").write_text(json.dumps(settings, indent=2) + "\n",
                                                              encoding="utf-8")
    return directory


__all__ = ["TestaVideoTextMatcher", "save_cross_encoder"]
