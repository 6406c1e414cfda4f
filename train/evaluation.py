"""Evaluation shared by the training scripts and the demo: paragraph-to-video retrieval and VideoQA accuracy.

Retrieval follows the original protocol (two-stage ranking: the cosine of the contrastive embeddings picks the top
``eval.k_test`` candidates of every query, the matching head re-scores them with ``itm_logit[:, 1] + cosine``) with
memory bounded by the number of candidates, not by the collection:

1. Every evaluated video is decoded and encoded **once**, each process encoding a contiguous share, into an on-disk
   token store (`testa_search.store.video_store`: tokens in fp16 by default, one shard per process, plus the
   embeddings). A video that cannot be decoded is reported (path and reason) and counted as a miss.
2. Every process reads all embeddings (``num_videos x projection_dim``) and embeds all texts, then ranks its share
   of the queries in chunks of ``rerank_batch_size`` queries: the chunk's similarity row, its top-k, and the ITM
   re-rank of the chunk's candidates, reading only their tokens from the store. Only the rank of each query's
   positive is kept and gathered.

Batch sizes in the recipe are global: ``eval.batch_size`` videos per encoder step over all processes. The store goes
to ``store_dir`` (argument), else ``eval.store_dir`` (recipe), else a temporary directory that is deleted
afterwards; with several machines it must be a directory on a filesystem every process sees. Recall@K is reported
in both directions plus their mean.
"""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from torch.utils.data import DataLoader

from testa_search.build import IndexBuild
from testa_search.homes import IndexEntry, StoreHome
from testa_search.encoding import DecodeVideos
from modeling_testa.ranking import RankingOptions, ranked_order, two_stage_scores
from testa_search.store.video_store import VideoTokenStore, missing_shards, shard_range
from modeling_testa.process_start import dataloader_workers

from .loop import load_rows
from .recipe import Recipe, as_recipe

RERANK_BATCH_SIZE = 128
"""(query, candidate) pairs per matching-head forward, and queries per ranking chunk (as `model.rank_videos`)."""


METRICS_DIR = Path(__file__).resolve().parent / "metrics"
"""The `evaluate` modules that compute every reported number (``train/metrics/<name>/<name>.py``)."""
RETRIEVAL_KS = (1, 5, 10)


QA_ACCURACY_KEY = "accuracy"
"""The key of the overall exact-match accuracy, in percent, that `evaluate_qa` returns (and a QA run writes to
``metrics.json``): the one the ``video_qa_accuracy`` metric module computes. That module stays standalone (it can be
pushed to the Hub as a metric), so it writes the literal; `evaluate_qa` checks that it did, and readers
(`train.demo`) read this constant."""


def load_metric(name: str, config_name: str | None = None):
    """``evaluate.load`` of one of the repository's metric modules (a local folder: works offline)."""
    import evaluate  # imported here: it takes seconds and only evaluation needs it

    return evaluate.load(str(METRICS_DIR / name), config_name)


class _Items(torch.utils.data.Dataset):
    def __init__(self, items: list[tuple[int, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return self.items[index]


def per_process_batch_size(global_batch_size: int, num_processes: int) -> int:
    """A global batch size split over processes (at least 1 per process; never more than the global size)."""
    if int(global_batch_size) < 1:
        raise ValueError(f"eval.batch_size must be a positive int, got {global_batch_size!r}.")
    return max(1, int(global_batch_size) // num_processes)


@torch.no_grad()
def encode_to_store(model, items: list, collate: Callable, accelerator: Accelerator, directory: str | os.PathLike,
                    batch_size: int, num_workers: int = 0, token_dtype: torch.dtype = torch.float16,
                    names: list[str] | None = None, info: dict | None = None) -> tuple[VideoTokenStore, float]:
    """Encodes every item once into a scratch token store in ``directory`` (`build.IndexBuild` with
    ``replace``: the store holds exactly these items, in order, whatever the folder held before): process ``r``
    encodes its contiguous share and writes shard ``r``. ``collate([(index, item), ...])`` returns ``(indices,
    pixel_values or None, failures)`` (see `testa_search.encoding.DecodeVideos`); ``batch_size`` is global.
    Returns the opened store (on every process) and the encoder's wall time (the mean over processes). Failures are
    reported on the main process."""
    names = [str(item) for item in items] if names is None else names
    per_process = per_process_batch_size(batch_size, accelerator.num_processes)

    def decode(rows: list[IndexEntry], positions: list[int]) -> DataLoader:
        # the plan's rows are the items, in order: the caller's collate sees its own items
        dataset = _Items([(i, items[i]) for i in positions])
        return DataLoader(dataset, batch_size=per_process, collate_fn=collate, num_workers=num_workers,
                          prefetch_factor=1 if num_workers else None,
                          **dataloader_workers(num_workers, dataset, collate))

    build = IndexBuild(StoreHome(directory), {**(info or {}), "token_dtype": str(token_dtype).replace("torch.", "")},
                       command="train.evaluation", replace=True, num_workers=num_workers,
                       finish_options={"first_stage": False, "require_encoded": False})
    try:
        result = build.run(model, [IndexEntry(name) for name in names], decode)
    except (OSError, ValueError, RuntimeError) as error:
        missing = missing_shards(directory, accelerator.num_processes) if Path(directory).is_dir() else []
        if missing and "lacks shards" in str(error):  # several machines that do not share the folder
            raise FileNotFoundError(
                f"The evaluation store {os.fspath(directory)!r} lacks the shards of processes {missing}: with several "
                "machines, set eval.store_dir (or pass store_dir) to a directory on a filesystem every process sees."
            ) from None
        raise
    store = VideoTokenStore(directory)
    if accelerator.is_main_process:
        for failure in store.failures:
            print(f"evaluation: video {failure['video']!r} could not be encoded and counts as a miss: "
                  f"{failure['reason']}", flush=True)
    return store, result.report.encode_seconds / max(1, result.report.processes)


@torch.no_grad()
def _rank_direction(model, store: VideoTokenStore, input_ids, attention_mask, text_features, queries_are_texts: bool,
                    queries: list[int], positives: list[set[int]], k: int, batch_size: int,
                    itm_score: str = "logit", add_cosine: bool = True) -> list[tuple[int, list[int]]]:
    """Two-stage ranking (`modeling_testa.ranking`) of ``queries`` (text rows, or video indices when
    ``queries_are_texts`` is False), in chunks of ``batch_size`` queries; returns ``(query, its ranking)``: the ``k``
    re-ranked candidates, then the next items by cosine, ``max(k, max(RETRIEVAL_KS))`` items in all, ties counting
    against the query, so R@K is exact for every reported K whatever ``k``. Videos that could not be encoded are never
    ranked; a query without a findable positive gets an empty ranking (a miss)."""
    results = [(q, []) for q in queries if not positives[q]]
    queries = [q for q in queries if positives[q]]
    if not queries:
        return results
    ranking = two_stage_scores(
        model, queries_are_texts=queries_are_texts, input_ids=input_ids, attention_mask=attention_mask,
        text_features=text_features, video_features=store.embeddings, read_tokens=store.read_tokens,
        options=RankingOptions(k=k, itm_score=itm_score, add_cosine=add_cosine, batch_size=batch_size),
        queries=torch.tensor(queries, dtype=torch.long), excluded=~store.valid if queries_are_texts else None,
    )
    length = max(k, max(RETRIEVAL_KS))
    for row, cosine, query in zip(ranking.scores.cpu(), ranking.similarity.cpu(), queries):
        results.append((query, ranked_order(row, cosine, length, positives[query])))
    return results


@torch.no_grad()
def retrieval_metrics(model, store: VideoTokenStore, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      text_video: list[int], accelerator: Accelerator, k_test: int,
                      rerank_batch_size: int = RERANK_BATCH_SIZE) -> dict:
    """t2v and v2t R@1/5/10 (and means) of texts ``input_ids`` (text ``t`` describes video ``text_video[t]``)
    against the videos of ``store``; the queries of both directions are split over processes (a process may get
    none). Every process gathers the queries' ranked candidate lists (``k_test`` each) and computes the numbers with
    the `video_text_retrieval` metric module; a positive outside its query's ranking is a miss."""
    device = accelerator.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    num_texts, num_videos = input_ids.shape[0], len(store)
    text_features = torch.cat([
        model.get_text_features(input_ids[i : i + 256], attention_mask[i : i + 256]).pooler_output for i in range(0, num_texts, 256)
    ]) if num_texts else torch.empty(0, store.embeddings.shape[1], device=device)
    valid = store.valid.tolist()
    num_valid = sum(valid)
    k = min(int(k_test), num_valid, num_texts)
    rank, world = accelerator.process_index, accelerator.num_processes
    text_positives = [{v} if valid[v] else set() for v in text_video]
    video_positives = [set() for _ in range(num_videos)]
    for t, v in enumerate(text_video):
        if valid[v]:
            video_positives[v].add(t)
    if k < 1:  # nothing could be encoded (or no texts): every query is a miss
        t2v = [(q, []) for q in range(num_texts)]
        v2t = [(q, []) for q in range(num_videos)]
    else:
        t2v_share = list(range(*shard_range(num_texts, rank, world)))
        v2t_share = list(range(*shard_range(num_videos, rank, world)))
        t2v = gather_object(_rank_direction(model, store, input_ids, attention_mask, text_features, True, t2v_share,
                                            text_positives, k, rerank_batch_size))
        v2t = gather_object(_rank_direction(model, store, input_ids, attention_mask, text_features, False, v2t_share,
                                            video_positives, k, rerank_batch_size))
    t2v_lists = [ranked for _, ranked in sorted(t2v, key=lambda item: item[0])]
    v2t_lists = [ranked for _, ranked in sorted(v2t, key=lambda item: item[0])]
    if len(t2v_lists) != num_texts or len(v2t_lists) != num_videos:
        raise RuntimeError(f"Gathered {len(t2v_lists)}/{num_texts} text and {len(v2t_lists)}/{num_videos} video "
                           "rankings: the processes disagree on the evaluated data.")
    texts_of_video = [[] for _ in range(num_videos)]
    for t, v in enumerate(text_video):
        texts_of_video[v].append(t)
    # A video no text describes has nothing to find: it stays a query and a miss (-1 is never a candidate).
    texts_of_video = [texts or [-1] for texts in texts_of_video]
    result = load_metric("video_text_retrieval", "ranked_lists").compute(
        predictions=t2v_lists, references=[[v] for v in text_video], reverse_predictions=v2t_lists,
        reverse_references=texts_of_video, ks=RETRIEVAL_KS, truncated="miss", return_ranks=True,
    )
    metrics = {f"{direction}_R@{k}": result[f"{direction}_R@{k}"] for direction in ("t2v", "v2t") for k in RETRIEVAL_KS}
    metrics["t2v_mean_recall"], metrics["v2t_mean_recall"] = result["t2v_R_mean"], result["v2t_R_mean"]
    metrics["mean_recall"] = result["R_mean"]
    metrics["t2v_ranks"], metrics["v2t_ranks"] = result["t2v_ranks"], result["v2t_ranks"]
    return metrics


@torch.no_grad()
def evaluate_retrieval(model, processor, recipe: "Recipe | dict", accelerator: Accelerator, split: str | None = None,
                       store_dir: str | os.PathLike | None = None, token_dtype: torch.dtype = torch.float16,
                       rerank_batch_size: int = RERANK_BATCH_SIZE) -> dict:
    """Paragraph-to-video (t2v) and video-to-paragraph (v2t) R@1/5/10 with two-stage ranking, plus mean recall.

    Also reports the chance level of R@1 (``100 / number of videos``), the encoder's wall time on this process, and
    the videos that could not be decoded (``failed_videos``: path and reason; each counts as a miss). The token
    store goes to ``store_dir``, else the recipe's ``eval.store_dir``, else a temporary directory (removed
    afterwards); ``token_dtype`` is its token precision (fp16 as the original's ``--low_resource_eval``).
    """
    model.eval()
    recipe = as_recipe(recipe)  # the defaults are the recipe's (train/recipe.py), declared once
    data, evaluation = recipe.data, recipe.eval
    split = split or data.eval_split
    rows = load_rows(recipe, split, "retrieval", streaming=False)
    video_index: dict[str, int] = {}
    paths, texts, text_video = [], [], []
    for row in rows:
        key = str(row.get("video_id") or row["video"])
        if key not in video_index:
            video_index[key] = len(paths)
            paths.append(row["video"])
        texts.append(row["text"])
        text_video.append(video_index[key])
    if not paths:
        raise ValueError(f"The evaluation split {split!r} of {data.dataset!r} has no rows.")

    store_dir = store_dir or evaluation.store_dir
    temporary = store_dir is None
    if temporary:
        made = [tempfile.mkdtemp(prefix="testa-eval-store-") if accelerator.is_main_process else None]
        store_dir = broadcast_object_list(made)[0] if accelerator.num_processes > 1 else made[0]
    try:
        store, encoder_seconds = encode_to_store(
            model, paths, DecodeVideos(processor.video_processor, data.num_frames), accelerator,
            store_dir, evaluation.batch_size, data.num_workers, token_dtype, info={"num_frames": data.num_frames},
        )
        encoded = processor.tokenizer(texts, padding="max_length", truncation=True,
                                      max_length=data.max_text_length, return_tensors="pt")
        metrics = retrieval_metrics(model, store, encoded["input_ids"], encoded["attention_mask"], text_video,
                                    accelerator, evaluation.k_test, rerank_batch_size)
        del metrics["t2v_ranks"], metrics["v2t_ranks"]
        metrics["num_videos"], metrics["num_texts"] = len(paths), len(texts)
        metrics["chance_R@1"] = 100.0 / len(paths)
        metrics["encoder_seconds"] = encoder_seconds
        metrics["video_tokens"] = store.num_tokens
        metrics["num_failed_videos"] = len(store.failures)
        metrics["failed_videos"] = [{"video": f["video"], "reason": f["reason"]} for f in store.failures]
        store.close()
        accelerator.wait_for_everyone()  # every process is done reading before the store is removed
    finally:
        if temporary and accelerator.is_main_process:
            shutil.rmtree(store_dir, ignore_errors=True)
    return metrics


@torch.no_grad()
def evaluate_qa(model, processor, recipe: "Recipe | dict", accelerator: Accelerator, answer_list: list[str]) -> dict:
    """Exact-match accuracy by ranking ``answer_list`` (built from the TRAINING answers: the original used the
    evaluated split's own answers, a leak), sharded over processes."""
    model.eval()
    recipe = as_recipe(recipe)
    data, evaluation = recipe.data, recipe.eval
    rows = load_rows(recipe, data.eval_split, "qa", streaming=False)
    device = accelerator.device
    answers = processor.tokenizer(answer_list, padding="longest", return_tensors="pt")
    predicted: list[tuple[int, str]] = []
    with accelerator.split_between_processes(list(range(len(rows)))) as mine:
        batch_size = per_process_batch_size(evaluation.batch_size, accelerator.num_processes)
        for start in range(0, len(mine), batch_size):
            batch = [rows[i] for i in mine[start : start + batch_size]]
            pixel_values = processor.video_processor(videos=[r["video"] for r in batch],
                                                     num_frames=data.num_frames)["pixel_values"]
            questions = processor.tokenizer([r["question"] for r in batch], padding="longest", truncation=True,
                                            max_length=data.max_question_length, return_tensors="pt")
            ranked = model.rank_answers(
                questions["input_ids"].to(device), pixel_values.to(device), answers["input_ids"].to(device),
                attention_mask=questions["attention_mask"].to(device),
                answer_attention_mask=answers["attention_mask"].to(device),
                k=min(evaluation.k_test, len(answer_list)),
            )
            for position, index in zip(mine[start : start + batch_size], ranked.answer_indices.tolist()):
                predicted.append((position, answer_list[index]))
    predicted = sorted(gather_object(predicted)) if accelerator.num_processes > 1 else predicted
    if len(predicted) != len(rows):
        raise RuntimeError(f"Gathered {len(predicted)} answers for {len(rows)} questions.")
    types = [row.get("type") for row in rows]
    typed = all(t is not None for t in types)
    result = load_metric("video_qa_accuracy").compute(
        predictions=[answer for _, answer in predicted], references=[row["answer"] for row in rows],
        question_types=types if typed else None,
    )
    if not isinstance(result.get(QA_ACCURACY_KEY), (int, float)):  # the metric module and its readers disagree
        raise RuntimeError(f"The video_qa_accuracy metric returned no {QA_ACCURACY_KEY!r} (got {sorted(result)}).")
    return {**result, "num_candidate_answers": len(answer_list)}
