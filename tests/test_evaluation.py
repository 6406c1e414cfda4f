"""Evaluation through the on-disk video store (testa_search/store/video_store.py, train/evaluation.py).

The reference everywhere is the in-memory two-stage ranking of the model (`rank_videos`/`rank_texts` on all tokens,
what the evaluation did before the store): the store path must give the same ranks with fp32 token storage, and the
same recalls within fp16 rounding of the matching-head scores with fp16 storage. A second run on 2 processes must give
what 1 process gives, including a process with no share at all.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from helpers.evaluation import (
    NUM_VIDEOS,
    TEXT_VIDEO,
    PixelCollate,
    all_runs,
    pixel_inputs,
    recipe_for,
    store_metrics,
    text_inputs,
    tiny_model,
    tiny_processor,
    write_dataset,
)

from modeling_testa.ranking import match_scores
from testa_search.store.video_store import (
    VideoStoreWriter,
    VideoTokenStore,
    finalize_store,
)
from train.evaluation import (
    encode_to_store,
    evaluate_retrieval,
    per_process_batch_size,
)

REPO = Path(__file__).resolve().parents[1]
K, ENCODE_BATCH, PAIRS = 5, 5, 4


def rank_of_positive(row: torch.Tensor, targets: set[int], cosine: torch.Tensor | None = None,
                     length: int = 10) -> int | None:
    """Plain re-computation of a query's rank from its two-stage score row (re-ranked candidates finite, the rest
    -inf) and, for the rest, its cosine row: every re-ranked candidate comes before every other item. The rank is
    the number of non-positive items ordered at least as high as the best positive (ties count against the query);
    None (a miss) when there is no positive or it falls beyond the first ``length`` items."""
    cosine = torch.full_like(row, float("-inf")) if cosine is None else cosine
    keys = [(0, -s) if s != float("-inf") else (1, -c) for s, c in zip(row.tolist(), cosine.tolist())]
    found = [t for t in targets if keys[t][1] != float("inf")]
    if not found:
        return None
    best = min(keys[t] for t in found)
    rank = sum(1 for i, key in enumerate(keys) if i not in targets and key[1] != float("inf") and key <= best)
    return rank if rank < length else None


def recall_from_ranks(ranks: list[int | None], ks=(1, 5, 10)) -> dict[str, float]:
    return {f"R@{k}": 100.0 * sum(r is not None and r < k for r in ranks) / len(ranks) for k in ks}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    """In-memory encoding (same batches as the store path) and the model's own two-stage ranking."""
    pixels = pixel_inputs()
    ids, mask = text_inputs()
    tokens, sizes, features = [], [], []
    with torch.no_grad():
        for i in range(0, NUM_VIDEOS, ENCODE_BATCH):
            out = model.get_video_tokens(pixels[i : i + ENCODE_BATCH])
            tokens.append(out.last_hidden_state)
            sizes.append(out.token_sizes)
            features.append(model.get_video_features(video_tokens=out.last_hidden_state,
                                                     video_token_sizes=out.token_sizes).pooler_output)
        tokens, sizes, features = torch.cat(tokens), torch.cat(sizes), torch.cat(features)
        text_features = model.get_text_features(ids, mask).pooler_output
    return {"tokens": tokens, "sizes": sizes, "features": features, "text_features": text_features}


def in_memory_ranks(model, ref, tokens, text_video=TEXT_VIDEO, videos=None):
    """Ranks of every query's positive with `model.rank_videos`/`rank_texts` over `videos` (all by default)."""
    videos = list(range(NUM_VIDEOS)) if videos is None else videos
    ids, mask = text_inputs()
    texts = [t for t, v in enumerate(text_video) if v in videos]
    column = {v: j for j, v in enumerate(videos)}
    k = min(K, len(videos), len(text_video))
    kwargs = {"video_token_sizes": ref["sizes"][videos], "video_features": ref["features"][videos], "k": k,
              "batch_size": PAIRS}
    with torch.no_grad():
        t2v = model.rank_videos(ids[texts], tokens[videos], mask[texts], text_features=ref["text_features"][texts],
                                **kwargs).scores
        v2t = model.rank_texts(ids, tokens[videos], mask, text_features=ref["text_features"], **kwargs).scores
    cosine = ref["text_features"] @ ref["features"][videos].T
    length = max(k, 10)
    t2v_ranks = [None] * len(text_video)
    for row, t in zip(t2v, texts):
        t2v_ranks[t] = rank_of_positive(row, {column[text_video[t]]}, cosine[t], length)
    v2t_ranks = [None] * NUM_VIDEOS
    for j, (row, v) in enumerate(zip(v2t, videos)):
        v2t_ranks[v] = rank_of_positive(row, {t for t, u in enumerate(text_video) if u == v}, cosine[:, j], length)
    return t2v_ranks, v2t_ranks


def test_recall_helpers_hand_worked():
    scores = torch.tensor([[0.9, 0.5, 0.5, 0.1], [0.2, 0.8, 0.8, 0.3], [0.0, 0.0, 0.0, 0.0]])
    # row 0: positive 0 is first; row 1: positive 2 ties with 1 (ties count against it) -> rank 1; row 2: no positive
    ranks = [rank_of_positive(row, targets) for row, targets in zip(scores, [{0}, {2}, set()])]
    assert ranks == [0, 1, None]
    assert [per_process_batch_size(256, 8), per_process_batch_size(5, 2), per_process_batch_size(1, 8)] == [32, 2, 1]
    with pytest.raises(ValueError, match="eval.batch_size"):
        per_process_batch_size(0, 2)


def test_store_reads_exactly_the_written_tokens(model, reference, tmp_path):
    accelerator = Accelerator(cpu=True)
    names = [f"video{i}" for i in range(NUM_VIDEOS)]
    for dtype, tolerance in ((torch.float32, 0.0), (torch.float16, 1e-3), (torch.bfloat16, 8e-3)):
        store, _ = encode_to_store(model, names, PixelCollate(pixel_inputs()), accelerator, tmp_path / str(dtype),
                                   ENCODE_BATCH, token_dtype=dtype)
        order = torch.tensor([7, 0, 7, 11, 3])  # any order, repeats
        tokens = store.read_tokens(order)
        assert tokens.dtype == dtype and tokens.shape == (5, *reference["tokens"].shape[1:])
        expected = reference["tokens"][order]
        if tolerance == 0.0:
            assert torch.equal(tokens, expected)
        else:
            torch.testing.assert_close(tokens.float(), expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(store.read_token_sizes(order), reference["sizes"][order])
        assert torch.equal(store.embeddings, reference["features"])
        assert store.tokens[3].shape == reference["tokens"][3].shape and store.tokens.shape[0] == NUM_VIDEOS
        assert store.videos == names and store.failures == [] and bool(store.valid.all())
        size = NUM_VIDEOS * reference["tokens"][0].numel() * tokens.element_size()
        assert os.path.getsize(tmp_path / str(dtype) / "tokens-00000.bin") == size
        store.close()


def test_store_rejects_bad_input(tmp_path):
    writer = VideoStoreWriter(tmp_path, 0, 0, 3, token_dtype=torch.float32)
    writer.add_batch([0], torch.zeros(1, 4, 2), None, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="fixed number of tokens"):
        writer.add_batch([1], torch.zeros(1, 5, 2), None, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="already added"):
        writer.add_batch([0], torch.zeros(1, 4, 2), None, torch.zeros(1, 3))
    with pytest.raises(IndexError, match="outside"):
        writer.add_failure(3, "x.mp4", "bad")
    writer.add_failure(2, "broken.mp4", "VideoDecodingError: moov atom not found")
    with pytest.raises(ValueError, match=r"\[1\] of shard 0 were never added"):
        writer.close()
    with pytest.raises(ValueError, match="Unsupported token dtype"):
        VideoStoreWriter(tmp_path / "b", 0, 0, 1, token_dtype=torch.int16)  # int8 is supported (per-token scales)
    with pytest.raises(FileNotFoundError, match=r"lacks shards \[0, 1\]"):
        finalize_store(tmp_path, ["a", "b", "c"], 2)
    with pytest.raises(FileNotFoundError, match="video_store.json"):
        VideoTokenStore(tmp_path / "nowhere")

    good = VideoStoreWriter(tmp_path / "c", 0, 0, 2, token_dtype=torch.float32)
    good.add_batch([1], torch.ones(1, 4, 2), None, torch.ones(1, 3))
    good.add_failure(0, "broken.mp4", "VideoDecodingError: moov atom not found")
    good.close()
    finalize_store(tmp_path / "c", ["broken.mp4", "fine.mp4"], 1)
    store = VideoTokenStore(tmp_path / "c")
    assert store.valid.tolist() == [False, True] and store.read_token_sizes([1]) is None
    assert torch.equal(store.read_tokens([1]), torch.ones(1, 4, 2))
    with pytest.raises(ValueError, match="broken.mp4"):
        store.read_tokens([0, 1])
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        store.read_tokens([2])


def test_store_ranking_equals_in_memory_ranking_fp32(model, reference, tmp_path):
    metrics = store_metrics(model, Accelerator(cpu=True), tmp_path, k_test=K, batch_size=ENCODE_BATCH,
                            rerank_batch_size=PAIRS, token_dtype=torch.float32)
    t2v, v2t = in_memory_ranks(model, reference, reference["tokens"])
    assert metrics["t2v_ranks"] == t2v and metrics["v2t_ranks"] == v2t
    assert metrics["t2v_R@1"] == pytest.approx(recall_from_ranks(t2v)["R@1"])
    assert metrics["v2t_R@5"] == pytest.approx(recall_from_ranks(v2t)["R@5"])
    # the ranks are not trivial: some positives are found, some are not
    assert 0 < metrics["t2v_R@10"] < 100 and any(r == 0 for r in t2v)


def test_store_ranking_fp16_is_within_fp16_rounding(model, reference, tmp_path):
    metrics = store_metrics(model, Accelerator(cpu=True), tmp_path / "fp16", token_dtype=torch.float16,
                            k_test=K, batch_size=ENCODE_BATCH, rerank_batch_size=PAIRS)
    t2v, v2t = in_memory_ranks(model, reference, reference["tokens"])
    for key in ("t2v_R@1", "t2v_R@5", "t2v_R@10", "v2t_R@1", "v2t_R@5", "v2t_R@10"):
        direction = t2v if key.startswith("t2v") else v2t
        assert metrics[key] == pytest.approx(recall_from_ranks(direction)[key[4:]]), key
    # no two candidates of these queries are within fp16 rounding of each other, so even the ranks agree
    assert metrics["t2v_ranks"] == t2v and metrics["v2t_ranks"] == v2t
    # the matching-head scores of the same pairs, from fp16 tokens on disk and fp32 tokens in memory
    store = VideoTokenStore(tmp_path / "fp16")
    ids, mask = text_inputs()
    texts, videos = torch.arange(len(TEXT_VIDEO)).repeat(2), torch.arange(2 * len(TEXT_VIDEO)) % NUM_VIDEOS
    from_store = match_scores(model, ids, mask, texts, videos, store.read_tokens, batch_size=PAIRS)
    in_memory = match_scores(model, ids, mask, texts, videos, lambda v: reference["tokens"][v], batch_size=PAIRS)
    assert not torch.equal(from_store, in_memory)  # fp16 storage really rounds
    torch.testing.assert_close(from_store, in_memory, rtol=0, atol=5e-3)
    store.close()


def test_undecodable_video_is_a_miss(model, reference, tmp_path, capsys):
    broken = 3  # texts 6, 7 and 17 describe it
    metrics = store_metrics(model, Accelerator(cpu=True), tmp_path, broken=(broken,), k_test=K,
                            batch_size=ENCODE_BATCH, rerank_batch_size=PAIRS)
    assert metrics["failures"] == [{"index": broken, "video": f"video{broken}", "code": "unreadable",
                                    "reason": "synthetic failure"}]
    assert "'video3' could not be encoded" in capsys.readouterr().out
    # reference: the in-memory ranking over the other videos; the broken video's texts and itself are misses
    kept = [v for v in range(NUM_VIDEOS) if v != broken]
    t2v, v2t = in_memory_ranks(model, reference, reference["tokens"], videos=kept)
    assert [t2v[t] for t in (6, 7, 17)] == [None] * 3 and v2t[broken] is None
    assert metrics["t2v_ranks"] == t2v and metrics["v2t_ranks"] == v2t
    assert metrics["t2v_R@10"] <= 100 * (len(TEXT_VIDEO) - 3) / len(TEXT_VIDEO)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return str(write_dataset(tmp_path_factory.mktemp("eval_data")))


def test_evaluate_retrieval_reports_undecodable_video(dataset, tmp_path):
    processor = tiny_processor()
    model = tiny_model(vocab_size=len(processor.tokenizer))
    metrics = evaluate_retrieval(model, processor, recipe_for(dataset), Accelerator(cpu=True),
                                 store_dir=tmp_path / "store", token_dtype=torch.float32)
    assert metrics["num_videos"] == 6 and metrics["num_texts"] == 8 and metrics["num_failed_videos"] == 1
    assert metrics["failed_videos"][0]["video"].endswith("corrupt.mp4")
    assert "Error" in metrics["failed_videos"][0]["reason"]
    # reference: decode the five good videos, rank in memory with the model; the corrupt video's text is a miss
    rows = [json.loads(line) for line in Path(dataset).read_text().splitlines()]
    paths = list(dict.fromkeys(str(Path(dataset).parent / r["video"]) for r in rows if "corrupt" not in r["video"]))
    texts = [r["text"] for r in rows]
    text_video = [paths.index(str(Path(dataset).parent / r["video"])) if "corrupt" not in r["video"] else None
                  for r in rows]
    pixels = torch.cat([processor.video_processor(videos=[p], num_frames=8, frame_sampling="uniform")["pixel_values"]
                        for p in paths])
    encoded = processor.tokenizer(texts, padding="max_length", truncation=True, max_length=12, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        out = model.get_video_tokens(pixels)
        kwargs = {"video_token_sizes": out.token_sizes, "k": 3}
        t2v = model.rank_videos(ids, out.last_hidden_state, mask, **kwargs).scores
        v2t = model.rank_texts(ids, out.last_hidden_state, mask, **kwargs).scores
        cosine = model.get_text_features(ids, mask).pooler_output @ model.get_video_features(
            video_tokens=out.last_hidden_state, video_token_sizes=out.token_sizes).pooler_output.T
    t2v_ranks = [rank_of_positive(row, {v} if v is not None else set(), cosine[t])
                 for t, (row, v) in enumerate(zip(t2v, text_video))]
    v2t_ranks = [rank_of_positive(row, {t for t, u in enumerate(text_video) if u == v}, cosine[:, v])
                 for v, row in enumerate(v2t)]
    v2t_ranks.append(None)  # the corrupt video as a query
    for k in (1, 5, 10):
        assert metrics[f"t2v_R@{k}"] == pytest.approx(recall_from_ranks(t2v_ranks)[f"R@{k}"])
        assert metrics[f"v2t_R@{k}"] == pytest.approx(recall_from_ranks(v2t_ranks)[f"R@{k}"])
    assert metrics["t2v_R@10"] == pytest.approx(100 * 7 / 8)  # everything but the corrupt video's text
    kept = VideoTokenStore(tmp_path / "store")  # a store_dir that was given is kept, and reopens
    assert len(kept) == 6 and kept.valid.tolist() == [True, True, False, True, True, True]


def test_two_processes_equal_one_process(dataset, tmp_path):
    out = tmp_path / "two.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--multi_gpu", "--num_processes", "2",
               "-m", "helpers.evaluation", str(out), dataset]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run(command, cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    two = json.loads(out.read_text())
    assert two.pop("num_processes") == 2
    one = json.loads(json.dumps(all_runs(Accelerator(cpu=True), tmp_path / "run1", dataset)))
    assert two == one
    assert one["one_video"]["t2v_ranks"] == [0] and one["one_video"]["v2t_ranks"] == [0]
    assert one["decoded"]["num_failed_videos"] == 1


# ------------------------------------------------------------------------------------ the store behind VideoIndex


@pytest.fixture(scope="module")
def pipe():
    from helpers.pipelines import build_retrieval
    from helpers.pipelines import tiny_processor as pipeline_processor

    from modeling_testa import VideoTextRetrievalPipeline

    return VideoTextRetrievalPipeline(model=build_retrieval(), processor=pipeline_processor(), device="cpu")


@pytest.fixture(scope="module")
def mp4s(tmp_path_factory):
    from helpers.pipelines import write_videos

    return write_videos(tmp_path_factory.mktemp("index_videos"))


QUERIES = ["a red square moves", "a blue bar", "gray noise"]


def test_video_index_backed_by_a_store(pipe, mp4s, tmp_path):
    from testa_search import VideoIndex

    in_memory = pipe.encode_videos(mp4s, batch_size=2)
    stored = pipe.encode_videos(mp4s, batch_size=2, store_dir=tmp_path / "fp32", token_dtype=torch.float32)
    assert stored.store is not None and stored.videos == mp4s
    # a store records what an in-memory index does (the weights' hash included), and its tokens' dtype
    assert {k: v for k, v in stored.info.items() if k != "token_dtype"} == in_memory.info
    assert stored.info["token_dtype"] == "float32" and len(stored.info["model_weights_sha256"]) == 64
    assert torch.equal(stored.embeddings, in_memory.embeddings)
    assert torch.equal(stored.tokens[torch.tensor([4, 0, 2])], in_memory.tokens[[4, 0, 2]])
    assert torch.equal(stored.token_sizes[torch.arange(5)], in_memory.token_sizes)
    expected = pipe.search(QUERIES, in_memory, top_k=None, rerank_k=3, use_faiss=False)
    reopened = VideoIndex.load(tmp_path / "fp32")  # indexed once, searched again without decoding
    assert reopened.videos == mp4s and reopened.has_tokens
    assert pipe.search(QUERIES, reopened, top_k=None, rerank_k=3, use_faiss=False) == expected

    # fp16 storage (the default for a store): the same order, scores within fp16 rounding
    half = pipe.encode_videos(mp4s, batch_size=2, store_dir=tmp_path / "fp16")
    assert half.tokens.dtype == torch.float16
    got = pipe.search(QUERIES, VideoIndex.load(tmp_path / "fp16"), top_k=None, rerank_k=3, use_faiss=False)
    for row, reference in zip(got, expected):
        assert [item["video"] for item in row] == [item["video"] for item in reference]
        for item, ref in zip(row, reference):
            assert item["score"] == pytest.approx(ref["score"], abs=5e-3)

    # an in-memory index converts to the store format; the single-file format still loads
    in_memory.save(tmp_path / "converted", as_store=True)
    converted = VideoIndex.load(tmp_path / "converted")
    assert converted.store is not None and torch.equal(converted.tokens[torch.arange(5)], in_memory.tokens)
    assert pipe.search(QUERIES, converted, top_k=None, rerank_k=3, use_faiss=False) == expected
    legacy = VideoIndex.load(in_memory.save(tmp_path / "legacy"))
    assert legacy.store is None and torch.equal(legacy.tokens, in_memory.tokens)
    with pytest.raises(ValueError, match="store_tokens=False"):
        pipe.encode_videos(mp4s, store_tokens=False, store_dir=tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="neither a video store"):
        VideoIndex.load(tmp_path / "nothing")


def test_evaluation_store_opens_as_an_index(dataset, tmp_path):
    """The store the evaluation writes (with a video that could not be decoded) is a searchable VideoIndex, and the
    failed video is never a candidate."""
    from testa_search import VideoIndex

    processor = tiny_processor()
    model = tiny_model(vocab_size=len(processor.tokenizer))
    evaluate_retrieval(model, processor, recipe_for(dataset), Accelerator(cpu=True), store_dir=tmp_path / "s")
    index = VideoIndex.load(tmp_path / "s")
    assert index.tokens.dtype == torch.float16 and index.valid.tolist() == [True, True, False, True, True, True]
    queries = torch.nn.functional.normalize(torch.randn(4, 16), dim=-1)
    scores, indices = index.nearest(queries, k=10, use_faiss=False)
    kept = torch.tensor([0, 1, 3, 4, 5])
    expected = (queries @ index.embeddings[kept].T).topk(5)
    assert torch.equal(indices, kept[expected.indices]) and torch.allclose(scores, expected.values)


def test_reported_numbers_come_from_the_metric_module(model, tmp_path, monkeypatch):
    """Every recall the evaluation reports is computed by train/metrics/video_text_retrieval: replacing the module
    replaces the numbers (a hand-written computation in train/evaluation.py would ignore the replacement)."""
    import train.evaluation as evaluation

    loaded, inputs = [], []

    class Sentinel:
        def compute(self, **kwargs):
            inputs.append(kwargs)
            result = {f"{d}_R@{k}": 42.0 + k for d in ("t2v", "v2t") for k in (1, 5, 10)}
            return {**result, "t2v_R_mean": 1.0, "v2t_R_mean": 2.0, "R_mean": 3.0, "t2v_ranks": [7], "v2t_ranks": [8]}

    monkeypatch.setattr(evaluation, "load_metric", lambda name, config=None: loaded.append((name, config)) or Sentinel())
    metrics = store_metrics(model, Accelerator(cpu=True), tmp_path, k_test=K, batch_size=ENCODE_BATCH,
                            rerank_batch_size=PAIRS)
    assert loaded == [("video_text_retrieval", "ranked_lists")]
    assert metrics["t2v_R@1"] == 43.0 and metrics["v2t_R@10"] == 52.0 and metrics["mean_recall"] == 3.0
    assert metrics["t2v_ranks"] == [7]
    # what the module was given: one ranking per query, the true positives, misses for rankings that end early
    assert len(inputs[0]["predictions"]) == len(TEXT_VIDEO) and inputs[0]["references"] == [[v] for v in TEXT_VIDEO]
    assert inputs[0]["truncated"] == "miss" and tuple(inputs[0]["ks"]) == (1, 5, 10)


def test_no_hand_written_metric_outside_the_modules():
    """The training evaluation and the benchmarks define no recall/accuracy code of their own and load both modules."""
    import ast

    # (benchmarks may compute other things called accuracy, e.g. video classification in training_free.py)
    for folder, forbidden in (("train", ("recall", "rank_of_positive", "accuracy")),
                              ("benchmarks", ("recall", "rank_of_positive"))):
        for path in (REPO / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef):
                    assert not any(word in node.name for word in forbidden), f"{path.name} defines {node.name}()"
    source = (REPO / "train" / "evaluation.py").read_text(encoding="utf-8")
    assert 'load_metric("video_text_retrieval", "ranked_lists")' in source and 'load_metric("video_qa_accuracy")' in source


def test_an_evaluation_store_dir_reused_from_another_store_is_not_read_as_its_plan(dataset, tmp_path):
    """``store_dir`` pointing at a folder where a store of other videos was grown (its row plan, `index_plan.json`,
    still there): the evaluation writes its own store and ranks exactly as in a fresh folder."""
    processor = tiny_processor()
    model = tiny_model(vocab_size=len(processor.tokenizer))
    fresh = evaluate_retrieval(model, processor, recipe_for(dataset), Accelerator(cpu=True),
                               store_dir=tmp_path / "fresh", token_dtype=torch.float32)
    reused = tmp_path / "reused"
    reused.mkdir()
    stale = {"videos": [f"/elsewhere/clip{i}.mp4" for i in range(9)], "shards": [[0, 9]], "row_fields": {},
             "segments": None}
    (reused / "index_plan.json").write_text(json.dumps(stale))
    again = evaluate_retrieval(model, processor, recipe_for(dataset), Accelerator(cpu=True),
                               store_dir=reused, token_dtype=torch.float32)
    compared = [key for key in fresh if "_R@" in key or key in ("num_videos", "num_failed_videos", "failed_videos",
                                                                 "video_tokens")]
    assert len(compared) > 6 and {key: again[key] for key in compared} == {key: fresh[key] for key in compared}
