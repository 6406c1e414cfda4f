"""Contrastive training of the TESTA heads (`TestaForVideoTextRetrieval`, `TestaForPreTraining`): the orchestration of
video-text contrast (VTC, momentum distillation against the global batch and the queue) and video-text matching (VTM,
hard negatives drawn over all processes), as functions of a head.

A head supplies its public pieces: `vision_proj` and `get_text_features` (online features), `itm_logits` (the
matching head on [ENC] texts), `logit_scale` and `temp` (the learned temperature), `hard_negative_weights` and
`sample_hard_negatives` (overridable), and `momentum` (a `MomentumContrast`, which computes the momentum features and
keeps the queues). The losses themselves are the plain functions of `losses`.

Adapted from TESTA `models/testa_retrieval.py` L107-L258 (`TESTA_Retrieval.forward`: VTC L123-L157, VTM L159-L256)
and `models/blip_pretrain.py` L98-L228 (`BLIP_Pretrain.forward`) (github.com/RenShuhuai-Andy/TESTA at commit 41b9486):
the released code contrasts with the local batch and the queue; here the batch is the one gathered over processes
(see `video_text_contrast`).
"""

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .distributed import (
    check_same_shape_on_all_ranks,
    gather_padded,
    gather_with_grad,
    gather_without_grad,
    raise_on_every_rank,
    rank,
    world_size,
)
from .losses import contrastive_positives, hard_negative_weights, vtc_loss, vtm_loss
from .modeling_testa_vision import pool_video_tokens
from .momentum import online_modules


class ContrastiveLosses(NamedTuple):
    """VTC and VTM of one batch: the losses, the positive pairs' ITM logits ``(batch, 2)``, and the hard negatives
    drawn for every text (videos) and every video (texts), as indices into the batch gathered over all processes."""

    loss_vtc: torch.Tensor
    loss_vtm: torch.Tensor
    itm_logits: torch.Tensor
    negative_video_indices: torch.Tensor
    negative_text_indices: torch.Tensor


@torch.no_grad()
def hard_negative_sampling_weights(
    video_feat: torch.Tensor,
    text_feat: torch.Tensor,
    video_ids: torch.Tensor | None,
    temp: torch.Tensor,
    all_ranks: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VTM sampling weights of the local rows over the candidate set: ``softmax(sim / temp)`` with every pair
    sharing a video id (or the pair itself) set to 0. With ``all_ranks`` the candidates are the batch gathered over
    all processes, otherwise the local batch. Returns ``(video->text, text->video)`` weights; raises on every process
    when a row has no candidate of another video."""
    video_all = gather_without_grad(video_feat) if all_ranks else video_feat
    text_all = gather_without_grad(text_feat) if all_ranks else text_feat
    batch, device = video_feat.shape[0], video_feat.device
    if video_ids is not None:
        same = contrastive_positives(video_ids, batch, gather_without_grad(video_ids) if all_ranks else video_ids)
    elif all_ranks:
        same = contrastive_positives(None, batch, torch.empty(video_all.shape[0], device=device), rank())
    else:
        same = torch.eye(batch, dtype=torch.bool, device=device)
    weights_v2t, weights_t2v = hard_negative_weights(video_feat, text_feat, video_all, text_all, same, temp)
    error = None
    for name, weights in (("video", weights_v2t), ("text", weights_t2v)):
        if error is None and (not torch.isfinite(weights).all() or (weights.sum(dim=1) <= 0).any()):
            error = ValueError(
                f"Cannot draw a hard negative {name} pair: some rows have no candidate with a different video id "
                "(every candidate shares the row's `video_ids`, or the global batch has one sample)."
            )
    raise_on_every_rank(error, device)  # a rank-local failure must not leave the others waiting
    return weights_v2t, weights_t2v


def video_text_contrast(
    head: Any,
    video_feat: torch.Tensor,
    text_feat: torch.Tensor,
    video_feat_m: torch.Tensor,
    text_feat_m: torch.Tensor,
    video_ids: torch.Tensor | None,
    alpha: float,
) -> torch.Tensor:
    """Contrastive loss of the local rows against the momentum features of the **global** batch plus the queue.

    The released code compares against the local batch plus the queue; gathering the batch makes the loss and its
    gradient independent of how the global batch is split over processes. Only momentum features (no gradient) are
    gathered: the gradient flows through the local online features, and DDP's gradient averaging then gives exactly
    the gradient of the global-batch loss. In training, the batch's momentum features then go to the queue.
    """
    momentum = head.momentum
    batch, device = video_feat.shape[0], video_feat.device
    ids_batch = gather_without_grad(video_ids) if video_ids is not None else None
    video_m_batch, text_m_batch = gather_without_grad(video_feat_m), gather_without_grad(text_feat_m)
    video_targets, text_targets = momentum.targets(video_m_batch, text_m_batch)
    if video_ids is not None:
        positives = contrastive_positives(video_ids, batch, torch.cat([ids_batch, momentum.idx_queue]))
    else:
        columns = torch.empty(video_m_batch.shape[0], device=device)
        positives = F.pad(contrastive_positives(None, batch, columns, rank()), (0, head.config.queue_size))
    loss = vtc_loss(video_feat, text_feat, video_feat_m, text_feat_m, video_targets, text_targets, positives,
                    head.temp, alpha)
    if head.training:
        if ids_batch is None:
            ids_batch = torch.full((video_m_batch.shape[0],), -100, dtype=torch.long, device=device)
        momentum.after_loss(video_m_batch, text_m_batch, ids_batch)
    return loss


def video_text_matching(
    head: Any,
    video_embeds: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    video_feat: torch.Tensor,
    text_feat: torch.Tensor,
    video_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Matching loss over ``B`` positives, ``B`` (text, hard-negative video) and ``B`` (video, hard-negative text)
    pairs. Negative video tokens come from all processes with their gradients (``all_gather`` with backward).
    Returns ``(loss, positive pairs' logits, negative videos, negative texts)``."""
    batch = video_embeds.shape[0]
    config = head.config
    enc_ids = input_ids.clone()
    enc_ids[:, 0] = config.enc_token_id  # gathered with the [ENC] the matching head reads
    gather = config.negative_all_rank and world_size() > 1
    with torch.no_grad():
        weights_v2t, weights_t2v = head.hard_negative_weights(video_feat.detach(), text_feat.detach(), video_ids)
        negative_videos = head.sample_hard_negatives(weights_t2v)
        negative_texts = head.sample_hard_negatives(weights_v2t)
    pad = config.text_config.pad_token_id or 0
    if gather:
        check_same_shape_on_all_ranks(video_embeds, "pixel_values -> video tokens", (0, 1))
        videos_all = gather_with_grad(video_embeds)
        ids_all, mask_all = gather_padded(enc_ids, pad), gather_padded(attention_mask, 0)
    else:
        videos_all, ids_all, mask_all = video_embeds, enc_ids, attention_mask
    length = ids_all.shape[1]
    enc_ids = F.pad(enc_ids, (0, length - enc_ids.shape[1]), value=pad)
    attention_mask = F.pad(attention_mask, (0, length - attention_mask.shape[1]), value=0)

    text_ids = torch.cat([enc_ids, enc_ids, ids_all[negative_texts]], dim=0)
    text_mask = torch.cat([attention_mask, attention_mask, mask_all[negative_texts]], dim=0)
    videos = torch.cat([video_embeds, videos_all[negative_videos], video_embeds], dim=0)
    logits, _ = head.itm_logits(text_ids, text_mask, videos)
    return vtm_loss(logits, batch), logits[:batch], negative_videos, negative_texts


def contrastive_losses(
    head: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pixel_values: torch.Tensor,
    video_embeds: torch.Tensor,
    video_token_sizes: torch.Tensor,
    video_ids: torch.Tensor | None,
    alpha: float | None,
) -> ContrastiveLosses:
    """VTC and VTM of one batch of ``(text, video)`` pairs whose videos ``head`` has encoded (``video_embeds``,
    ``video_token_sizes``). Checks the batch on every process (a bad batch raises everywhere), keeps the temperature
    in range, runs the momentum model (`MomentumContrast.features`, after its EMA update in the default mode) and
    both losses. ``alpha`` defaults to ``config.alpha``."""
    config = head.config
    batch = input_ids.shape[0]
    alpha = config.alpha if alpha is None else alpha
    error = None
    if video_embeds.shape[0] != batch:
        error = ValueError(f"Got {video_embeds.shape[0]} videos but {batch} texts; training needs aligned pairs.")
    elif video_ids is not None:
        video_ids = torch.as_tensor(video_ids, device=input_ids.device).view(-1)
        if video_ids.shape[0] != batch or (video_ids < 0).any():
            error = ValueError(f"`video_ids` must hold {batch} non-negative ids, got {video_ids.tolist()}.")
    if error is None and not 0.0 <= alpha <= 1.0:
        error = ValueError(f"`alpha` must lie in [0, 1], got {alpha}.")
    raise_on_every_rank(error, input_ids.device)  # raised on every process or on none
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_same_shape_on_all_ranks(input_ids, "input_ids", (0,))
    with torch.no_grad():
        head.temp.copy_(head.logit_scale())  # the learned parameter stays in range, as in the released training
    pooled = pool_video_tokens(video_embeds, video_token_sizes, config.video_pooling)
    video_feat = F.normalize(head.vision_proj(pooled), dim=-1)
    text_feat = head.get_text_features(input_ids, attention_mask).pooler_output
    momentum = head.momentum
    with torch.no_grad():
        momentum.before_loss(online_modules(head), head.training)
        video_feat_m, text_feat_m = momentum.features(pixel_values, input_ids, attention_mask)
    loss_vtc = video_text_contrast(head, video_feat, text_feat, video_feat_m, text_feat_m, video_ids, alpha)
    loss_vtm, itm_logits, negative_videos, negative_texts = video_text_matching(
        head, video_embeds, input_ids, attention_mask, video_feat, text_feat, video_ids
    )
    return ContrastiveLosses(loss_vtc, loss_vtm, itm_logits, negative_videos, negative_texts)


__all__ = [
    "ContrastiveLosses",
    "contrastive_losses",
    "hard_negative_sampling_weights",
    "video_text_contrast",
    "video_text_matching",
]
