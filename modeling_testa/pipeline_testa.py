"""Pipelines for TESTA: video-text retrieval, zero-shot video classification and video question answering.

Three tasks are registered with `transformers.pipelines.PIPELINE_REGISTRY` and written to `config.json`
(`custom_pipelines`) by every TESTA `save_pretrained`, so that a saved folder or Hub repo loads with
`pipeline(task, model=folder, trust_remote_code=True)`:

- `"video-text-retrieval"` ([`VideoTextRetrievalPipeline`]): `pipe(text=..., videos=[...], top_k=None)` ranks the
  videos for each query with the two-stage ranking of the original (cosine of the contrastive embeddings picks the
  `config.k_test` candidates, the matching head re-scores them; with `top_k=None` the other videos follow, ordered by
  cosine, each result saying whether it was re-ranked). Each video is decoded and encoded once per call, whatever the
  number of queries. `encode_videos` builds a [`VideoIndex`] (embeddings and, optionally, the aggregated tokens for
  re-ranking) that can be saved, loaded and searched (`search`) without decoding the videos again.
- `"zero-shot-video-classification"` ([`ZeroShotVideoClassificationPipeline`]): `pipe(video, candidate_labels=[...],
  hypothesis_template="a video of {}.")` returns labels with scores that sum to 1: a softmax over the cosine
  similarities divided by the model's learned contrastive temperature, as zero-shot-image-classification does with
  CLIP's logit scale.
- `"video-question-answering"` ([`VideoQuestionAnsweringPipeline`]): `pipe(video=..., question=...)` generates
  answers (beam search, 3 beams and `max_length=10` as the released code, unless the model's `generation_config` says
  otherwise) scored by their sequence probability, or, with `candidate_answers=[...]`, ranks the candidates like the
  released `rank_answer` (`TestaForVideoQA.rank_answers`).

Every pipeline needs a [`TestaProcessor`]: save it next to the model (`processor.save_pretrained(folder)`), or pass
`processor=` (or `tokenizer=` and `video_processor=`). Bad input raises at once and names the input: a missing file
raises `FileNotFoundError` with its path, an undecodable one the video processor's `VideoDecodingError` (a
`ValueError` with the file and the decoder's reason) unchanged, and empty lists or arrays of the wrong rank or
channel count raise `ValueError`. The exception is `VideoTextRetrievalPipeline.encode_videos`, which indexes a
collection: there a file that cannot be read is data (`index.failures`, video -> reason) and the others are indexed
(`on_error="raise"` raises instead).

This file is Hub remote code (flat relative imports only). `encode_videos`, `search` and `precision=` run the
library's `testa_search` and `testa_runtimes`, imported when called (`library`): they are not in a Hub folder.
"""

import importlib
import os
import re
from typing import Any

import torch
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.base import Pipeline
from transformers.utils import logging

from .processing_testa import TestaProcessor, load_testa_processor
from .ranking import encode_video_batch, ranked_order
from .saving import check_savable, push_folder_to_hub
from .video_inputs import check_video, is_array, is_single_video, text_list, video_list


logger = logging.get_logger(__name__)

PROGRESS_BAR_MIN_VIDEOS = 16
"""With `progress_bar=None`, a progress bar is shown when at least this many videos are encoded."""


def show_progress(count: int, progress_bar: bool | None) -> bool:
    """Whether encoding `count` videos shows a progress bar: `progress_bar`, or from `PROGRESS_BAR_MIN_VIDEOS` on."""
    return (count >= PROGRESS_BAR_MIN_VIDEOS) if progress_bar is None else bool(progress_bar)


LIBRARY = "the TESTA library (`pip install testa-hf`)"


def library(module: str, feature: str) -> Any:
    """The library's `module` (e.g. `testa_search.pipeline_methods`), which `feature` of a pipeline runs on. The
    search system and the runtimes are not Hub code: a pipeline loaded from a Hub folder without the library installed
    raises an `ImportError` saying in one line what to install. (Imported by name at call time, so that transformers,
    which checks a Hub file's imports when it loads it, does not ask for them.)"""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{feature} needs {LIBRARY}; it is not in a Hub folder: {error}") from error


# ----------------------------------------------------------------------------------------------------------------------
# Input checking
# ----------------------------------------------------------------------------------------------------------------------


def _given(**values: Any) -> dict[str, Any]:
    """The keyword arguments that were given (not None): the entries a pipeline call adds to its parameters."""
    return {name: value for name, value in values.items() if value is not None}


def _common_parameters(
    pipeline: Any, unused: dict, text_kwargs: dict | None, video_kwargs: dict | None, num_frames: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call arguments every TESTA pipeline takes: raises a `TypeError` naming unknown ones; returns the preprocess
    entry for `text_kwargs` (empty when not given) and the video-processor keyword arguments with the `num_frames`
    shortcut folded in."""
    if unused:
        raise TypeError(f"{type(pipeline).__name__} got unexpected arguments {sorted(unused)}.")
    return _given(text_kwargs=text_kwargs), {**(video_kwargs or {}), **_given(num_frames=num_frames)}


def check_top_k(top_k: Any) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"`top_k` must be a positive int or None, got {top_k!r}.")


def check_rerank_k(rerank_k: Any) -> None:
    if isinstance(rerank_k, bool) or not isinstance(rerank_k, int) or rerank_k < 1:
        raise ValueError(
            f"`rerank_k` must be a positive int (the candidates re-ranked per query), got {rerank_k!r}."
        )


def _result_list(items: list[Any], scores: torch.Tensor, similarity: torch.Tensor, top_k: int | None) -> list[dict]:
    """One query's result list, in the order of `ranking.ranked_order`: the re-ranked items (finite ``scores``) by
    decreasing two-stage score, then the other items (finite ``similarity``) by decreasing cosine; ties by index.
    The first ``top_k`` entries (all for None), each ``{"video", "score", "reranked"}``."""
    results = []
    for i in ranked_order(scores, similarity, top_k):
        reranked = bool(torch.isfinite(scores[i]))
        results.append({"video": items[i], "score": float(scores[i] if reranked else similarity[i]),
                        "reranked": reranked})
    return results


_RETRIEVAL_FOLDER = "a TestaForVideoTextRetrieval folder (e.g. `make demo`'s outputs/demo/runs/b/final)"
_HEAD_FOR_TASK = {
    "video-text-retrieval": _RETRIEVAL_FOLDER,
    "zero-shot-video-classification": _RETRIEVAL_FOLDER,
    "video-question-answering": "a TestaForVideoQA folder (e.g. `make demo`'s outputs/demo/qa/final, or one trained by "
                                "train.finetune_qa)",
}


def _check_weights(model: Any, task: str) -> None:
    """Refuses a model whose checkpoint lacked weights (`weights_missing_at_load`, recorded by `from_pretrained`):
    they were initialised at random, which transformers only logs, and the pipeline would answer nonsense. The
    message names the missing modules, what the folder holds and what the task needs."""
    missing = tuple(getattr(model, "weights_missing_at_load", None) or ())
    if not missing:
        return
    modules: dict[str, int] = {}
    for key in missing:
        modules[key.split(".")[0]] = modules.get(key.split(".")[0], 0) + 1
    listed = ", ".join(f"{name} ({count} tensor{'s' if count > 1 else ''})" for name, count in modules.items())
    source = getattr(model, "name_or_path", None) or "the checkpoint"
    held = (getattr(model.config, "architectures", None) or ["another model"])[0]
    raise ValueError(
        f"{task}: {source!r} lacks weights that {type(model).__name__} needs: {listed}; they would be random and "
        f"the answers nonsense. It holds a {held}; {task} needs {_HEAD_FOR_TASK.get(task, 'a folder of its head')}."
    )


def _is_remote_code(obj: Any) -> bool:
    """Whether `obj`'s class was loaded as Hub remote code (its module lives in `transformers_modules`), which
    transformers only does after the user passed `trust_remote_code=True` for that repository."""
    return type(obj).__module__.split(".")[0] == "transformers_modules"


# ----------------------------------------------------------------------------------------------------------------------
# Shared pipeline machinery
# ----------------------------------------------------------------------------------------------------------------------


class _TestaPipeline(Pipeline):
    """Loads the `TestaProcessor`, turns videos into `pixel_values` one at a time (so errors name the input), and
    saves complete Hub folders."""

    # The processor is loaded by `__init__` (from the model's folder or repo) rather than by `pipeline()`: `pipeline()`
    # passes its model `dtype` (default "auto") to `AutoProcessor.from_pretrained`, which the video processor would take
    # as its own `dtype` (the dtype of `pixel_values`) and reject.
    _load_processor = False
    _load_tokenizer = False
    _load_video_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _auto_model_classes: tuple[str, ...] = ("AutoModel",)

    def __init__(self, model: Any, processor: Any = None, tokenizer: Any = None, video_processor: Any = None,
                 trust_remote_code: bool | None = None, precision: str | None = None, compile: bool = False,
                 include_text: bool = False, backend: str = "torch", isolate: bool = False, **kwargs: Any) -> None:
        """
        Args:
            model: a TESTA model of the head the task needs.
            processor (`TestaProcessor`, `str` or `os.PathLike`, *optional*): the processor, or where to load it from.
                Defaults to the processor saved with the model (`model.name_or_path`), or to one built from
                `tokenizer` and `video_processor` when both are given.
            tokenizer, video_processor (*optional*): override the processor's components.
            trust_remote_code (`bool`, *optional*): passed to every load of the processor. `pipeline()` does not
                hand its own `trust_remote_code` to the pipeline class, so when it is unset and the processor comes
                from the model's own folder or repo, it is `True` if the model's class is Hub remote code (the user
                already trusted that repository's code to load the model).
            precision (`str`, *optional*): `"fp32"`, `"bf16"` or `"int8"`: prepares the model with
                `optimize_for_inference(model, precision, compile=compile, include_text=include_text)` (in place,
                after it is moved to the pipeline's device). `None` (default) leaves the model as it is. An
                optimized pipeline cannot be saved (`save_pretrained` raises).
            compile, include_text (`bool`, defaults to `False`): passed to `optimize_for_inference` with `precision`.
            backend (`str`, defaults to `"torch"`): passed to `optimize_for_inference` with `precision`: the runtime
                of the video encoder by name (`testa_runtimes`): `"torch"` (eager; CUDA graphs on a GPU), `"openvino"`
                or `"onnxruntime"` (an exported graph, see `testa_runtimes.exported`), `"torch-eager"`, `"cuda-graphs"`.
            isolate (`bool`, defaults to `False`): passed to `optimize_for_inference`: an exported engine runs in a
                worker process of its own (for long-lived processes).
            **kwargs: `device`, `batch_size`, and call arguments that become defaults (e.g. `top_k`).
        """
        _check_weights(model, self._default_task)
        source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
        # the model's own folder/repo: its code was trusted when the model was loaded as remote code
        trusted = True if trust_remote_code is None and _is_remote_code(model) else trust_remote_code
        if isinstance(processor, (str, os.PathLike)):
            same_source = source is not None and os.fspath(processor) == os.fspath(source)
            processor = load_testa_processor(
                processor, trust_remote_code=trusted if same_source else trust_remote_code
            )
        if processor is None and tokenizer is not None and video_processor is not None:
            processor = TestaProcessor(video_processor=video_processor, tokenizer=tokenizer)
        if processor is None:
            reason = "the model has no `name_or_path` to load it from"
            if source:
                try:
                    processor = load_testa_processor(source, trust_remote_code=trusted)
                except Exception as error:  # noqa: BLE001 - reported below with the remedy
                    reason = f"loading it from {source!r} failed: {type(error).__name__}: {error}"
            if processor is None:
                raise ValueError(
                    f"{type(self).__name__} needs a TestaProcessor ({reason}). Save it next to the model "
                    "(`processor.save_pretrained(folder)`) or pass `processor=` (or `tokenizer=` and "
                    "`video_processor=`)."
                )
        if not (hasattr(processor, "tokenizer") and hasattr(processor, "video_processor")):
            raise TypeError(
                f"`processor` must be a TestaProcessor (or a folder/repo holding one), got {type(processor).__name__}."
            )
        tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
        video_processor = video_processor if video_processor is not None else processor.video_processor
        super().__init__(
            model=model, processor=processor, tokenizer=tokenizer, video_processor=video_processor, **kwargs
        )
        if precision is not None:
            library("testa_runtimes", "precision=").optimize_for_inference(
                self.model, precision, backend=backend, compile=compile, include_text=include_text, isolate=isolate)
        elif compile or include_text or isolate or backend != "torch":
            raise ValueError("`compile`, `include_text`, `isolate` and `backend` go with `precision` (e.g. "
                             "precision='fp32', compile=True, or precision='int8', backend='openvino').")

    # -- inputs -----------------------------------------------------------------------------------------------------

    def tokenize(self, texts: list[str], text_kwargs: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        encoded = self.processor(text=texts, return_tensors="pt", **(text_kwargs or {}))
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def pixel_values(self, item: Any, label: str, video_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
        """`(1, frames, 3, H, W)` pixel values of one video. Decoding errors of files propagate unchanged (they name
        the file); errors about in-memory videos are re-raised naming `label`."""
        is_path = isinstance(item, (str, os.PathLike))
        argument = item if is_path or is_array(item) else [list(item)]
        try:
            pixels = self.video_processor(argument, return_tensors="pt", **(video_kwargs or {}))["pixel_values"]
        except (ValueError, TypeError) as error:
            if is_path:
                raise
            message = re.sub(r"^videos(\[\d+\])*", label, str(error))
            if not message.startswith(label):
                message = f"{label}: {message}"
            raise type(error)(message) if type(error) in (ValueError, TypeError) else ValueError(message) from error
        return pixels

    def _progress(self, total: int, progress_bar: bool | None, desc: str) -> Any:
        return logging.tqdm(total=total, desc=desc, unit="video", disable=not show_progress(total, progress_bar))

    # -- saving -----------------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Saves a complete Hub folder: the model (weights, config with `auto_map` and `custom_pipelines`, all code
        files), the processor (tokenizer + video processor, which transformers' `Pipeline.save_pretrained` leaves
        out) and the model card with the video-processor settings."""
        check_savable(self.model)  # an optimized model (`precision=`) is for inference only; nothing is written
        if os.path.isfile(save_directory):
            raise ValueError(f"`save_directory` must be a directory, got the file {os.fspath(save_directory)!r}.")
        os.makedirs(save_directory, exist_ok=True)
        from transformers.dynamic_module_utils import custom_object_save

        entry = {
            "impl": f"{type(self).__module__.split('.')[-1]}.{type(self).__name__}",
            "pt": list(self._auto_model_classes),
            "type": "multimodal",
        }
        existing = dict(getattr(self.model.config, "custom_pipelines", None) or {})
        self.model.config.custom_pipelines = {**existing, self.task or self._default_task: entry}
        custom_object_save(self, save_directory)
        self.model.save_pretrained(save_directory, **kwargs)
        self.processor.save_pretrained(save_directory)
        if hasattr(self.model, "write_model_card"):
            self.model.write_model_card(save_directory, processor=self.processor)

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> Any:
        """Saves with `save_pretrained` and uploads the folder, keeping the generated model card (see
        `TestaHubMixin.push_to_hub`)."""
        return push_folder_to_hub(self, repo_id, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# video-text-retrieval
# ----------------------------------------------------------------------------------------------------------------------


class VideoTextRetrievalPipeline(_TestaPipeline):
    r"""
    Text-to-video retrieval with a TESTA retrieval model (`TestaForVideoTextRetrieval`).

    ```python
    pipe = pipeline("video-text-retrieval", model="path/or/repo", trust_remote_code=True)
    pipe(text="a man surfs", videos=["a.mp4", "b.mp4"])             # [{"video": "b.mp4", "score": 3.1}, ...]
    pipe(text=["a man surfs", "a dog"], videos=paths, top_k=5)      # one ranked list per query
    index = pipe.encode_videos(paths, batch_size=8)                 # encode a large collection once
    index.save("index_dir"); index = VideoIndex.load("index_dir")
    pipe.search("a man surfs", index, top_k=10)
    ```

    Ranking is the original two-stage one (`model.rank_videos`): the cosine similarity of the contrastive embeddings
    selects `rerank_k` candidates per query (default `config.k_test`, as in the paper's evaluation, and at least
    `top_k`), and the matching (ITM) head re-scores them. The cost of the matching head therefore grows with
    `rerank_k`, not with the size of the collection.

    What is returned, per query (each item is `{"video", "score", "reranked"}`):

    - `top_k=<int>`: the `top_k` best re-ranked videos, by decreasing score.
    - `top_k=None` (default): **all** videos. First the `min(rerank_k, num_videos)` re-ranked candidates by decreasing
      score (`"reranked": True`), then every other video by decreasing cosine similarity (`"reranked": False`). As in
      the original evaluation (where non-candidates score -100), a re-ranked video always comes before a video that
      was not re-ranked, whatever the numbers.

    `"score"` of a re-ranked video is the ITM match logit plus the cosine (`itm_score="softmax"`: the match
    probability instead of the logit; `add_cosine=False`: without the cosine). `"score"` of a video that was not
    re-ranked is its cosine similarity (in [-1, 1]); the two kinds of score are not comparable with each other.
    To re-rank every video, pass `rerank_k=len(videos)` (or any larger number).

    Call arguments: `text` (str or list of str), `videos` (list of paths, 4-D arrays or frame lists), `top_k`,
    `rerank_k`, `itm_score`, `add_cosine`, `batch_size` (videos encoded at a time, default 8), `num_frames` (and any
    other video-processor argument via `video_kwargs={...}`), `text_kwargs={...}` (e.g. `{"task": "didemo"}`),
    `progress_bar` (default: shown from 16 videos on).
    """

    _default_task = "video-text-retrieval"

    def _sanitize_parameters(
        self,
        top_k: int | None = None,
        rerank_k: int | None = None,
        itm_score: str | None = None,
        add_cosine: bool | None = None,
        num_frames: int | None = None,
        video_kwargs: dict[str, Any] | None = None,
        text_kwargs: dict[str, Any] | None = None,
        progress_bar: bool | None = None,
        video_batch_size: int | None = None,
        **unused: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        preprocess, video_kwargs = _common_parameters(self, unused, text_kwargs, video_kwargs, num_frames)
        forward, postprocess = {}, {}
        if video_kwargs:
            forward["video_kwargs"] = video_kwargs
        if rerank_k is not None:
            check_rerank_k(rerank_k)
        forward.update(_given(rerank_k=rerank_k, itm_score=itm_score, add_cosine=add_cosine,
                              progress_bar=progress_bar, video_batch_size=video_batch_size))
        if top_k is not None:
            check_top_k(top_k)
            forward["top_k"] = top_k
            postprocess["top_k"] = top_k
        return preprocess, forward, postprocess

    def __call__(self, text: str | list[str] | None = None, videos: list[Any] | None = None, **kwargs: Any) -> Any:
        """Ranks `videos` for each query in `text`.

        Returns:
            For one query, a list of `{"video": <the given item>, "score": float, "reranked": bool}` (see the class
            docstring for the order and what the scores mean); for a list of queries, one such list per query.
        """
        kwargs.update(_given(video_batch_size=kwargs.pop("batch_size", None)))  # videos encoded at a time
        return super().__call__({"text": text, "videos": videos}, **kwargs)

    def preprocess(self, inputs: dict[str, Any], text_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        texts, single = text_list(inputs.get("text"), "text")
        videos = video_list(inputs.get("videos"), "videos")
        return {**self.tokenize(texts, text_kwargs), "videos": videos, "single": single}

    def _forward(
        self,
        model_inputs: dict[str, Any],
        top_k: int | None = None,
        rerank_k: int | None = None,
        itm_score: str = "logit",
        add_cosine: bool = True,
        video_kwargs: dict[str, Any] | None = None,
        progress_bar: bool | None = None,
        video_batch_size: int | None = None,
    ) -> dict[str, Any]:
        videos = model_inputs["videos"]
        embeddings, tokens, token_sizes = self.encode_for_ranking(
            videos, video_batch_size or self._batch_size or 8, progress_bar, video_kwargs)
        ranking = self.model.rank_videos(
            model_inputs["input_ids"],
            tokens,
            attention_mask=model_inputs["attention_mask"],
            video_token_sizes=token_sizes,
            video_features=embeddings,
            k=self.rerank_depth(len(videos), top_k, rerank_k),
            itm_score=itm_score,
            add_cosine=add_cosine,
        )
        return {
            "scores": ranking.scores.float().cpu(),
            "similarity": ranking.similarity.float().cpu(),
            "videos": videos,
            "single": model_inputs["single"],
        }

    @torch.no_grad()
    def encode_for_ranking(self, videos: list[Any], batch_size: int, progress_bar: bool | None = None,
                           video_kwargs: dict[str, Any] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(embeddings, tokens, token sizes or None)`` of `videos` (in the order given), encoded `batch_size` at a
        time: embeddings in float32, tokens in the model's dtype, on the CPU, as an in-memory `encode_videos` index
        holds them. A video that cannot be read raises, naming it."""
        embeddings, tokens, token_sizes = [], [], []
        dtype = getattr(self.model, "dtype", torch.float32)
        with self._progress(len(videos), progress_bar, "Encoding videos") as bar:
            for first in range(0, len(videos), batch_size):
                batch = videos[first : first + batch_size]
                pixels = torch.cat([self.pixel_values(video, f"videos[{first + i}]", video_kwargs)
                                    for i, video in enumerate(batch)])
                batch_tokens, sizes, features = encode_video_batch(self.model, pixels.to(self.device, dtype=dtype))
                embeddings.append(features.float().cpu())
                tokens.append(batch_tokens.detach().cpu())
                if sizes is not None:  # an encoder whose every token is one patch reports none
                    token_sizes.append(sizes.detach().float().cpu())
                bar.update(len(batch))
        return torch.cat(embeddings), torch.cat(tokens), (torch.cat(token_sizes) if token_sizes else None)

    def rerank_depth(self, num_videos: int, top_k: int | None, rerank_k: int | None) -> int:
        """Candidates re-ranked per query: `max(top_k, rerank_k or config.k_test)` (`top_k=None` counts as 0),
        capped at the number of videos."""
        if rerank_k is not None:
            check_rerank_k(rerank_k)
        base = rerank_k if rerank_k is not None else self.model.config.k_test
        return min(num_videos, max(top_k or 0, base))

    def postprocess(self, model_outputs: dict[str, Any], top_k: int | None = None) -> Any:
        videos = model_outputs["videos"]
        results = []
        for scores, similarity in zip(model_outputs["scores"], model_outputs["similarity"]):
            results.append(_result_list(videos, scores, similarity, top_k))
        return results[0] if model_outputs["single"] else results

    # -- encode once, search many times ------------------------------------------------------------------------------

    def encode_videos(
        self,
        videos: list[Any],
        batch_size: int = 8,
        store_tokens: bool = True,
        token_dtype: torch.dtype | None = None,
        progress_bar: bool | None = None,
        store_dir: str | os.PathLike | None = None,
        num_workers: int = 0,
        on_error: str = "skip",
        index: "VideoIndex | None" = None,
        window: float | None = None,
        stride: float | None = None,
        **video_kwargs: Any,
    ) -> "VideoIndex":
        """Decodes and encodes every video once and returns a [`VideoIndex`].

        Args:
            videos (`list`): paths, 4-D arrays/tensors or frame lists, or `testa_search.homes.IndexEntry` rows (a video
                with a `dataset` name, carried into the index and search results, to filter by; or a moment of a
                video file, with `start`/`end`, decoded as `window=` decodes its windows). A video (or moment) given
                twice is one row.
            batch_size (`int`, defaults to 8): videos per encoder forward.
            store_tokens (`bool`, defaults to `True`): keep the aggregated tokens so that `search` can re-rank with
                the matching head; `False` keeps only the embeddings (much smaller; not with `store_dir`).
            token_dtype (`torch.dtype`, *optional*): store the tokens in this dtype (e.g. `torch.float16`). In
                memory the default is the model's dtype; in a store it is `torch.float16` (pass `torch.float32` for
                results identical to `pipe(text, videos)`).
            progress_bar (`bool`, *optional*): show a tqdm bar (default: from 16 videos on). Its rate is videos/s;
                its postfix says which share of the time the encoder waited for decoded videos, and how many videos
                failed.
            store_dir (`str` or `os.PathLike`, *optional*): write the tokens to an on-disk video store in this
                directory as they are encoded (memory stays bounded by `batch_size`, whatever the collection) and
                return an index backed by it; `VideoIndex.load(store_dir)` reopens it later. Safe to run again: on an
                existing store (from this method or `python -m train.index`) the videos it lacks are appended (the
                same videos or a subset: nothing is encoded, the store is returned as it is; a build killed halfway
                is resumed), and a store built with other settings (model weights, frames, R_T/R_S, precision, token
                dtype, window) is refused with every difference named, before anything is encoded or written. One
                writer at a time (`testa_search.StoreLock`).
            num_workers (`int`, defaults to 0): decode in this many threads, each with its own decoder process
                (`isolate_decoder=True`), while the encoder runs: the next batches (up to two batches, and at least
                `num_workers` videos, ahead) are decoded during the current forward. 0 decodes each batch before
                encoding it, in this thread. The results are the same, in the same order, and a video that cannot be
                decoded fails the same way at the same point.
            on_error (`str`, defaults to `"skip"`): what a video file that cannot be read does (missing, empty, not a
                video, truncated, no frames, decoder crash or timeout). `"skip"`: it is left out of the index and
                recorded in `index.failures` (video -> reason, the reason starting with a code of
                `testa_search.encoding.FAILURE_CODES`); the progress bar counts the failures and a warning at the end lists them.
                Search never returns a failed video; the next call given it (`store_dir`, `index=`) tries it again
                (a failure is not a permanent verdict: the file may be repaired). `"raise"`: the decoder's error
                (naming the file) is raised and no index is returned. Bad arguments (e.g. an array of the wrong shape) always raise.
            index (`VideoIndex`, *optional*): an index to grow, in memory or store-backed. Videos already in it (by
                path and `start`/`end`) are skipped, the others are encoded and appended to it in place (a store gets
                a new shard, written and finished on disk), and it is returned.
                It must have been built with the same settings (frames, R_T/R_S, projection size, precision,
                window): another setting is refused, naming the difference, before anything is encoded.
            window (`float`, *optional*): index moments: every video file is cut into windows of this many seconds
                (`testa_search.moments.plan_windows`), each video streamed once for all its windows (memory bounded
                whatever its length), each window one row with its `start` and `end`; `search` then returns moments.
                Paths only; `num_frames` is the only video argument taken.
            stride (`float`, *optional*): seconds between window starts (default: `window`).
            **video_kwargs: video-processor arguments (`num_frames=...`).

        Raises:
            `testa_search.NoReadableVideoError` (a `ValueError`): no video of `videos` could be read (the message
                lists why; its `failures` hold every video's `Failure`).
            `ValueError`: a bad argument.
            `testa_search.settings.IndexSettingsError` (a `ValueError`): the index or store was built with other
                settings, or `store_dir` holds files that are not a video store; nothing in it changed.
            `testa_search.StoreLockedError`: another writer is writing the store.

        It runs `testa_search.build.IndexBuild`, the build `python -m train.index` runs too; the index's `stats` say
        how fast it went (videos/s, the time spent waiting for decoding and encoding, the failures).
        """
        return library("testa_search.pipeline_methods", "encode_videos").encode_videos(
            self, videos, batch_size=batch_size, store_tokens=store_tokens, token_dtype=token_dtype,
            progress_bar=progress_bar, store_dir=store_dir, num_workers=num_workers, on_error=on_error, index=index,
            window=window, stride=stride, **video_kwargs)

    def search(
        self,
        text: str | list[str],
        index: "SearchableIndex",
        top_k: int | None = 10,
        rerank: bool | None = None,
        rerank_k: int | None = None,
        itm_score: str = "logit",
        add_cosine: bool = True,
        use_faiss: bool | None = None,
        text_kwargs: dict[str, Any] | None = None,
        filters: dict[str, Any] | None = None,
        group_by: str | None = None,
    ) -> Any:
        """Searches an encoded collection without decoding any video: a `VideoIndex` (in memory or store-backed) or
        a `testa_search.milvus.MilvusIndex`, with payload `filters` (``{"folder": DIR}``: the videos under DIR;
        ``{"dataset": NAME or [NAMES]}``; ``{"video": PATH}``), applied before the first stage.

        The first stage takes the nearest videos by cosine (`VideoIndex.nearest`): with FAISS when installed
        (`use_faiss=None`; `True` requires it, `False` uses exact torch top-k), through the index's first stage,
        built once and kept (exact up to `EXACT_MAX_VIDEOS` encoded videos, approximate with exact re-scoring
        above); torch top-k otherwise. Only the candidates are scored and sorted, so with FAISS the work per query
        does not grow with the collection beyond the first stage's own. When the index holds the tokens (and
        `rerank` is not `False`), the matching head re-scores the `rerank_k` nearest ones (default `config.k_test`,
        at least `top_k`) exactly as the pipeline call does, so the results equal `pipe(text, videos, ...)` with the
        same arguments: with `top_k=None`, all videos, the re-ranked ones first (`"reranked": True`), then the others
        by cosine. Without tokens (or with `rerank=False`) every score is the cosine and nothing is re-ranked.

        An index of moments (`encode_videos(..., window=)`) is searched the same way, one row per moment, and every
        result also has `"start"` and `"end"` (seconds; `None` for a row that is a whole video). `group_by="video"`
        gives each video once, at its best moment (the whole ranking is scored, then grouped, then cut to `top_k`).

        Returns:
            Like the pipeline call: `[{"video", "score", "reranked"}]` per query, with the row's `"start"`/`"end"`
            (an index of moments) and `"dataset"` when it has them.

        Raises:
            ValueError: when the index was encoded by a model of another `projection_dim` or aggregation settings
                (`temporal_reduction`, `spatial_reduction`, as recorded in `index.info`), naming both values.
        """
        return library("testa_search.pipeline_methods", "search").search(
            self, text, index, top_k=top_k, rerank=rerank, rerank_k=rerank_k, itm_score=itm_score,
            add_cosine=add_cosine, use_faiss=use_faiss, text_kwargs=text_kwargs, filters=filters, group_by=group_by)


# ----------------------------------------------------------------------------------------------------------------------
# zero-shot-video-classification
# ----------------------------------------------------------------------------------------------------------------------


class ZeroShotVideoClassificationPipeline(_TestaPipeline):
    r"""
    Zero-shot video classification with a TESTA retrieval model.

    ```python
    pipe = pipeline("zero-shot-video-classification", model="path/or/repo", trust_remote_code=True)
    pipe("clip.mp4", candidate_labels=["surfing", "cooking"])  # [{"label": "surfing", "score": 0.93}, ...]
    pipe(["a.mp4", "b.mp4"], candidate_labels=[...])           # one list per video
    ```

    Each label becomes the text `hypothesis_template.format(label)`. The score of a label is the softmax, over the
    labels, of `cos(video embedding, text embedding) / temperature`, with the model's learned contrastive temperature
    (`model.logit_scale()`, clamped as in training): the same quantity the contrastive loss is trained on, and
    what zero-shot-image-classification computes with CLIP's logit scale. Scores sum to 1 and are sorted.

    Call arguments: the video(s) (a path, a 4-D array, a list of frames, or a list of those), `candidate_labels`,
    `hypothesis_template` (must contain `{}`), `top_k`, `batch_size` (videos per encoder forward), `num_frames`,
    `progress_bar`.
    """

    _default_task = "zero-shot-video-classification"

    def _sanitize_parameters(
        self,
        candidate_labels: list[str] | None = None,
        hypothesis_template: str | None = None,
        top_k: int | None = None,
        num_frames: int | None = None,
        video_kwargs: dict[str, Any] | None = None,
        text_kwargs: dict[str, Any] | None = None,
        **unused: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        preprocess, video_kwargs = _common_parameters(self, unused, text_kwargs, video_kwargs, num_frames)
        postprocess = {}
        preprocess.update(_given(candidate_labels=candidate_labels, hypothesis_template=hypothesis_template))
        if video_kwargs:
            preprocess["video_kwargs"] = video_kwargs
        if top_k is not None:
            check_top_k(top_k)
            postprocess["top_k"] = top_k
        return preprocess, {}, postprocess

    def __call__(self, videos: Any = None, **kwargs: Any) -> Any:
        """Classifies one video (returns `[{"label", "score"}]`) or a list of videos (a list of such lists)."""
        if videos is None:
            videos = kwargs.pop("video", None)
        if videos is None:
            raise ValueError(
                "Pass the video(s) to classify: a path, a 4-D array, a list of frames, or a list of those."
            )
        single = is_single_video(videos) or (is_array(videos) and videos.ndim != 5)
        items = [videos] if single else video_list(videos, "videos")
        if single:
            check_video(videos, "video")
        batch_size = kwargs.pop("batch_size", None) or self._batch_size or 8
        progress_bar = kwargs.pop("progress_bar", None)
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        self.call_count += 1
        results = []
        with self._progress(len(items), progress_bar, "Classifying videos") as bar:
            for start in range(0, len(items), batch_size):
                chunk = {"videos": items[start : start + batch_size], "offset": start, "single": single}
                results.extend(self.run_single(chunk, preprocess_params, forward_params, postprocess_params))
                bar.update(len(chunk["videos"]))
        return results[0] if single else results

    def preprocess(
        self,
        inputs: dict[str, Any],
        candidate_labels: list[str] | None = None,
        hypothesis_template: str = "a video of {}.",
        text_kwargs: dict[str, Any] | None = None,
        video_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if candidate_labels is None:
            raise ValueError("`candidate_labels` is missing; pass the list of class names to choose from.")
        labels, _ = text_list(candidate_labels, "candidate_labels")
        if not isinstance(hypothesis_template, str) or "{}" not in hypothesis_template:
            raise ValueError(f"`hypothesis_template` must be a string containing '{{}}', got {hypothesis_template!r}.")
        prompts = [hypothesis_template.format(label) for label in labels]
        pixels = [
            self.pixel_values(item, "video" if inputs["single"] else f"videos[{inputs['offset'] + j}]", video_kwargs)
            for j, item in enumerate(inputs["videos"])
        ]
        return {"pixel_values": torch.cat(pixels), **self.tokenize(prompts, text_kwargs), "candidate_labels": labels}

    def _forward(self, model_inputs: dict[str, Any]) -> dict[str, Any]:
        dtype = getattr(self.model, "dtype", torch.float32)
        video_features = self.model.get_video_features(
            model_inputs["pixel_values"].to(self.device, dtype=dtype)
        ).pooler_output
        text_features = self.model.get_text_features(model_inputs["input_ids"], model_inputs["attention_mask"]).pooler_output
        logits = (video_features @ text_features.to(video_features.dtype).T) / self.model.logit_scale().detach()
        return {"logits": logits, "candidate_labels": model_inputs["candidate_labels"]}

    def postprocess(self, model_outputs: dict[str, Any], top_k: int | None = None) -> list[list[dict[str, Any]]]:
        labels = model_outputs["candidate_labels"]
        results = []
        for row in model_outputs["logits"].float().softmax(dim=-1):
            order = torch.argsort(row, descending=True, stable=True).tolist()
            if top_k is not None:
                order = order[:top_k]
            results.append([{"label": labels[i], "score": float(row[i])} for i in order])
        return results


# ----------------------------------------------------------------------------------------------------------------------
# video-question-answering
# ----------------------------------------------------------------------------------------------------------------------


ANSWER_GENERATION_DEFAULTS = {"num_beams": 3, "max_length": 10}
"""How the question answering pipeline generates when neither the call nor the model's `generation_config` says
otherwise: beam search as the released code answers (TESTA `models/testa_vqa.py`, `generate(num_beams=3,
max_length=10, min_length=1)`, L111-L124). `TestaForVideoQA.generate` itself keeps transformers' defaults (greedy)."""


class VideoQuestionAnsweringPipeline(_TestaPipeline):
    r"""
    Video question answering with `TestaForVideoQA`.

    ```python
    pipe = pipeline("video-question-answering", model="path/or/repo", trust_remote_code=True)
    pipe(video="clip.mp4", question="what is the man doing?")                    # [{"answer": "surfing", "score": ..}]
    pipe(video="clip.mp4", question="...", candidate_answers=["surfing", "cooking"], top_k=2)
    ```

    - Without `candidate_answers` the answer is generated by the model (`generate_from_question`): with the call's
      generation arguments (`num_beams`, `max_length`, `max_new_tokens` or any `generate` argument in
      `generate_kwargs`), on top of the model's `generation_config`, on top of `ANSWER_GENERATION_DEFAULTS` (beam
      search, `num_beams=3, max_length=10`, as the released code answers). `top_k` answers are returned (the
      best beams), each scored by its **sequence probability** under the model (`answer_log_likelihoods`): the product
      of the decoder's probabilities of its tokens up to and including [SEP].
    - With `candidate_answers` the candidates are ranked like the released `rank_answer` (`model.rank_answers`):
      the `k` candidates with the most probable first token (`k = max(config.k_test, top_k)`) are scored by their
      full log-likelihood. The score is again the sequence probability (exact, `label_smoothing=0`; pass
      `label_smoothing=config.label_smoothing` to reproduce the released smoothed ranking score, whose exponential
      is then not a probability).

    `question` may be a list (one result list per question, for the same video).
    """

    _default_task = "video-question-answering"
    _auto_model_classes = ("AutoModelForVisualQuestionAnswering",)

    def _sanitize_parameters(
        self,
        candidate_answers: list[str] | None = None,
        top_k: int | None = None,
        label_smoothing: float | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        max_length: int | None = None,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        num_frames: int | None = None,
        video_kwargs: dict[str, Any] | None = None,
        text_kwargs: dict[str, Any] | None = None,
        **unused: Any,
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        preprocess, video_kwargs = _common_parameters(self, unused, text_kwargs, video_kwargs, num_frames)
        forward, postprocess = {}, {}
        preprocess.update(_given(candidate_answers=candidate_answers))
        if video_kwargs:
            preprocess["video_kwargs"] = video_kwargs
        if top_k is not None:
            check_top_k(top_k)
            forward["top_k"] = top_k
        forward.update(_given(label_smoothing=label_smoothing))
        generate_kwargs = {**(generate_kwargs or {}),
                           **_given(max_length=max_length, max_new_tokens=max_new_tokens, num_beams=num_beams)}
        if generate_kwargs:
            forward["generate_kwargs"] = generate_kwargs
        return preprocess, forward, postprocess

    def __call__(self, video: Any = None, question: str | list[str] | None = None, **kwargs: Any) -> Any:
        """Answers `question` (a string or a list of strings) about `video`.

        Returns:
            `[{"answer": str, "score": float}]` (best first, `top_k` entries, default 1); a list of such lists when
            `question` is a list.
        """
        if isinstance(video, dict) and question is None:
            video, question = video.get("video"), video.get("question")
        return super().__call__({"video": video, "question": question}, **kwargs)

    def preprocess(
        self,
        inputs: dict[str, Any],
        candidate_answers: list[str] | None = None,
        text_kwargs: dict[str, Any] | None = None,
        video_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        video = inputs.get("video")
        if video is None:
            raise ValueError("`video` is missing; pass a path, a 4-D array or a list of frames.")
        check_video(video, "video")
        questions, single = text_list(inputs.get("question"), "question")
        model_inputs = self.tokenize(questions, text_kwargs)
        model_inputs["pixel_values"] = self.pixel_values(video, "video", video_kwargs)
        model_inputs["single"] = single
        if candidate_answers is not None:
            answers, _ = text_list(candidate_answers, "candidate_answers")
            encoded = self.tokenizer(answers, padding="longest", truncation=True, return_tensors="pt")
            model_inputs.update(
                answer_ids=encoded["input_ids"], answer_attention_mask=encoded["attention_mask"], candidates=answers
            )
        return model_inputs

    def _forward(
        self,
        model_inputs: dict[str, Any],
        top_k: int = 1,
        label_smoothing: float = 0.0,
        generate_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        input_ids, attention_mask = model_inputs["input_ids"], model_inputs["attention_mask"]
        num_questions = input_ids.shape[0]
        dtype = getattr(self.model, "dtype", torch.float32)
        pixel_values = model_inputs["pixel_values"].to(dtype).expand(num_questions, -1, -1, -1, -1)
        if "candidates" in model_inputs:
            candidates = model_inputs["candidates"]
            ranking = self.model.rank_answers(
                input_ids,
                pixel_values,
                model_inputs["answer_ids"],
                attention_mask=attention_mask,
                answer_attention_mask=model_inputs["answer_attention_mask"],
                k=max(self.model.config.k_test, top_k),
                label_smoothing=label_smoothing,
            )
            log_likelihoods, indices = ranking.topk_log_likelihoods, ranking.topk_indices
            order = log_likelihoods.argsort(dim=1, descending=True, stable=True)[:, :top_k]
            answers = [[candidates[int(indices[q, j])] for j in order[q]] for q in range(num_questions)]
            scores = log_likelihoods.gather(1, order).exp()
            return {"answers": answers, "scores": scores, "single": model_inputs["single"]}
        return self._generate(input_ids, attention_mask, pixel_values, top_k, generate_kwargs or {}, model_inputs)

    def generation_settings(self, generate_kwargs: dict[str, Any], top_k: int) -> dict[str, Any]:
        """The `generate` arguments of a call: the call's `generate_kwargs`, on top of the model's generation config,
        on top of `ANSWER_GENERATION_DEFAULTS` for the parameters neither sets; at least ``top_k`` beams, and
        ``top_k`` sequences per question."""
        model_settings = self.model.generation_config.to_diff_dict()
        settings = {k: v for k, v in ANSWER_GENERATION_DEFAULTS.items() if k not in model_settings}
        settings.update(generate_kwargs)
        if "max_new_tokens" in {**model_settings, **generate_kwargs} and "max_length" not in generate_kwargs:
            settings.pop("max_length", None)
        num_beams = settings.get("num_beams", self.model.generation_config.num_beams) or 1
        settings["num_beams"] = max(int(num_beams), top_k)
        settings["num_return_sequences"] = top_k
        return settings

    def _generate(self, input_ids, attention_mask, pixel_values, top_k, generate_kwargs, model_inputs):
        """Beam search from [DEC] (`model.generate_from_question`), then the model's log-likelihood of every
        returned answer (`model.answer_log_likelihoods`)."""
        model = self.model
        states, question_mask, _ = model.encode_question(input_ids, pixel_values, attention_mask)
        sequences = model.generate_from_question(states, question_mask, **self.generation_settings(generate_kwargs,
                                                                                                    top_k))
        if not isinstance(sequences, torch.Tensor):
            sequences = sequences.sequences
        sequence_log_probs = model.answer_log_likelihoods(
            sequences, states.repeat_interleave(top_k, dim=0), question_mask.repeat_interleave(top_k, dim=0)
        ).view(-1, top_k)
        texts = self.tokenizer.decode(sequences.tolist(), skip_special_tokens=True)
        texts = [t.strip() for t in texts]
        order = sequence_log_probs.argsort(dim=1, descending=True, stable=True)
        answers = [[texts[q * top_k + int(j)] for j in order[q]] for q in range(order.shape[0])]
        scores = sequence_log_probs.gather(1, order).exp()
        return {"answers": answers, "scores": scores, "single": model_inputs["single"]}

    def postprocess(self, model_outputs: dict[str, Any]) -> Any:
        results = [
            [{"answer": answer, "score": float(score)} for answer, score in zip(answers, scores)]
            for answers, scores in zip(model_outputs["answers"], model_outputs["scores"])
        ]
        return results[0] if model_outputs["single"] else results


# ----------------------------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------------------------

PIPELINE_CLASSES = {
    "video-text-retrieval": VideoTextRetrievalPipeline,
    "zero-shot-video-classification": ZeroShotVideoClassificationPipeline,
    "video-question-answering": VideoQuestionAnsweringPipeline,
}


def register_testa_pipelines(overwrite: bool = False) -> None:
    """Registers the three tasks with `PIPELINE_REGISTRY` (so `pipeline(task, model=model_object, processor=...)`
    works without a saved folder). A task that is already registered is kept unless `overwrite=True`, so importing a
    second copy of this module (Hub remote code) does not replace the installed one."""
    import transformers

    for task, pipeline_class in PIPELINE_CLASSES.items():
        if task in PIPELINE_REGISTRY.supported_tasks and not overwrite:
            continue
        auto_classes = tuple(getattr(transformers, name) for name in pipeline_class._auto_model_classes)
        PIPELINE_REGISTRY.register_pipeline(task, pipeline_class=pipeline_class, pt_model=auto_classes,
                                            type="multimodal")


register_testa_pipelines()

__all__ = [
    "PIPELINE_CLASSES",
    "VideoQuestionAnsweringPipeline",
    "VideoTextRetrievalPipeline",
    "ZeroShotVideoClassificationPipeline",
    "register_testa_pipelines",
]
