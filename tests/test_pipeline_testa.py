"""The three TESTA pipelines on real mp4 files (made with PyAV: moving coloured shapes, different lengths, frame rates
and sizes, one grayscale), loaded with `pipeline(task, model=folder, trust_remote_code=True)` from folders written by
`save_pretrained`. Scores are checked against computations that do not use the pipeline."""

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers.requirements import require
from helpers.pipelines import (
    build_qa,
    build_retrieval,
    reference_ranking,
    save_folder,
    tiny_processor,
    write_bad_files,
    write_videos,
)
from transformers import pipeline
from transformers.dynamic_module_utils import get_relative_imports
from transformers.pipelines import PIPELINE_REGISTRY

from modeling_testa import MODEL_CARD_MARKER, TestaForVideoQA, TestaForVideoTextRetrieval, VideoQuestionAnsweringPipeline, VideoTextRetrievalPipeline, ZeroShotVideoClassificationPipeline, token_schedule
from testa_search import VideoIndex


require("av")

QUERIES = ["a red square moves to the right", "a blue bar goes down", "a dark gradient"]
LABELS = ["a red square", "a blue bar", "a cat", "a car"]
CODE_FILES = {"aggregation.py", "configuration_testa.py", "saving.py", "modeling_testa.py", "pipeline_testa.py",
              "processing_testa.py", "video_processing_testa.py"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipelines")


@pytest.fixture(scope="module")
def videos(workdir):
    return write_videos(workdir / "videos")


@pytest.fixture(scope="module")
def bad_files(workdir, videos):
    return write_bad_files(workdir / "bad", videos[1])


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


@pytest.fixture(scope="module")
def retrieval_model():
    return build_retrieval()


@pytest.fixture(scope="module")
def qa_model():
    return build_qa()


@pytest.fixture(scope="module")
def retrieval_folder(workdir, retrieval_model, processor):
    return save_folder(retrieval_model, processor, workdir / "tiny-testa-retrieval")


@pytest.fixture(scope="module")
def qa_folder(workdir, qa_model, processor):
    return save_folder(qa_model, processor, workdir / "tiny-testa-qa")


@pytest.fixture(scope="module")
def retrieval_pipe(retrieval_folder):
    return pipeline("video-text-retrieval", model=str(retrieval_folder), trust_remote_code=True, device="cpu")


@pytest.fixture(scope="module")
def zero_shot_pipe(retrieval_folder):
    return pipeline("zero-shot-video-classification", model=str(retrieval_folder), trust_remote_code=True,
                    device="cpu")


@pytest.fixture(scope="module")
def qa_pipe(qa_folder):
    return pipeline("video-question-answering", model=str(qa_folder), trust_remote_code=True, device="cpu")


def _assert_same_ranking(got, expected, atol=1e-5):
    assert [str(item["video"]) for item in got] == [str(item["video"]) for item in expected]
    assert [item["reranked"] for item in got] == [item["reranked"] for item in expected]
    np.testing.assert_allclose([i["score"] for i in got], [i["score"] for i in expected], atol=atol, rtol=0)


def _scores_by_video(result):
    return {str(item["video"]): item["score"] for item in result}


# ---------------------------------------------------------------------------------------------- saved Hub folders


def test_saved_folders_are_complete_hub_repos(retrieval_folder, qa_folder, retrieval_model):
    retrieval_tasks = {"video-text-retrieval": "AutoModel", "zero-shot-video-classification": "AutoModel"}
    qa_tasks = {"video-question-answering": "AutoModelForVisualQuestionAnswering"}
    for folder, auto_class, tasks in (
        (retrieval_folder, "AutoModel", {**retrieval_tasks, **qa_tasks}),
        (qa_folder, "AutoModelForVisualQuestionAnswering", {**qa_tasks, **retrieval_tasks}),
    ):
        files = {p.name for p in folder.iterdir()}
        assert CODE_FILES <= files
        assert {"config.json", "model.safetensors", "README.md", "processor_config.json", "tokenizer.json"} <= files
        # every relative import of every code file resolves inside the folder (flat, single-level)
        for code in CODE_FILES:
            for module in get_relative_imports(folder / code):
                assert f"{module}.py" in files, (code, module)
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"]["AutoConfig"] == "configuration_testa.TestaConfig"
        assert config["auto_map"][auto_class].startswith("modeling_testa.TestaFor")
        assert config["architectures"] == [config["auto_map"][auto_class].split(".")[1]]
        # every TESTA task: the folder's own, and the other head's (its pipeline refuses the folder, naming what
        # the folder lacks: test_a_folder_of_the_other_head_is_refused_naming_the_weights_it_lacks)
        assert {task: info["pt"] for task, info in config["custom_pipelines"].items()} == {
            task: [auto] for task, auto in tasks.items()}
        assert config["auto_map"]["AutoModel"] == "modeling_testa.TestaForVideoTextRetrieval"
        assert config["auto_map"]["AutoModelForVisualQuestionAnswering"] == "modeling_testa.TestaForVideoQA"
        for info in config["custom_pipelines"].values():
            module, name = info["impl"].split(".")
            assert module == "pipeline_testa" and f"class {name}(" in (folder / "pipeline_testa.py").read_text()

    # the model card carries the configuration and the aggregation settings
    card = (retrieval_folder / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and MODEL_CARD_MARKER in card
    assert "# TESTA: TestaForVideoTextRetrieval" in card
    assert "| temporal_reduction (R_T, frames per block) | [1, 1] |" in card
    assert "| spatial_reduction (R_S, patches per frame per block) | [3, 3] |" in card
    assert "| aggregation_strategy | `geometry` |" in card and "| num_frames | 4 |" in card
    vision = retrieval_model.config.vision_config
    schedule = token_schedule(vision)
    assert schedule == [(3, 13), (2, 10)]
    for layer, (frames, patches) in enumerate(schedule):
        assert f"| {layer} | {frames} | {patches} | {1 + frames * patches} |" in card
    assert "65 input tokens" in card and "| k_test (candidates re-ranked by the matching head) | 3 |" in card
    assert 'pipeline("video-text-retrieval"' in card
    assert 'pipeline("video-question-answering"' in (qa_folder / "README.md").read_text()


OTHER_HEAD = """
import json, sys
from transformers import pipeline
retrieval, qa = sys.argv[1:3]
out = {}
for name, task, folder in (("qa of retrieval", "video-question-answering", retrieval),
                           ("retrieval of qa", "video-text-retrieval", qa),
                           ("zero-shot of qa", "zero-shot-video-classification", qa),
                           ("qa of qa", "video-question-answering", qa)):
    try:
        pipeline(task, model=folder, trust_remote_code=True, device="cpu")
        out[name] = "built"
    except Exception as error:
        out[name] = f"{type(error).__name__}: {error}"
out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("modeling_testa", "train"))
print("RESULT " + json.dumps(out))
"""


def test_a_folder_of_the_other_head_is_refused_naming_the_weights_it_lacks(retrieval_folder, qa_folder, tmp_path):
    """In a fresh interpreter that never imports the package, each task is found in the folder's own remote code
    (no "Unknown task"); a folder of the other head is refused when the pipeline is built, naming the modules whose
    weights it lacks (transformers would only log them and leave them random: the QA pipeline on a retrieval folder
    answered nonsense with score 1.0)."""
    import subprocess

    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", OTHER_HEAD, str(retrieval_folder), str(qa_folder)], cwd=tmp_path,
                          env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["imported"] == [] and result["qa of qa"] == "built", result
    decoder = sum(1 for key in safe_open_keys(qa_folder) if key.startswith("text_decoder."))
    assert result["qa of retrieval"] == (
        f"ValueError: video-question-answering: {str(retrieval_folder)!r} lacks weights that TestaForVideoQA needs: "
        f"text_decoder ({decoder + 2} tensors); they would be random and the answers nonsense. It holds a "
        "TestaForVideoTextRetrieval; video-question-answering needs a TestaForVideoQA folder (e.g. `make demo`'s "
        "outputs/demo/qa/final, or one trained by train.finetune_qa).")  # + the 2 tied to other weights
    for name, task in (("retrieval of qa", "video-text-retrieval"),
                       ("zero-shot of qa", "zero-shot-video-classification")):
        message = result[name]
        assert message.startswith(f"ValueError: {task}: {str(qa_folder)!r} lacks weights that "
                                  "TestaForVideoTextRetrieval needs: "), message
        for module in ("vision_proj", "text_proj", "itm_head", "temp"):
            assert f"{module} (" in message, (module, message)
        assert "It holds a TestaForVideoQA" in message


def test_the_readme_qa_lines_run_on_the_folder_the_demo_writes(qa_folder, videos):
    """The README's QA lines, run as written with `qa_folder` (the folder `make demo` writes: train/demo.py's
    OUTPUT/qa/final) and the video replaced by the test's own: they print generated answers with their scores."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("### The pipelines", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith(("qa_folder =", "qa =", "qa("))]
    assert [line.split("=")[0].strip() for line in lines] == ["qa_folder", "qa", "qa(video"]
    assert lines[0].startswith('qa_folder = "outputs/demo/qa/final"')
    demo = (Path(__file__).resolve().parents[1] / "train" / "demo.py").read_text()
    assert 'REPO / "outputs" / "demo"' in demo and 'train_qa(data_dir, out / "qa"' in demo  # OUTPUT/qa/final
    script = "\n".join(lines).replace('"outputs/demo/qa/final"', repr(str(qa_folder))).replace(
        '"outputs/demo/data/videos/flash00000.mp4"', repr(str(videos[0])))
    scope = {"pipeline": pipeline}
    exec(compile(script.replace("\nqa(video", "\nresult = qa(video"), "README.md", "exec"), scope)
    assert [sorted(item) for item in scope["result"]] == [["answer", "score"]]
    assert isinstance(scope["result"][0]["answer"], str) and 0 < scope["result"][0]["score"] <= 1


def safe_open_keys(folder: Path) -> list[str]:
    """The tensor names saved in a folder's model.safetensors."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return list(weights.keys())


def test_a_qa_head_started_from_a_retrieval_folder_has_no_uninitialised_weight(retrieval_folder):
    """The answer decoder a retrieval folder lacks is initialised, the output bias (a tie of which the checkpoint
    holds neither side, which transformers skips) included: zeros, as a fresh model's; the missing weights are
    recorded for the pipelines."""
    model = TestaForVideoQA.from_pretrained(str(retrieval_folder))
    assert model.weights_missing_at_load and all(k.startswith("text_decoder.") for k in model.weights_missing_at_load)
    bias = model.text_decoder.cls.predictions.bias
    assert torch.equal(bias, torch.zeros_like(bias))
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_model_card_keeps_hand_written_cards(tmp_path, retrieval_model):
    folder = tmp_path / "card"
    folder.mkdir()
    (folder / "README.md").write_text("# My own card\n")
    retrieval_model.save_pretrained(folder)
    assert (folder / "README.md").read_text() == "# My own card\n"
    (folder / "README.md").write_text(f"old generated card\n{MODEL_CARD_MARKER}\n")
    retrieval_model.save_pretrained(folder)
    assert "| spatial_reduction" in (folder / "README.md").read_text()


# ------------------------------------------------------------------------------------------------- retrieval


def test_retrieval_formats_and_scores_equal_rank_videos(retrieval_pipe, retrieval_model, processor, videos):
    assert type(retrieval_pipe).__name__ == "VideoTextRetrievalPipeline"
    given = [videos[0], Path(videos[1]), *videos[2:]]  # str and Path items come back as given
    everything = {"rerank_k": len(videos)}  # re-rank every video (the default re-ranks config.k_test = 3)
    single = retrieval_pipe(text=QUERIES[0], videos=given, **everything)
    assert isinstance(single, list) and len(single) == len(videos)
    assert all(set(item) == {"video", "score", "reranked"} and isinstance(item["score"], float) for item in single)
    assert all(item["reranked"] is True for item in single)
    assert sorted(map(str, (item["video"] for item in single))) == sorted(videos)
    assert any(item["video"] is given[1] for item in single)
    scores = [item["score"] for item in single]
    assert scores == sorted(scores, reverse=True)

    many = retrieval_pipe(text=QUERIES, videos=videos, **everything)
    assert isinstance(many, list) and len(many) == len(QUERIES) and all(len(r) == len(videos) for r in many)
    reference = reference_ranking(retrieval_model, processor, QUERIES, videos)  # no pipeline involved
    for q, result in enumerate(many):
        got = _scores_by_video(result)
        expected = {v: float(reference[q, i]) for i, v in enumerate(videos)}
        assert got.keys() == expected.keys()
        np.testing.assert_allclose([got[v] for v in videos], [expected[v] for v in videos], atol=1e-4, rtol=0)
        assert [str(item["video"]) for item in result] == sorted(videos, key=lambda v: -expected[v])
    assert _scores_by_video(many[0]) == pytest.approx(_scores_by_video(single), abs=1e-5)
    # the scores differ between videos and queries: the comparison above is not between constants
    assert len({round(float(s), 3) for s in reference.flatten()}) == reference.numel()


def test_retrieval_top_k_uses_the_rerank_window(retrieval_pipe, retrieval_model, processor, videos):
    # k_test = 3: the cosine picks 3 candidates, the ITM head re-scores them, the best 2 are returned
    result = retrieval_pipe(text=QUERIES[1], videos=videos, top_k=2)
    assert len(result) == 2
    tokens = []
    for video in videos:
        tokens.append(retrieval_model.get_video_tokens(processor(videos=video)["pixel_values"]).last_hidden_state)
    text = processor(text=[QUERIES[1]])
    with torch.no_grad():
        ranking = retrieval_model.rank_videos(text["input_ids"], torch.cat(tokens), text["attention_mask"], k=3)
    top = ranking.scores[0].topk(2)
    assert [str(item["video"]) for item in result] == [videos[int(i)] for i in top.indices]
    np.testing.assert_allclose([item["score"] for item in result], top.values.tolist(), atol=1e-4, rtol=0)
    wider = retrieval_pipe(text=QUERIES[1], videos=videos, top_k=2, rerank_k=5)  # re-rank everything
    full = retrieval_pipe(text=QUERIES[1], videos=videos, rerank_k=len(videos))
    _assert_same_ranking(wider, full[:2])


def test_each_video_is_decoded_and_encoded_once_per_call(retrieval_pipe, videos):
    batches, decoded = [], []
    hook = retrieval_pipe.model.vision_model.register_forward_hook(
        lambda module, args, output: batches.append(int(args[0].shape[0]))
    )
    video_processor = retrieval_pipe.video_processor
    original_fetch = video_processor.fetch_videos

    def counting_fetch(source, *args, **kwargs):
        decoded.append(str(source))
        return original_fetch(source, *args, **kwargs)

    video_processor.fetch_videos = counting_fetch
    try:
        result = retrieval_pipe(text=QUERIES, videos=videos, batch_size=2)
    finally:
        hook.remove()
        del video_processor.fetch_videos
    assert len(result) == len(QUERIES)
    assert batches == [2, 2, 1]  # 5 videos in batches of 2, encoded once for the 3 queries
    assert sorted(decoded) == sorted(videos)


def test_video_index_save_load_and_search(retrieval_pipe, videos, tmp_path, capsys):
    index = retrieval_pipe.encode_videos(videos, batch_size=2, progress_bar=True)
    assert "Encoding videos" in capsys.readouterr().err  # tqdm progress bar
    assert len(index) == len(videos) and index.has_tokens
    assert index.embeddings.shape == (len(videos), 16)
    assert torch.allclose(index.embeddings.norm(dim=1), torch.ones(len(videos)), atol=1e-5)
    assert index.tokens.shape == (len(videos), 21, 32) and index.token_sizes.shape == (len(videos), 21)
    # token sizes: every output token stands for >= 1 input patches, 65 in all (CLS + 4 frames x 16 patches)
    assert torch.allclose(index.token_sizes.sum(dim=1), torch.full((len(videos),), 65.0))

    saved = index.save(tmp_path / "index")
    assert sorted(p.name for p in saved.iterdir()) == ["video_index.json", "video_index.safetensors"]
    loaded = VideoIndex.load(saved)
    assert loaded.videos == videos and loaded.info == index.info
    for name in ("embeddings", "tokens", "token_sizes"):
        assert torch.equal(getattr(loaded, name), getattr(index, name)), name

    direct = retrieval_pipe(text=QUERIES, videos=videos)
    searched = retrieval_pipe.search(QUERIES, loaded, top_k=None)
    for got, expected in zip(searched, direct):
        _assert_same_ranking(got, expected)
    top2 = retrieval_pipe.search(QUERIES[0], loaded, top_k=2)
    _assert_same_ranking(top2, retrieval_pipe(text=QUERIES[0], videos=videos, top_k=2))

    # embeddings only: first-stage cosine ranking
    light = retrieval_pipe.encode_videos(videos, store_tokens=False)
    assert light.tokens is None and torch.allclose(light.embeddings, index.embeddings, atol=1e-6)
    cosine = retrieval_pipe.search(QUERIES[0], light, top_k=None)
    text = retrieval_pipe.processor(text=[QUERIES[0]])
    with torch.no_grad():
        text_features = retrieval_pipe.model.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
    expected = (text_features @ index.embeddings.T)[0]
    assert [item["video"] for item in cosine] == [videos[int(i)] for i in expected.argsort(descending=True)]
    np.testing.assert_allclose([i["score"] for i in cosine], expected.sort(descending=True).values, atol=1e-5)
    with pytest.raises(ValueError, match="store_tokens"):
        retrieval_pipe.search(QUERIES[0], light, rerank=True)


def test_first_stage_search_backends(retrieval_pipe, videos, monkeypatch):
    index = retrieval_pipe.encode_videos(videos, store_tokens=False)
    query = F.normalize(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    scores, indices = index.nearest(query, k=4, use_faiss=False)
    expected = (query @ index.embeddings.T).topk(4)
    assert torch.equal(indices, expected.indices) and torch.allclose(scores, expected.values)
    # without faiss: use_faiss=True names the missing package, the default falls back to torch
    module = sys.modules[type(index).__module__]
    monkeypatch.setattr(module, "faiss_module", lambda: None)
    with pytest.raises(ImportError, match="faiss-cpu"):
        index.nearest(query, k=4, use_faiss=True)
    fallback_scores, fallback_indices = index.nearest(query, k=4)
    assert torch.equal(fallback_indices, expected.indices) and torch.allclose(fallback_scores, expected.values)
    with pytest.raises(ImportError, match="faiss-cpu"):
        retrieval_pipe.search(QUERIES[0], index, use_faiss=True)
    with pytest.raises(ValueError, match="use_faiss"):
        retrieval_pipe.search(QUERIES[0], index, use_faiss="yes")


def _random_index(module, num_videos: int, dim: int = 16, seed: int = 0):
    """A VideoIndex of random unit embeddings (no tokens), large enough for FAISS and torch to be compared."""
    embeddings = F.normalize(torch.randn(num_videos, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return module.VideoIndex(videos=[f"v{i}.mp4" for i in range(num_videos)], embeddings=embeddings)


def test_faiss_search_equals_the_exact_torch_search(retrieval_pipe, videos):
    """The FAISS branch (installed by the `faiss` extra, which `make test` uses) against the exact torch search."""
    faiss = require("faiss")
    import testa_search

    assert sys.modules[testa_search.VideoIndex.__module__].faiss_module() is faiss
    index = _random_index(testa_search, 300)
    queries = F.normalize(torch.randn(7, 16, generator=torch.Generator().manual_seed(1)), dim=-1)
    exact = (queries @ index.embeddings.T).topk(25)  # the reference: plain matrix product
    for use_faiss in (True, False, None):
        scores, indices = index.nearest(queries, k=25, use_faiss=use_faiss)
        assert torch.equal(indices, exact.indices), use_faiss
        torch.testing.assert_close(scores, exact.values, atol=1e-5, rtol=0)

    # through the pipeline: the same videos in the same order with the same scores, with and without FAISS, with
    # cosine-only search (this index has no tokens) and with re-ranking (a real index with tokens)
    for top_k in (10, None):
        with_faiss = retrieval_pipe.search(QUERIES, index, top_k=top_k, use_faiss=True)
        without = retrieval_pipe.search(QUERIES, index, top_k=top_k, use_faiss=False)
        for got, expected in zip(with_faiss, without):
            assert len(got) == (top_k or len(index))
            _assert_same_ranking(got, expected)
    real = retrieval_pipe.encode_videos(videos)
    for top_k in (2, None):
        _assert_same_ranking(retrieval_pipe.search(QUERIES[1], real, top_k=top_k, use_faiss=True),
                             retrieval_pipe.search(QUERIES[1], real, top_k=top_k, use_faiss=False))


# ------------------------------------------------------------------------------------ collection-scale ranking


def test_top_k_none_reranks_only_k_test_candidates(retrieval_pipe, retrieval_model, processor, videos):
    """Default `top_k=None`: all videos come back, the `k_test` (3) nearest by cosine re-ranked by the matching
    head and first, the other 2 after them by cosine. Checked against the model's plain forward (ITM logits of
    each pair) and its embeddings, without `rank_videos`; and the matching head sees only 3 pairs per query."""
    k_test = retrieval_model.config.k_test
    assert k_test == 3 and len(videos) == 5
    pairs = []
    hook = retrieval_pipe.model.itm_head.register_forward_hook(lambda m, a, out: pairs.append(out.shape[0]))
    try:
        result = retrieval_pipe(text=QUERIES, videos=videos)
    finally:
        hook.remove()
    assert sum(pairs) == k_test * len(QUERIES)  # not len(videos) * len(QUERIES)

    pixel_values = torch.cat([processor(videos=v)["pixel_values"] for v in videos])
    text = processor(text=QUERIES)
    with torch.no_grad():
        video_features = retrieval_model.get_video_features(pixel_values).pooler_output
        text_features = retrieval_model.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
        cosine = text_features @ video_features.T
        for q, ranked in enumerate(result):
            assert [item["reranked"] for item in ranked] == [True] * k_test + [False] * (len(videos) - k_test)
            by_cosine = cosine[q].argsort(descending=True).tolist()
            head, tail = by_cosine[:k_test], by_cosine[k_test:]
            ids = text["input_ids"][q : q + 1].expand(k_test, -1)
            mask = text["attention_mask"][q : q + 1].expand(k_test, -1)
            itm = retrieval_model(ids, pixel_values[head], attention_mask=mask).itm_score[:, 1]
            expected_head = {videos[v]: float(itm[j] + cosine[q, v]) for j, v in enumerate(head)}
            got_head = {item["video"]: item["score"] for item in ranked[:k_test]}
            assert got_head.keys() == expected_head.keys()
            np.testing.assert_allclose([got_head[v] for v in expected_head], list(expected_head.values()), atol=1e-4)
            assert [i["score"] for i in ranked[:k_test]] == sorted((i["score"] for i in ranked[:k_test]), reverse=True)
            assert [item["video"] for item in ranked[k_test:]] == [videos[v] for v in tail]
            np.testing.assert_allclose([i["score"] for i in ranked[k_test:]], cosine[q, tail].tolist(), atol=1e-5)

    # the same semantics when searching an index, and rerank_k widens the re-ranked head
    index = retrieval_pipe.encode_videos(videos)
    for got, expected in zip(retrieval_pipe.search(QUERIES, index, top_k=None), result):
        _assert_same_ranking(got, expected)
    four = retrieval_pipe(text=QUERIES[0], videos=videos, rerank_k=4)
    assert [item["reranked"] for item in four] == [True] * 4 + [False]
    _assert_same_ranking(retrieval_pipe.search(QUERIES[0], index, top_k=None, rerank_k=4), four)
    with pytest.raises(ValueError, match="rerank_k"):
        retrieval_pipe(text=QUERIES[0], videos=videos, rerank_k=0)
    with pytest.raises(ValueError, match="rerank_k"):
        retrieval_pipe.search(QUERIES[0], index, rerank_k=2.5)


def test_rank_videos_with_an_empty_share_of_queries(retrieval_model):
    """A process with no query (fewer queries than processes) gets empty outputs of the right widths."""
    ids, mask, tokens = _ranking_inputs()
    for method, queries, candidates in (("rank_videos", (ids[:0], tokens, mask[:0]), len(tokens)),
                                        ("rank_texts", (ids, tokens[:0], mask), len(ids))):
        out = getattr(retrieval_model, method)(*queries, k=3)
        assert out.scores.shape == (0, candidates) and out.similarity.shape == (0, candidates)
        k = min(3, candidates)  # k is capped at the number of candidates, as for a non-empty share
        assert out.topk_indices.shape == (0, k) and out.topk_indices.dtype == torch.long
    with pytest.raises(ValueError, match="video_tokens` holds no video"):
        retrieval_model.rank_videos(ids, tokens[:0], mask)
    with pytest.raises(ValueError, match=r"`video_features` must have one row per video \(5\)"):
        retrieval_model.rank_videos(ids, tokens, mask, video_features=torch.zeros(4, 16))


def _ranking_inputs():
    """One query and five cached video token sets of the tiny retrieval model (hidden size 32)."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1000, 2000, (1, 6), generator=generator)
    ids[:, 0] = 101
    return ids, torch.ones_like(ids), torch.randn(5, 9, 32, generator=generator)


def _empty_share_worker(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo processes: ranks its share (accelerate's `split_between_processes`, as the training evaluation
    does) of 1 query (`rank_videos`) and of 1 video (`rank_texts`), and gathers the shares like the evaluation."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from accelerate import PartialState
    from accelerate.utils import gather_object

    state = PartialState(cpu=True)
    try:
        assert state.num_processes == 2 and state.process_index == rank
        model = build_retrieval()
        ids, mask, tokens = _ranking_inputs()
        with state.split_between_processes([0]) as text_rows:
            t2v = model.rank_videos(ids[text_rows], tokens, mask[text_rows], k=3)
        with state.split_between_processes([2]) as video_rows:
            v2t = model.rank_texts(ids, tokens[video_rows], mask, k=3)
        shares = gather_object([(len(text_rows), tuple(t2v.scores.shape), len(video_rows), tuple(v2t.scores.shape))])
        t2v_all = torch.cat(gather_object([t2v.scores]))
        v2t_all = torch.cat(gather_object([v2t.scores]))
        if rank == 0:
            torch.save({"shares": shares, "t2v": t2v_all, "v2t": v2t_all}, os.path.join(out_dir, "ranked.pt"))
        state.wait_for_everyone()
    finally:
        state.destroy_process_group()


def test_two_processes_rank_one_query(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_empty_share_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "ranked.pt")
    # process 1 had nothing to rank, in both directions
    assert got["shares"] == [(1, (1, 5), 1, (1, 1)), (0, (0, 5), 0, (0, 1))]
    model = build_retrieval()
    ids, mask, tokens = _ranking_inputs()
    with torch.no_grad():
        t2v = model.rank_videos(ids, tokens, mask, k=3).scores
        v2t = model.rank_texts(ids, tokens[2:3], mask, k=3).scores
    torch.testing.assert_close(got["t2v"], t2v, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["v2t"], v2t, atol=1e-5, rtol=0)
    assert torch.isfinite(t2v).sum() == 3  # k = 3 of the 5 videos were re-ranked


# ------------------------------------------------------------------------------------------------- zero-shot


def test_zero_shot_classification(zero_shot_pipe, retrieval_model, processor, videos):
    assert type(zero_shot_pipe).__name__ == "ZeroShotVideoClassificationPipeline"
    result = zero_shot_pipe(videos[2], candidate_labels=LABELS, hypothesis_template="a video of {}.")
    assert [set(item) for item in result] == [{"label", "score"}] * len(LABELS)
    assert sorted(item["label"] for item in result) == sorted(LABELS)
    scores = [item["score"] for item in result]
    assert scores == sorted(scores, reverse=True) and sum(scores) == pytest.approx(1.0, abs=1e-5)

    # reference: softmax over labels of cosine / temperature, computed directly with the model
    with torch.no_grad():
        video_features = retrieval_model.get_video_features(processor(videos=videos[2])["pixel_values"]).pooler_output
        text = processor(text=[f"a video of {label}." for label in LABELS])
        text_features = retrieval_model.get_text_features(text["input_ids"], text["attention_mask"]).pooler_output
        probs = ((video_features @ text_features.T) / retrieval_model.temp).softmax(dim=-1)[0]
    expected = {label: float(p) for label, p in zip(LABELS, probs)}
    assert {item["label"]: item["score"] for item in result} == pytest.approx(expected, abs=1e-5)
    assert max(expected.values()) - min(expected.values()) > 1e-3  # not a uniform distribution

    batched = zero_shot_pipe(videos, candidate_labels=LABELS, batch_size=2)
    assert len(batched) == len(videos)
    assert [i["label"] for i in batched[2]] == [i["label"] for i in result]
    assert [i["score"] for i in batched[2]] == pytest.approx(scores, abs=1e-5)
    top = zero_shot_pipe(videos[0], candidate_labels=LABELS, top_k=2)
    assert len(top) == 2 and [i["label"] for i in top] == [i["label"] for i in batched[0][:2]]
    # other templates give other texts, hence other scores
    other = zero_shot_pipe(videos[2], candidate_labels=LABELS, hypothesis_template="{}")
    assert {i["label"]: i["score"] for i in other} != pytest.approx(expected, abs=1e-4)


def test_zero_shot_accepts_arrays_and_frame_lists(zero_shot_pipe, videos):
    import av

    with av.open(videos[3]) as container:  # the grayscale video, decoded to RGB frames by PyAV
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    from_frames = zero_shot_pipe(frames, candidate_labels=LABELS)
    from_array = zero_shot_pipe(np.stack(frames), candidate_labels=LABELS)
    assert [i["label"] for i in from_frames] == [i["label"] for i in from_array]
    assert [i["score"] for i in from_frames] == pytest.approx([i["score"] for i in from_array], abs=1e-6)
    assert sum(i["score"] for i in from_frames) == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------------------------------ question answering


def test_vqa_ranks_candidate_answers_like_rank_answers(qa_pipe, qa_model, processor, videos):
    assert type(qa_pipe).__name__ == "VideoQuestionAnsweringPipeline"
    candidates = ["red", "blue square", "a dog", "the car", "moving"]
    result = qa_pipe(video=videos[1], question="what moves?", candidate_answers=candidates, top_k=3)
    assert len(result) == 3 and all(set(i) == {"answer", "score"} for i in result)
    assert [i["score"] for i in result] == sorted((i["score"] for i in result), reverse=True)

    # reference: the model's own ranking (shortlist of k = max(k_test, top_k) = 3 candidates by first-token
    # probability, then the exact log-likelihood); with top_k = 5 every candidate is scored
    question = processor(text=["what moves?"])
    answers = processor.tokenizer(candidates, padding="longest", return_tensors="pt")
    pixel_values = processor(videos=videos[1])["pixel_values"]
    for top_k in (3, len(candidates)):
        result = qa_pipe(video=videos[1], question="what moves?", candidate_answers=candidates, top_k=top_k)
        with torch.no_grad():
            ranking = qa_model.rank_answers(
                question["input_ids"], pixel_values, answers["input_ids"], attention_mask=question["attention_mask"],
                answer_attention_mask=answers["attention_mask"], k=max(3, top_k), label_smoothing=0.0,
            )
        log_likelihoods = ranking.topk_log_likelihoods[0]
        order = log_likelihoods.argsort(descending=True)[:top_k]
        assert [i["answer"] for i in result] == [candidates[int(ranking.topk_indices[0, j])] for j in order]
        np.testing.assert_allclose([i["score"] for i in result], log_likelihoods[order].exp().tolist(), rtol=1e-4)
    assert sorted(i["answer"] for i in result) == sorted(candidates)
    result = result[:1]

    both = qa_pipe(video=videos[1], question=["what moves?", "which colour is the bar?"], candidate_answers=candidates)
    assert len(both) == 2 and all(len(r) == 1 for r in both) and both[0][0]["answer"] == result[0]["answer"]


def test_vqa_generates_answers_scored_by_sequence_probability(qa_pipe, qa_model, processor, videos):
    result = qa_pipe(video=videos[0], question="what is on the screen?")
    assert len(result) == 1 and isinstance(result[0]["answer"], str) and result[0]["answer"]
    assert 0.0 < result[0]["score"] <= 1.0

    # reference: the model's generate() (3 beams, max_length=10) and the forward pass's decoder logits
    question = processor(text=["what is on the screen?"])
    pixel_values = processor(videos=videos[0])["pixel_values"]
    with torch.no_grad():
        generated = qa_model.generate(question["input_ids"], pixel_values, question["attention_mask"], num_beams=3,
                                      max_length=10)
        assert result[0]["answer"] == processor.tokenizer.decode(generated[0], skip_special_tokens=True).strip()
        sep = (generated[0] == 102).nonzero()
        length = int(sep[0]) + 1 if len(sep) else generated.shape[1]
        sequence = generated[:, :length]
        logits = qa_model(question["input_ids"], pixel_values, question["attention_mask"],
                          decoder_input_ids=sequence).logits
        log_prob = logits[0, :-1].log_softmax(-1).gather(1, sequence[0, 1:, None]).sum()
    assert result[0]["score"] == pytest.approx(float(log_prob.exp()), rel=1e-4)

    two = qa_pipe(video=videos[0], question="what is on the screen?", top_k=2)
    assert len(two) == 2 and two[0]["score"] >= two[1]["score"] and two[0]["answer"] != two[1]["answer"]
    short = qa_pipe(video=videos[0], question="what is on the screen?", max_new_tokens=2)
    assert len(processor.tokenizer.tokenize(short[0]["answer"])) <= 2


# ----------------------------------------------------------------------------------------------------- bad input


def _call(task_pipe, task, video):
    if task == "retrieval":
        return task_pipe["retrieval"](text="a query", videos=[video])
    if task == "zero-shot":
        return task_pipe["zero-shot"](video, candidate_labels=LABELS)
    return task_pipe["qa"](video=video, question="what?")


@pytest.fixture(scope="module")
def pipes(retrieval_pipe, zero_shot_pipe, qa_pipe):
    return {"retrieval": retrieval_pipe, "zero-shot": zero_shot_pipe, "qa": qa_pipe}


@pytest.mark.parametrize("task", ["retrieval", "zero-shot", "qa"])
def test_bad_files_raise_clear_errors(pipes, task, bad_files, workdir):
    missing = str(workdir / "does-not-exist.mp4")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        _call(pipes, task, missing)
    reasons = {"empty": "empty", "truncated": "", "text": "", "no_frames": ""}
    for kind, path in bad_files.items():
        start = time.monotonic()
        with pytest.raises(ValueError) as error:
            _call(pipes, task, path)
        assert time.monotonic() - start < 60, f"{kind} took too long"
        assert type(error.value).__name__ == "VideoDecodingError", (kind, type(error.value))
        message = str(error.value)
        assert path in message and reasons[kind] in message, (kind, message)
        assert len(message) > len(f"Could not decode video {path!r}: ") + 5, message  # the decoder gives a reason


def test_bad_collections_and_arrays(pipes, videos):
    retrieval, zero_shot, qa = pipes["retrieval"], pipes["zero-shot"], pipes["qa"]
    with pytest.raises(ValueError, match="`videos` is an empty list"):
        retrieval(text="a", videos=[])
    with pytest.raises(ValueError, match="`videos` is missing"):
        retrieval(text="a")
    with pytest.raises(ValueError, match="`text` is an empty list"):
        retrieval(text=[], videos=videos[:1])
    with pytest.raises(ValueError, match="`candidate_labels` is an empty list"):
        zero_shot(videos[0], candidate_labels=[])
    with pytest.raises(ValueError, match="`candidate_labels` is missing"):
        zero_shot(videos[0])
    with pytest.raises(ValueError, match="hypothesis_template"):
        zero_shot(videos[0], candidate_labels=LABELS, hypothesis_template="no placeholder")
    with pytest.raises(ValueError, match="`videos` is an empty list"):
        zero_shot([], candidate_labels=LABELS)
    with pytest.raises(ValueError, match="`candidate_answers` is an empty list"):
        qa(video=videos[0], question="what?", candidate_answers=[])
    with pytest.raises(ValueError, match="`question` is missing"):
        qa(video=videos[0])
    with pytest.raises(ValueError, match="`video` is missing"):
        qa(question="what?")
    with pytest.raises(ValueError, match="top_k"):
        retrieval(text="a", videos=videos[:2], top_k=0)

    good = np.zeros((4, 32, 32, 3), dtype=np.uint8)
    # wrong rank inside a collection: named by its position
    with pytest.raises(ValueError, match=r"videos\[1\] is an array with 3 dimensions \(shape \(32, 32, 3\)\)"):
        retrieval(text="a", videos=[good, good[0]])
    with pytest.raises(ValueError, match=r"video is an array with 2 dimensions"):
        qa(video=np.zeros((32, 32)), question="what?")
    with pytest.raises(ValueError, match=r"videos\[0\] is an array with 6 dimensions"):
        retrieval(text="a", videos=[np.zeros((1, 1, 4, 32, 32, 3))])
    # wrong channel count
    with pytest.raises(ValueError, match=r"videos\[1\] has shape \(4, 32, 32, 2\): no channel dimension"):
        retrieval(text="a", videos=[good, np.zeros((4, 32, 32, 2), dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"video has shape \(4, 5, 32, 32\): no channel dimension"):
        zero_shot(np.zeros((4, 5, 32, 32), dtype=np.uint8), candidate_labels=LABELS)
    with pytest.raises(ValueError, match=r"video has 0 frames"):
        qa(video=np.zeros((0, 32, 32, 3), dtype=np.uint8), question="what?")
    with pytest.raises(TypeError, match=r"videos\[0\] is a dict"):
        retrieval(text="a", videos=[{"path": videos[0]}])


# -------------------------------------------------------------------------------------- registry and saving


def test_registry_and_pipelines_from_model_objects(retrieval_model, processor, videos):
    tasks = PIPELINE_REGISTRY.supported_tasks
    assert tasks["video-text-retrieval"]["impl"] is VideoTextRetrievalPipeline
    assert tasks["zero-shot-video-classification"]["impl"] is ZeroShotVideoClassificationPipeline
    assert tasks["video-question-answering"]["impl"] is VideoQuestionAnsweringPipeline
    pipe = pipeline("video-text-retrieval", model=retrieval_model, processor=processor, device="cpu")
    assert isinstance(pipe, VideoTextRetrievalPipeline) and pipe.device.type == "cpu"
    ranked = pipe(text=QUERIES[0], videos=videos[:3])
    built = pipeline("video-text-retrieval", model=retrieval_model, tokenizer=processor.tokenizer,
                     video_processor=processor.video_processor, device="cpu")
    _assert_same_ranking(built(text=QUERIES[0], videos=videos[:3]), ranked)
    bare = TestaForVideoTextRetrieval(retrieval_model.config)  # no folder to load a processor from
    with pytest.raises(ValueError, match="needs a TestaProcessor"):
        pipeline("video-text-retrieval", model=bare, device="cpu")
    with pytest.raises(TypeError, match="`processor` must be a TestaProcessor .* got dict"):
        VideoTextRetrievalPipeline(model=retrieval_model, processor={"tokenizer": None})


def test_hub_export_knows_the_pipeline_classes_and_saves_one_folder(retrieval_model, processor, retrieval_pipe,
                                                                     tmp_path, videos):
    from modeling_testa import PIPELINE_TASKS, custom_pipelines_for, save_for_hub

    assert PIPELINE_TASKS["TestaForVideoTextRetrieval"]["video-text-retrieval"]["impl"] is VideoTextRetrievalPipeline
    assert PIPELINE_TASKS["TestaForPreTraining"]["zero-shot-video-classification"]["impl"] is (
        ZeroShotVideoClassificationPipeline)
    assert PIPELINE_TASKS["TestaForVideoQA"]["video-question-answering"]["impl"] is VideoQuestionAnsweringPipeline
    assert custom_pipelines_for("TestaForVideoQA") == {"video-question-answering": {
        "impl": "pipeline_testa.VideoQuestionAnsweringPipeline", "pt": ["AutoModelForVisualQuestionAnswering"],
        "type": "multimodal"},
        # the other head's tasks, whose pipelines refuse the folder naming the weights it lacks
        "video-text-retrieval": {"impl": "pipeline_testa.VideoTextRetrievalPipeline", "pt": ["AutoModel"],
                                 "type": "multimodal"},
        "zero-shot-video-classification": {"impl": "pipeline_testa.ZeroShotVideoClassificationPipeline",
                                           "pt": ["AutoModel"], "type": "multimodal"}}
    assert custom_pipelines_for("TestaVisionModel") == {}

    # a model and its processor in one call: the card lists the processor's video settings (a plain
    # model.save_pretrained, before the processor is saved, cannot)
    folder = save_for_hub(retrieval_model, tmp_path / "one-call", processor=processor, repo_id="me/tiny-testa")
    card = (folder / "README.md").read_text()
    assert "## Video processor" in card and "| crop_size | `32x32` |" in card and 'model="me/tiny-testa"' in card
    assert CODE_FILES <= {p.name for p in folder.iterdir()}
    reloaded = pipeline("video-text-retrieval", model=str(folder), trust_remote_code=True, device="cpu")
    expected = retrieval_pipe(text=QUERIES[0], videos=videos[:3])
    _assert_same_ranking(reloaded(text=QUERIES[0], videos=videos[:3]), expected)
    # a pipeline loaded as remote code is accepted too; it saves its own processor
    assert "## Video processor" in (save_for_hub(retrieval_pipe, tmp_path / "from-pipe") / "README.md").read_text()
    with pytest.raises(ValueError, match="saves its own processor"):
        save_for_hub(retrieval_pipe, tmp_path / "x", processor=processor)
    with pytest.raises(TypeError, match="TESTA model or a TESTA pipeline, got dict"):
        save_for_hub({}, tmp_path / "y")


def test_pipeline_save_pretrained_writes_a_loadable_repo(retrieval_pipe, tmp_path, videos):
    folder = tmp_path / "saved-pipeline"
    retrieval_pipe.save_pretrained(folder)
    files = {p.name for p in folder.iterdir()}
    assert CODE_FILES <= files and {"processor_config.json", "tokenizer.json", "README.md"} <= files
    config = json.loads((folder / "config.json").read_text())
    assert "video-text-retrieval" in config["custom_pipelines"]
    assert "## Video processor" in (folder / "README.md").read_text()
    reloaded = pipeline("video-text-retrieval", model=str(folder), trust_remote_code=True, device="cpu")
    expected = retrieval_pipe(text=QUERIES[0], videos=videos[:3])
    _assert_same_ranking(reloaded(text=QUERIES[0], videos=videos[:3]), expected)
