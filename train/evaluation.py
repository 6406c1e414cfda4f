"""Evaluation shared by the training scripts and the demo: paragraph-to-video retrieval and VideoQA accuracy.

Retrieval follows the original protocol: every video is encoded once (sharded over processes, gathered with
``gather_for_metrics``, which drops the padding of uneven shards), texts are embedded, and the two-stage ranking
(VTC top-``k_test``, then the VTM head) is sharded over processes by query. Recall@K is reported in both
directions plus their mean.
"""

import time

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

from .loop import load_rows


def recall_at_k(scores: torch.Tensor, positives: list[set[int]], ks=(1, 5, 10)) -> dict[str, float]:
    """``scores (queries, candidates)``; a query counts as found at K when its best positive ranks in the top K.
    The rank counts the non-positive candidates scoring at least as high (ties count against the query)."""
    found = {k: 0 for k in ks}
    for row, targets in zip(scores, positives):
        best = max(row[t].item() for t in targets)
        rank = int((row >= best).sum().item()) - sum(int(row[t].item() >= best) for t in targets)
        for k in ks:
            found[k] += rank < k
    return {f"R@{k}": 100.0 * found[k] / len(positives) for k in ks}


class _VideoRows(torch.utils.data.Dataset):
    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        return self.paths[index]


@torch.no_grad()
def encode_videos(model, processor, paths: list[str], accelerator: Accelerator, batch_size: int, num_frames: int,
                  num_workers: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Encodes every video once, sharded over processes. Returns tokens, token sizes, features (in `paths` order,
    on the CPU) and the encoder's wall time on this process."""

    def collate(batch_paths: list[str]) -> torch.Tensor:
        return processor.video_processor(videos=batch_paths, num_frames=num_frames, frame_sampling="uniform")[
            "pixel_values"
        ]

    loader = accelerator.prepare(DataLoader(_VideoRows(paths), batch_size=batch_size, collate_fn=collate,
                                            num_workers=num_workers))
    tokens, sizes, features = [], [], []
    encoder_seconds = 0.0
    for pixel_values in loader:
        start = time.perf_counter()
        out = model.get_video_tokens(pixel_values.to(accelerator.device))
        feats = model.get_video_features(video_tokens=out.last_hidden_state, video_token_sizes=out.token_sizes)
        encoder_seconds += time.perf_counter() - start
        gathered = accelerator.gather_for_metrics((out.last_hidden_state, out.token_sizes, feats))
        tokens.append(gathered[0].cpu())
        sizes.append(gathered[1].cpu())
        features.append(gathered[2].cpu())
    return torch.cat(tokens), torch.cat(sizes), torch.cat(features), encoder_seconds


@torch.no_grad()
def evaluate_retrieval(model, processor, recipe: dict, accelerator: Accelerator, split: str | None = None) -> dict:
    """Paragraph-to-video (t2v) and video-to-paragraph (v2t) R@1/5/10 with two-stage ranking, plus mean recall.

    Also reports the chance level of R@1 (``100 / number of videos``) and the encoder's wall time.
    """
    model.eval()
    data, evaluation = recipe["data"], recipe.get("eval", {})
    rows = load_rows(recipe, split or data.get("eval_split", "test"), "retrieval", streaming=False)
    video_index: dict[str, int] = {}
    paths, texts, text_video = [], [], []
    for row in rows:
        key = str(row.get("video_id") or row["video"])
        if key not in video_index:
            video_index[key] = len(paths)
            paths.append(row["video"])
        texts.append(row["text"])
        text_video.append(video_index[key])
    device = accelerator.device
    tokens, sizes, video_features, encoder_seconds = encode_videos(
        model, processor, paths, accelerator, int(evaluation.get("batch_size", 8)), int(data.get("num_frames", 32)),
        int(data.get("num_workers", 0)),
    )
    encoded = processor.tokenizer(texts, padding="max_length", truncation=True,
                                  max_length=int(data.get("max_text_length", 64)), return_tensors="pt")
    input_ids, attention_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    text_features = torch.cat([
        model.get_text_features(input_ids[i : i + 256], attention_mask[i : i + 256]) for i in range(0, len(texts), 256)
    ])
    video_features = video_features.to(device)
    k = min(int(evaluation.get("k_test", 128)), len(paths), len(texts))

    # Two-stage ranking, sharded by query over processes.
    with accelerator.split_between_processes(list(range(len(texts)))) as text_rows:
        t2v = model.rank_videos(input_ids[text_rows], tokens, attention_mask[text_rows], video_token_sizes=sizes,
                                text_features=text_features[text_rows], video_features=video_features, k=k).scores
    with accelerator.split_between_processes(list(range(len(paths)))) as video_rows:
        v2t = model.rank_texts(input_ids, tokens[video_rows], attention_mask, video_token_sizes=sizes[video_rows],
                               text_features=text_features, video_features=video_features[video_rows], k=k).scores
    t2v = torch.cat([s.cpu() for s in gather_object([t2v.cpu()])])
    v2t = torch.cat([s.cpu() for s in gather_object([v2t.cpu()])])

    texts_of_video = [set() for _ in paths]
    for t, v in enumerate(text_video):
        texts_of_video[v].add(t)
    metrics = {f"t2v_{k_}": v for k_, v in recall_at_k(t2v, [{v} for v in text_video]).items()}
    metrics.update({f"v2t_{k_}": v for k_, v in recall_at_k(v2t, texts_of_video).items()})
    metrics["t2v_mean_recall"] = sum(metrics[f"t2v_R@{k_}"] for k_ in (1, 5, 10)) / 3
    metrics["v2t_mean_recall"] = sum(metrics[f"v2t_R@{k_}"] for k_ in (1, 5, 10)) / 3
    metrics["mean_recall"] = (metrics["t2v_mean_recall"] + metrics["v2t_mean_recall"]) / 2
    metrics["num_videos"], metrics["num_texts"] = len(paths), len(texts)
    metrics["chance_R@1"] = 100.0 / len(paths)
    metrics["encoder_seconds"] = encoder_seconds
    metrics["video_tokens"] = tokens.shape[1]
    return metrics


@torch.no_grad()
def evaluate_qa(model, processor, recipe: dict, accelerator: Accelerator, answer_list: list[str]) -> dict:
    """Exact-match accuracy by ranking ``answer_list`` (built from the TRAINING answers: the original used the
    evaluated split's own answers, a leak), sharded over processes."""
    model.eval()
    data, evaluation = recipe["data"], recipe.get("eval", {})
    rows = load_rows(recipe, data.get("eval_split", "test"), "qa", streaming=False)
    device = accelerator.device
    answers = processor.tokenizer(answer_list, padding="longest", return_tensors="pt")
    correct = total = 0
    with accelerator.split_between_processes(list(range(len(rows)))) as mine:
        batch_size = int(evaluation.get("batch_size", 8))
        for start in range(0, len(mine), batch_size):
            batch = [rows[i] for i in mine[start : start + batch_size]]
            pixel_values = processor.video_processor(videos=[r["video"] for r in batch],
                                                     num_frames=int(data.get("num_frames", 32)))["pixel_values"]
            questions = processor.tokenizer([r["question"] for r in batch], padding="longest", truncation=True,
                                            max_length=int(data.get("max_question_length", 35)), return_tensors="pt")
            ranked = model.rank_answers(
                questions["input_ids"].to(device), pixel_values.to(device), answers["input_ids"].to(device),
                attention_mask=questions["attention_mask"].to(device),
                answer_attention_mask=answers["attention_mask"].to(device),
                k=min(int(evaluation.get("k_test", 128)), len(answer_list)),
            )
            for row, index in zip(batch, ranked.answer_indices.tolist()):
                correct += int(answer_list[index] == row["answer"])
                total += 1
    counts = accelerator.reduce(torch.tensor([correct, total], device=device), reduction="sum").tolist()
    return {"accuracy": 100.0 * counts[0] / max(counts[1], 1), "num_questions": counts[1],
            "num_candidate_answers": len(answer_list)}
