"""The one two-stage ranking of TESTA retrieval, used by `rank_videos`/`rank_texts`, the retrieval pipeline, the
video index and store search, and the training evaluation.

1. **First stage**: the cosine similarity of the contrastive embeddings picks the ``k`` best candidates of every
   query (``k`` is the model's ``k_test`` unless given).
2. **Re-ranking**: the matching (ITM) head scores those ``(text, video)`` pairs, ``batch_size`` pairs at a time,
   reading only their videos' tokens (`match_scores`); a candidate's score is the ITM match logit (or its softmax
   probability) plus, by default, its cosine, as in the released evaluation (TESTA `train_video_retrieval.py`
   L178-L345, `evaluation`). Every other item scores ``-inf``.
3. **Order** (`ranked_order`): the re-ranked candidates by decreasing score, then the other items by decreasing
   cosine. Items whose cosine is ``-inf`` (videos that could not be encoded) are never ranked.

**Tie rule.** Equal scores (and equal cosines) are ordered by index, lower first. When the positives of a query are
known (evaluation), a positive comes after every item it ties with, so ties count against the query, the convention
of the `video_text_retrieval` metric.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput


ITM_SCORES = ("logit", "softmax")
"""How a re-ranked pair is scored: the ITM "match" logit (original) or its softmax probability."""


@dataclass
class TestaRankingOutput(ModelOutput):
    r"""
    Output of the two-stage ranking (`rank_videos` / `rank_texts`, `two_stage_scores`).

    Args:
        scores (`torch.FloatTensor` of shape `(num_queries, num_candidates)`): the final scores. Re-ranked candidates
            hold the ITM score (plus the cosine by default); all others hold `-inf`.
        similarity (`torch.FloatTensor` of shape `(num_queries, num_candidates)`): first-stage cosine similarity.
        topk_indices (`torch.LongTensor` of shape `(num_queries, k)`): the candidates re-ranked per query, by
            decreasing cosine.
        topk_scores (`torch.FloatTensor` of shape `(num_queries, k)`): their final scores.
    """

    scores: torch.FloatTensor | None = None
    similarity: torch.FloatTensor | None = None
    topk_indices: torch.LongTensor | None = None
    topk_scores: torch.FloatTensor | None = None


def check_itm_score(itm_score: str) -> None:
    if itm_score not in ITM_SCORES:
        raise ValueError(f"Unknown itm_score={itm_score!r}; use 'logit' (original) or 'softmax'.")


def check_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"`batch_size` must be positive, got {batch_size}.")


@dataclass(frozen=True)
class RankingOptions:
    """How the second stage runs and scores, checked at construction.

    Args:
        k: candidates re-ranked per query (`two_stage_scores` takes at most the number of candidates).
        itm_score: ``"logit"`` (the ITM match logit, original) or ``"softmax"`` (its probability).
        add_cosine: add the first-stage cosine to a re-ranked pair's ITM score (original).
        batch_size: pairs per matching-head forward (and queries per chunk when queries are given).
    """

    k: int
    itm_score: str = "logit"
    add_cosine: bool = True
    batch_size: int = 128

    def __post_init__(self) -> None:
        check_itm_score(self.itm_score)
        check_batch_size(self.batch_size)
        if isinstance(self.k, bool) or not hasattr(self.k, "__index__") or self.k <= 0:
            raise ValueError(f"`k` must be positive, got {self.k}.")


@torch.no_grad()
def match_scores(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    text_rows: torch.Tensor,
    video_rows: torch.Tensor,
    read_tokens: Callable[[torch.Tensor], torch.Tensor],
    batch_size: int = 128,
    itm_score: str = "logit",
) -> torch.Tensor:
    """Matching-head scores of the pairs ``(input_ids[text_rows[i]], video video_rows[i])``: the ITM "match" logit
    (or its softmax probability), ``batch_size`` pairs at a time.

    ``read_tokens(video_indices)`` supplies the aggregated tokens of a batch's videos (a tensor's ``__getitem__``, or
    `VideoTokenStore.read_tokens`); a video repeated within a batch, as the query video of a video-to-text chunk is,
    is read once. Memory is bounded by ``batch_size`` videos' tokens.
    """
    check_itm_score(itm_score)
    check_batch_size(batch_size)
    device, dtype = model.device, model.dtype
    scores = []
    for start in range(0, text_rows.shape[0], batch_size):
        texts, videos = text_rows[start : start + batch_size], video_rows[start : start + batch_size].cpu()
        unique, row_of_pair = videos.unique(return_inverse=True)
        tokens = read_tokens(unique).to(device, dtype)[row_of_pair.to(device)]  # one row per pair
        logits, _ = model.itm_logits(input_ids[texts.to(input_ids.device)],
                                     attention_mask[texts.to(attention_mask.device)], tokens)
        scores.append(logits[:, 1] if itm_score == "logit" else logits.float().softmax(dim=-1)[:, 1])
    if not scores:
        return torch.empty(0, device=device, dtype=dtype)
    return torch.cat(scores)


@torch.no_grad()
def pair_scores(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    read_tokens: Callable[[torch.Tensor], torch.Tensor],
    video_features: torch.Tensor,
    *,
    itm_score: str = "logit",
    add_cosine: bool = True,
    batch_size: int = 128,
) -> torch.Tensor:
    """The second-stage score of aligned pairs ``(text i, video i)`` (a cross-encoder's input): the ITM score of
    `match_scores`, plus, with ``add_cosine``, the cosine of the pair's embeddings (``video_features``, normalised,
    one row per pair; the texts' are computed here), as `two_stage_scores` scores its re-ranked candidates."""
    rows = torch.arange(input_ids.shape[0], device=model.device)
    scores = match_scores(model, input_ids, attention_mask, rows, rows, read_tokens, batch_size, itm_score)
    if add_cosine:
        text_features = model.get_text_features(input_ids, attention_mask).pooler_output
        scores = scores + (text_features * video_features.to(text_features.dtype)).sum(dim=-1)
    return scores


@torch.no_grad()
def two_stage_scores(
    model: Any,
    *,
    queries_are_texts: bool,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    text_features: torch.Tensor,
    video_features: torch.Tensor,
    read_tokens: Callable[[torch.Tensor], torch.Tensor],
    options: RankingOptions,
    queries: torch.Tensor | None = None,
    excluded: torch.Tensor | None = None,
) -> TestaRankingOutput:
    """Both stages for ``queries`` (text rows when ``queries_are_texts``, else video indices; all by default).

    Args:
        model: a TESTA retrieval head (its `itm_logits`, `device` and `dtype`).
        queries_are_texts: rank videos for text queries (else texts for video queries).
        input_ids, attention_mask: ``(num_texts, length)`` all texts (queries or candidates).
        text_features, video_features: ``(num_texts, dim)``, ``(num_videos, dim)`` normalised embeddings.
        read_tokens: the videos' aggregated tokens by index (see `match_scores`).
        options: ``k`` (at most the number of candidates is taken), how a re-ranked pair is scored, and the batch
            size (pairs per matching-head forward, queries per chunk).
        queries: the query rows to rank, in order; ranked in chunks of ``options.batch_size`` queries when given
            (memory bounded by the chunk's similarity rows), all at once otherwise.
        excluded: ``(num_candidates,)`` bool: candidates never picked (their cosine becomes ``-inf``).
    """
    k, itm_score, add_cosine, batch_size = options.k, options.itm_score, options.add_cosine, options.batch_size
    device, dtype = model.device, model.dtype
    query_features = (text_features if queries_are_texts else video_features).to(device, dtype)
    candidate_features = (video_features if queries_are_texts else text_features).to(device, dtype)
    chunks = [None] if queries is None else [queries[i : i + batch_size] for i in range(0, len(queries), batch_size)]
    outputs = []
    for chunk in chunks:
        rows = query_features if chunk is None else query_features[chunk.to(device)]
        similarity = rows @ candidate_features.T
        if excluded is not None and bool(excluded.any()):
            similarity = similarity.masked_fill(excluded.to(device).view(1, -1), float("-inf"))
        topk_sim, topk_indices = similarity.topk(min(k, similarity.shape[1]), dim=1)
        query_index = torch.arange(similarity.shape[0], device=device) if chunk is None else chunk.to(device)
        query_rows = query_index.repeat_interleave(topk_indices.shape[1])
        candidates = topk_indices.flatten()
        texts, videos = (query_rows, candidates) if queries_are_texts else (candidates, query_rows)
        itm = match_scores(model, input_ids, attention_mask, texts, videos, read_tokens, batch_size, itm_score)
        topk_scores = itm.view(-1, topk_indices.shape[1]).to(similarity.dtype)
        if add_cosine:
            topk_scores = topk_scores + topk_sim
        scores = torch.full_like(similarity, float("-inf")).scatter(1, topk_indices, topk_scores)
        outputs.append(TestaRankingOutput(scores=scores, similarity=similarity, topk_indices=topk_indices,
                                          topk_scores=topk_scores))
    if len(outputs) == 1:
        return outputs[0]
    return TestaRankingOutput(**{name: torch.cat([getattr(o, name) for o in outputs]) for name in
                                 ("scores", "similarity", "topk_indices", "topk_scores")})


def ranked_order(
    scores: torch.Tensor,
    similarity: torch.Tensor,
    length: int | None = None,
    positives: set[int] | None = None,
) -> list[int]:
    """One query's ranking, best first, as item indices: the re-ranked items (finite ``scores``) by decreasing
    score, then the others by decreasing cosine ``similarity`` (finite entries only), ``length`` items in all (all
    by default). Ties follow the module's tie rule. Only the head of the cosine order is sorted.

    Args:
        scores, similarity: ``(num_items,)`` one row of `TestaRankingOutput.scores` / ``.similarity``.
        length: how many items to return.
        positives: the query's positives (evaluation): they come after the items they tie with.
    """
    positives = positives or set()
    scores, similarity = scores.float().cpu(), similarity.float().cpu()
    length = scores.shape[0] if length is None else length
    head = torch.isfinite(scores).nonzero().flatten().tolist()
    ranked = sorted(head, key=lambda i: (-float(scores[i]), i in positives))
    room = length - len(ranked)
    if room > 0:
        rest = similarity.clone()
        rest[head] = float("-inf")
        finite = torch.isfinite(rest)
        if bool(finite.any()):
            # every item at least as similar as the room-th best one (ties at the cut included, then truncated)
            cut = rest[finite].topk(min(room, int(finite.sum()))).values[-1]
            tail = ((rest >= cut) & finite).nonzero().flatten().tolist()
            ranked += sorted(tail, key=lambda i: (-float(rest[i]), i in positives))[:room]
    return ranked[:length]


def encode_video_batch(model: Any, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What two-stage ranking reads of a batch of videos, from a retrieval head (`get_video_tokens`,
    `get_video_features`): ``(tokens, token sizes or None, embeddings)``, as the model computes them (on its device,
    in its dtype). The pipeline call and the index build encode through this one step."""
    out = model.get_video_tokens(pixel_values)
    features = model.get_video_features(video_tokens=out.last_hidden_state, video_token_sizes=out.token_sizes)
    return out.last_hidden_state, out.token_sizes, features.pooler_output


__all__ = [
    "ITM_SCORES",
    "RankingOptions",
    "TestaRankingOutput",
    "check_batch_size",
    "check_itm_score",
    "encode_video_batch",
    "match_scores",
    "pair_scores",
    "ranked_order",
    "two_stage_scores",
]
