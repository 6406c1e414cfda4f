"""TESTA's training losses as plain functions (in the style of open_clip's `loss.py`): video-text contrastive (VTC)
with momentum distillation, video-text matching (VTM) with hard negatives, and the label-smoothed sequence loss of
captioning and answering. The heads build the inputs (features, momentum targets, pairs); these functions compute."""

import torch
import torch.nn.functional as F


def contrastive_positives(
    video_ids: torch.Tensor | None, batch: int, columns: torch.Tensor, process_rank: int = 0
) -> torch.Tensor:
    """``(batch, len(columns))`` bool: which columns are positives of each local row.

    With ``video_ids`` every column whose id equals the row's id is a positive (``columns`` holds the ids of the
    columns). Without them a row's only positive is its own pair, at column ``process_rank * batch + row`` of the
    batch gathered over processes (``columns`` then only gives the width and the device).
    """
    if video_ids is not None:
        return video_ids.view(-1, 1).eq(columns.view(1, -1))
    positives = torch.zeros(batch, columns.shape[0], dtype=torch.bool, device=columns.device)
    rows = torch.arange(batch, device=columns.device)
    positives[rows, process_rank * batch + rows] = True
    return positives


def vtc_loss(
    video_feat: torch.Tensor,
    text_feat: torch.Tensor,
    video_feat_m: torch.Tensor,
    text_feat_m: torch.Tensor,
    video_targets: torch.Tensor,
    text_targets: torch.Tensor,
    positives: torch.Tensor,
    temp: torch.Tensor,
    alpha: float,
) -> torch.Tensor:
    """Video-text contrastive loss with momentum distillation (ALBEF/BLIP), both directions averaged.

    Args:
        video_feat, text_feat: ``(batch, dim)`` normalised online features of the local rows (they carry gradients).
        video_feat_m, text_feat_m: ``(batch, dim)`` normalised momentum features of the same rows.
        video_targets, text_targets: ``(columns, dim)`` the momentum features every row is contrasted with: the
            global batch, then the queue.
        positives: ``(batch, columns)`` bool, see `contrastive_positives`.
        temp: the learned temperature.
        alpha: weight of the momentum model's soft targets against the one-hot (or multi-hot) targets.

    Adapted from TESTA `models/testa_retrieval.py` L123-L154.
    """
    targets = positives.float() / positives.sum(dim=1, keepdim=True)
    with torch.no_grad():
        targets_v2t = alpha * F.softmax(video_feat_m @ text_targets.T / temp, dim=1) + (1 - alpha) * targets
        targets_t2v = alpha * F.softmax(text_feat_m @ video_targets.T / temp, dim=1) + (1 - alpha) * targets
    loss_v2t = -(F.log_softmax(video_feat @ text_targets.T.to(video_feat.dtype) / temp, dim=1) * targets_v2t)
    loss_t2v = -(F.log_softmax(text_feat @ video_targets.T.to(text_feat.dtype) / temp, dim=1) * targets_t2v)
    return (loss_v2t.sum(dim=1).mean() + loss_t2v.sum(dim=1).mean()) / 2


def hard_negative_weights(
    video_feat: torch.Tensor,
    text_feat: torch.Tensor,
    video_candidates: torch.Tensor,
    text_candidates: torch.Tensor,
    same_video: torch.Tensor,
    temp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VTM sampling weights of the local rows: ``softmax(similarity / temp)`` over the candidates, with every
    candidate of the same video (``same_video``, ``(batch, candidates)`` bool) set to 0. Returns the
    ``(video->text, text->video)`` weights; a row can be all zeros (no candidate of another video). Adapted from
    TESTA `models/testa_retrieval.py` L174-L186."""
    weights_v2t = F.softmax(video_feat @ text_candidates.T / temp, dim=1).masked_fill(same_video, 0)
    weights_t2v = F.softmax(text_feat @ video_candidates.T / temp, dim=1).masked_fill(same_video, 0)
    return weights_v2t, weights_t2v


def sample_hard_negatives(weights: torch.Tensor) -> torch.Tensor:
    """One negative per row of the ``(rows, candidates)`` sampling weights (``torch.multinomial``, as the released
    code draws them, TESTA `models/testa_retrieval.py` L193 and L204)."""
    return torch.multinomial(weights, 1).squeeze(1)


def vtm_loss(logits: torch.Tensor, num_positives: int) -> torch.Tensor:
    """Matching loss: cross-entropy of the ``(pairs, 2)`` logits whose first ``num_positives`` rows are matching
    pairs and the rest are hard negatives."""
    labels = torch.cat([torch.ones(num_positives), torch.zeros(logits.shape[0] - num_positives)])
    return F.cross_entropy(logits.float(), labels.long().to(logits.device))


def sequence_nll(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    pad_token_id: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-sequence sum of the (label-smoothed) next-token cross-entropy of ``input_ids`` under ``logits``.

    Position 0 ([DEC]) is never predicted; padding (``attention_mask == 0``, or ``pad_token_id`` without a mask) is
    ignored. With ``label_smoothing=0`` this is minus the log-likelihood of the sequence. Adapted from the released
    decoder's loss (TESTA `models/med.py` L905-L913, ``reduction="none"``).
    """
    targets = input_ids[:, 1:]
    valid = attention_mask[:, 1:].bool() if attention_mask is not None else targets.ne(pad_token_id)
    targets = targets.masked_fill(~valid, -100)
    loss = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, reduction="none", label_smoothing=label_smoothing
    )
    return loss.sum(dim=1)


def sequence_log_likelihood(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence log-likelihood of ``input_ids`` under ``logits``: the sum of the log-probabilities of the tokens
    at positions ``1..`` where ``mask`` is true (position 0, [DEC], is never predicted). It is
    ``-sequence_nll(..., label_smoothing=0.0)`` up to rounding, computed directly (the vocabulary's log-softmax,
    gathered), which is how answers are scored."""
    log_probs = logits[:, :-1].float().log_softmax(dim=-1)
    token_log_probs = log_probs.gather(2, input_ids[:, 1:, None]).squeeze(2) * mask[:, 1:]
    return token_log_probs.sum(dim=1)


__all__ = [
    "contrastive_positives",
    "hard_negative_weights",
    "sample_hard_negatives",
    "sequence_log_likelihood",
    "sequence_nll",
    "vtc_loss",
    "vtm_loss",
]
