"""MTEB evaluation of TESTA models on local video-text data, offline, decoded by the library (no torchcodec, no FFmpeg).

    import mteb
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from train.mteb_evaluation import TestaMTEBCrossEncoder, TestaMTEBEncoder, first_stage_top_k, local_retrieval_task

    encoder = TestaMTEBEncoder(SentenceTransformer("outputs/demo/runs/b/final", trust_remote_code=True))
    task = local_retrieval_task("outputs/demo/data", split="test", direction="t2v")
    mteb.evaluate(encoder, task, cache=None)                                # first stage (cosine)
    reranking = local_retrieval_task("outputs/demo/data", direction="t2v", top_ranked=first_stage_top_k(encoder, task, 8))
    mteb.evaluate(TestaMTEBCrossEncoder(CrossEncoder(reranker_folder, trust_remote_code=True)), reranking, cache=None)

- `local_retrieval_task` builds an MTEB `Any2AnyRetrieval` task (``t2v`` or ``v2t``) from any split of a dataset in
  the builders' format (``video``/``text`` rows; several rows may share a video). Its video column holds paths.
- `TestaMTEBEncoder` / `TestaMTEBCrossEncoder` wrap a Sentence Transformers bi-encoder / re-ranker of a TESTA folder:
  they pass videos as ``{"video": path}`` (TESTA's processor decodes them with decord or PyAV) instead of MTEB's
  torchcodec collator, and declare the modalities ``["text", "video"]``, which MTEB does not read from an in-memory
  model (it does from a Hub model's ``sentence_bert_config.json``, which `save_pretrained` writes).
- `first_stage_top_k` gives the bi-encoder's top-``k`` per query, for a re-ranking task (``top_ranked``).

Requires the `mteb` and `st` extras (``pip install -e ".[mteb,st]"``).
"""

from typing import Any

import numpy as np
import torch
from datasets import Dataset
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata
from mteb.models.sentence_transformer_wrapper import CrossEncoderWrapper, SentenceTransformerEncoderWrapper
from mteb.types import PromptType

from processing.data import load_split

DIRECTIONS = ("t2v", "v2t")
MODALITIES = ["text", "video"]


def retrieval_split(data_dir: str, split: str = "test", direction: str = "t2v") -> RetrievalSplitData:
    """Queries, corpus and relevance of one split in MTEB's format: t2v queries are the texts (ids ``t<row>``) and
    the corpus the distinct videos (ids ``v<n>``, first-seen order); v2t the other way round. A text is relevant to
    its own video; a video to all its texts."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}: use one of {DIRECTIONS}.")
    rows = load_split(data_dir, split=split)
    for column in ("video", "text"):
        if column not in rows.column_names:
            raise ValueError(f"{data_dir!r} split {split!r} has no {column!r} column (columns: {rows.column_names}).")
    video_ids: dict[str, str] = {}
    for video in rows["video"]:
        video_ids.setdefault(video, f"v{len(video_ids)}")
    texts = Dataset.from_dict({"id": [f"t{i}" for i in range(len(rows))], "text": list(rows["text"])})
    videos = Dataset.from_dict({"id": list(video_ids.values()), "video": list(video_ids)})
    if direction == "t2v":
        relevant = {f"t{i}": {video_ids[video]: 1} for i, video in enumerate(rows["video"])}
        return RetrievalSplitData(queries=texts, corpus=videos, relevant_docs=relevant, top_ranked=None)
    relevant: dict[str, dict[str, int]] = {}
    for i, video in enumerate(rows["video"]):
        relevant.setdefault(video_ids[video], {})[f"t{i}"] = 1
    return RetrievalSplitData(queries=videos, corpus=texts, relevant_docs=relevant, top_ranked=None)


def local_retrieval_task(data_dir: str, split: str = "test", direction: str = "t2v",
                         top_ranked: dict[str, list[str]] | None = None, name: str | None = None) -> AbsTaskRetrieval:
    """An MTEB retrieval task over a local dataset (see the module docstring); with ``top_ranked`` (query id ->
    candidate ids), a re-ranking task: models score only those candidates."""
    data = retrieval_split(data_dir, split, direction)
    data["top_ranked"] = top_ranked
    metadata = TaskMetadata(
        name=name or f"TestaLocal{direction.upper()}Retrieval",
        description=f"Local {direction} video-text retrieval over {data_dir} ({split}).",
        reference=None,
        dataset={"path": str(data_dir), "revision": "local"},
        type="Any2AnyRetrieval",
        category=direction,
        eval_splits=[split],
        eval_langs=["eng-Latn"],
        main_score="recall_at_1",
        modalities=MODALITIES,
        date=None,
        domains=None,
        task_subtypes=None,
        license=None,
        annotations_creators=None,
        dialect=None,
        sample_creation=None,
        bibtex_citation="",
    )

    class LocalTask(AbsTaskRetrieval):
        def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
            if self.data_loaded:
                return
            self.dataset = {"default": {split: data}}
            self.data_loaded = True

    LocalTask.metadata = metadata
    return LocalTask()


def _video_items(paths: list[str]) -> list[dict[str, str]]:
    return [{"video": path} for path in paths]


class TestaMTEBEncoder(SentenceTransformerEncoderWrapper):
    """MTEB's Sentence Transformers wrapper for a TESTA bi-encoder: videos are handed to TESTA's processor as paths."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.mteb_model_meta = self.mteb_model_meta.model_copy(update={"modalities": MODALITIES})

    def encode(self, inputs: Any, *, task_metadata: TaskMetadata, hf_split: str, hf_subset: str,
               prompt_type: PromptType | None = None, **kwargs: Any) -> np.ndarray:
        dataset = inputs.dataset
        if "video" not in dataset.features:
            return super().encode(inputs, task_metadata=task_metadata, hf_split=hf_split, hf_subset=hf_subset,
                                  prompt_type=prompt_type, **kwargs)
        encode = self.model.encode_query if prompt_type == PromptType.query else self.model.encode_document
        return encode(_video_items(list(dataset["video"])), batch_size=kwargs.get("batch_size", 8),
                      show_progress_bar=False, convert_to_numpy=True)


class TestaMTEBCrossEncoder(CrossEncoderWrapper):
    """MTEB's CrossEncoder wrapper for TESTA's re-ranker (`modeling_testa.cross_encoder`): pairs of text and
    ``{"video": path}``."""

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.mteb_model_meta = self.mteb_model_meta.model_copy(update={"modalities": MODALITIES})

    def _iter_inputs(self, loader: Any, prefix: str) -> Any:
        dataset, size = loader.dataset, loader.batch_size or 1
        for start in range(0, len(dataset), size):
            chunk = dataset[start : start + size]
            if "video" in chunk:
                yield _video_items(chunk["video"])
            else:
                yield [prefix + text for text in chunk["text"]]


def first_stage_top_k(encoder: TestaMTEBEncoder, task: AbsTaskRetrieval, k: int) -> dict[str, list[str]]:
    """The bi-encoder's ``k`` nearest corpus ids of every query of ``task`` (cosine; ties by corpus order)."""
    task.load_data()
    split = task.metadata.eval_splits[0]
    data = task.dataset["default"][split]
    model = encoder.model

    def embed(dataset: Dataset, query: bool) -> torch.Tensor:
        if "video" in dataset.column_names:
            items = _video_items(list(dataset["video"]))
        else:
            items = list(dataset["text"])
        encode = model.encode_query if query else model.encode_document
        return encode(items, convert_to_tensor=True, show_progress_bar=False)

    similarity = embed(data["queries"], True) @ embed(data["corpus"], False).T
    order = torch.sort(similarity, dim=1, descending=True, stable=True).indices[:, :k]
    corpus_ids = list(data["corpus"]["id"])
    return {query: [corpus_ids[j] for j in row] for query, row in zip(data["queries"]["id"], order.tolist())}


__all__ = ["TestaMTEBCrossEncoder", "TestaMTEBEncoder", "first_stage_top_k", "local_retrieval_task",
           "retrieval_split"]
