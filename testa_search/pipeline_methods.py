"""What `VideoTextRetrievalPipeline.encode_videos` and `.search` run: the pipeline's methods import this module (the
pipeline ships in a Hub folder; the search system does not) and call these functions with the pipeline itself.

`encode_videos` builds an index through the library's one build (`build.IndexBuild`, as `python -m train.index`
does); `search` ranks an index's rows with the same two-stage ranking as the pipeline call (`ranking.two_stage_scores`
on the candidates of the index's first stage). Their arguments and results are documented on the pipeline's methods.
"""

import os
from typing import Any

import torch
from transformers.utils import logging

from modeling_testa.pipeline_testa import check_rerank_k, check_top_k, show_progress
from modeling_testa.ranking import RankingOptions, two_stage_scores
from modeling_testa.video_inputs import text_list, video_list

from .build import FileDecoder, IndexBuild, build_settings, window_entries
from .encoding import DecodeEach, check_on_error
from .homes import IndexEntry, InMemoryHome, SearchableIndex, StoreHome, as_entries
from .index import VideoIndex
from .moments import best_moment_per_video, check_window_options
from .settings import IndexInfo


logger = logging.get_logger(__name__)


def decoder_for_thread(pipe: Any) -> Any:
    """A decoder helper process of its own for the calling thread (decoding threads then decode in parallel), from
    the pipeline's video processor's own copy of the decoding code; None when it has none."""
    import sys

    module = sys.modules.get(type(pipe.video_processor).__module__)
    own = getattr(module, "own_decoder_process", None)
    return own() if own is not None else None


def check_encode_arguments(entries: list[IndexEntry], batch_size: Any, num_workers: Any, on_error: str,
                           store_dir: Any, store_tokens: bool, index: Any, window: Any,
                           video_kwargs: dict[str, Any]) -> None:
    """Refuses, naming the argument, what `encode_videos` cannot do; nothing is decoded before."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"`num_workers` must be a non-negative int, got {num_workers!r}.")
    check_on_error(on_error)
    arrays = [i for i, entry in enumerate(entries) if not isinstance(entry.video, (str, os.PathLike))]
    if index is not None:
        if not isinstance(index, VideoIndex):  # a Milvus index is grown by train.index --milvus, not here
            raise TypeError(f"`index` must be a VideoIndex to grow, got {type(index)}.")
        if store_dir is not None:
            raise ValueError("`index=` grows that index where it lives (in memory, or its own store); do not "
                             "pass `store_dir` with it.")
        if arrays:
            raise ValueError(f"`index=` tells the videos already in the index by their paths; videos{arrays[:3]} "
                             "are in-memory videos, which have none.")
    stored = store_dir is not None or getattr(index, "store", None) is not None
    if stored and not store_tokens:
        raise ValueError("A store holds the tokens: `store_dir` (or a store-backed `index`) cannot be combined "
                         "with store_tokens=False.")
    if stored and arrays:
        raise ValueError(f"A store tells its videos by their paths; videos{arrays[:3]} are in-memory videos, "
                         "which have none: index them in memory (no `store_dir`).")
    if window is not None:
        unsupported = sorted(set(video_kwargs) - {"num_frames"})
        if unsupported:
            raise ValueError(f"With `window=`, `num_frames` is the only video argument taken; got {unsupported}.")
        if arrays:
            raise ValueError(f"`window=` cuts video files by time; videos{arrays[:3]} are in-memory videos.")


def encode_videos(pipe: Any, videos: list[Any], batch_size: int = 8, store_tokens: bool = True,
                  token_dtype: torch.dtype | None = None, progress_bar: bool | None = None,
                  store_dir: str | os.PathLike | None = None, num_workers: int = 0, on_error: str = "skip",
                  index: VideoIndex | None = None, window: float | None = None, stride: float | None = None,
                  **video_kwargs: Any) -> VideoIndex:
    """`VideoTextRetrievalPipeline.encode_videos` (documented there) for the pipeline `pipe`."""
    if isinstance(videos, (list, tuple)) and any(isinstance(item, IndexEntry) for item in videos):
        entries = as_entries(videos)
        names = video_list([entry.video for entry in entries], "videos")
    else:
        names = video_list(videos, "videos")
        entries = as_entries(names)
    check_encode_arguments(entries, batch_size, num_workers, on_error, store_dir, store_tokens, index, window,
                           video_kwargs)
    window, stride = check_window_options(window, stride)
    directory = store_dir if store_dir is not None else getattr(getattr(index, "store", None), "directory", None)
    num_frames = int(video_kwargs.get("num_frames", pipe.video_processor.num_frames))
    settings = build_settings(pipe.model, num_frames, window=window, stride=stride,
                              token_dtype=token_dtype if directory is not None else None)
    home = StoreHome(directory) if directory is not None else InMemoryHome(store_tokens, token_dtype, index)
    if window is not None:  # the rows are the videos' windows, planned from their durations
        entries = window_entries(entries, window, stride, skip=home.held_videos())
    moments = any(entry.start is not None for entry in entries)
    decode = FileDecoder(DecodeEach(lambda video, i: pipe.pixel_values(video, f"videos[{i}]", video_kwargs),
                                    on_error), pipe.video_processor, num_frames, batch_size, num_workers, on_error,
                         thread_initializer=lambda: decoder_for_thread(pipe))
    build = IndexBuild(home, settings, command="VideoTextRetrievalPipeline.encode_videos",
                       progress_bar=show_progress(len(entries), progress_bar), num_workers=num_workers,
                       description="Encoding windows" if moments else "Encoding videos")
    result = build.run(pipe.model, entries, decode)
    built = result.index
    if not result.report.handled:
        logger.info("All %d videos are already in the index; nothing to encode.", len(names))
    built.stats = result.report.stats()
    if index is not None and built is not index:  # a grown store: the caller's index object reads it now
        index.__dict__.update(built.__dict__)
        return index
    return built


def describer(index: SearchableIndex) -> Any:
    """``row -> {"video", ...}``: the index's `entry` (the row's video and, when it has them, its `start`/`end`
    (an index of moments) and `dataset`), with the video as the index holds it."""
    entry, videos = index.entry, index.videos
    return lambda row: {**entry(row), "video": videos[row]}


def candidate_results(index: SearchableIndex, candidates: torch.Tensor, cosines: torch.Tensor,
                      head_scores: torch.Tensor | None, top_k: int | None) -> list[dict]:
    """The pipeline's result list computed from one query's candidates only (O(candidates), not O(collection)): the
    first ``len(head_scores)`` candidates re-ranked (by decreasing two-stage score), then the other candidates by
    decreasing cosine; ties by index, as `ranking.ranked_order` orders them. Every result says what `describer`
    says of its row."""
    rows, cosines = candidates.tolist(), cosines.tolist()
    reranked = 0 if head_scores is None else len(head_scores)
    head = sorted(zip(rows[:reranked], head_scores.tolist() if reranked else []), key=lambda pair: (-pair[1], pair[0]))
    rest = sorted(zip(rows[reranked:], cosines[reranked:]), key=lambda pair: (-pair[1], pair[0]))
    describe = describer(index)
    results = [{**describe(i), "score": score, "reranked": True} for i, score in head]
    results += [{**describe(i), "score": score, "reranked": False} for i, score in rest]
    return results if top_k is None else results[:top_k]


def check_index_settings(index: SearchableIndex, config: Any) -> None:
    """Refuses to search an index encoded by a model of another projection size or aggregation settings (the
    `IndexInfo` settings read from a model's config; an index that does not record a setting is not checked for it),
    naming the setting and both values."""
    differing = IndexInfo.from_dict(index.info or {}).model_differences(config)
    for key, (recorded, mine) in differing.items():
        raise ValueError(f"The index was encoded with {key} = {recorded!r}, but this model has {key} = "
                         f"{mine!r}: search it with the model that encoded it, or encode the videos again.")


@torch.no_grad()
def search(pipe: Any, text: str | list[str], index: SearchableIndex, top_k: int | None = 10,
           rerank: bool | None = None, rerank_k: int | None = None, itm_score: str = "logit",
           add_cosine: bool = True, use_faiss: bool | None = None, text_kwargs: dict[str, Any] | None = None,
           filters: dict[str, Any] | None = None, group_by: str | None = None) -> Any:
    """`VideoTextRetrievalPipeline.search` (documented there) for the pipeline `pipe`."""
    if not isinstance(index, SearchableIndex):
        raise TypeError(
            f"`index` must be a VideoIndex (from `encode_videos` or `VideoIndex.load`), got {type(index)}."
        )
    check_top_k(top_k)
    if rerank_k is not None:
        check_rerank_k(rerank_k)
    if use_faiss not in (None, True, False):
        raise ValueError(f"`use_faiss` must be None, True or False, got {use_faiss!r}.")
    if group_by not in (None, "video"):
        raise ValueError(f"`group_by` must be None or 'video', got {group_by!r}.")
    check_index_settings(index, pipe.model.config)
    grouped_top_k = top_k if group_by == "video" else None
    if group_by == "video":
        top_k = None  # every row, so that grouping keeps each video's best moment
    texts, single = text_list(text, "text")
    if rerank and not index.has_tokens:
        raise ValueError("rerank=True needs an index built with store_tokens=True.")
    if rerank is None and not index.has_tokens:
        logger.warning_once("This index holds no re-ranking tokens (built with store_tokens=False, or a Milvus "
                            "collection whose rows name no token store): search ranks by cosine only.")
    rerank = index.has_tokens if rerank is None else bool(rerank)
    encoded = pipe.tokenize(texts, text_kwargs)
    input_ids = encoded["input_ids"].to(pipe.device)
    attention_mask = encoded["attention_mask"].to(pipe.device)
    text_features = pipe.model.get_text_features(input_ids, attention_mask).pooler_output.float().cpu()
    num_videos = len(index)
    rerank_depth = pipe.rerank_depth(num_videos, top_k, rerank_k) if rerank else 0  # candidates re-ranked
    fetched = num_videos if top_k is None else max(rerank_depth, min(top_k, num_videos))  # first-stage results
    max_results = getattr(index, "max_results", None)  # a Milvus collection's bound; none for other homes
    if max_results is not None and fetched > max_results:
        logger.warning_once(f"This index returns at most {max_results} results per search: top_k and the "
                            "re-ranking depth are cut to that.")
        fetched = max_results
    cosines, candidates = index.nearest(text_features, fetched, use_faiss=use_faiss, filters=filters or None)
    results = []
    for q in range(len(texts)):
        # only the candidates are scored: the work per query does not grow with the collection
        found = candidates[q] >= 0  # a filtered search may find fewer rows than asked
        rows, row_cosines = candidates[q][found], cosines[q][found].float()
        head = rows[:rerank_depth]
        head_scores = None
        if head.numel():
            head_scores = two_stage_scores(
                pipe.model, queries_are_texts=True, input_ids=input_ids[q : q + 1],
                attention_mask=attention_mask[q : q + 1], text_features=text_features[q : q + 1],
                video_features=index.embeddings[head], read_tokens=lambda rows: index.tokens[head[rows]],
                options=RankingOptions(k=len(head), itm_score=itm_score, add_cosine=add_cosine),
            ).scores[0].float().cpu()
        ranked = candidate_results(index, rows, row_cosines, head_scores, top_k)
        if group_by == "video":
            ranked = best_moment_per_video(ranked)[:grouped_top_k]
        results.append(ranked)
    return results[0] if single else results
