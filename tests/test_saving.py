"""Saved TESTA folders are complete Hub repositories: a fresh interpreter outside the repo, where `modeling_testa`
cannot be imported, loads them with AutoModel / AutoProcessor / pipeline(..., trust_remote_code=True) and gets the
same scores as the installed package, with stdin closed and without ever being asked "Do you wish to run the custom
code?". Also: Auto* registration, the pre-training and bare-encoder folders, and `push_to_hub` (offline, with the
Hub client replaced by a recorder)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.pipelines import build_qa, build_retrieval, save_folder, tiny_processor, tiny_testa_config, write_videos
from helpers.requirements import require
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    pipeline,
)

from modeling_testa import (
    MODEL_CARD_MARKER,
    TestaConfig,
    TestaForPreTraining,
    TestaForVideoQA,
    TestaForVideoTextRetrieval,
    TestaVisionConfig,
    TestaVisionModel,
)


require("av")

REPO = Path(__file__).resolve().parents[1]
QUERIES = ["a red square moves", "a blue bar", "stripes at the top"]
LABELS = ["a red square", "a blue bar", "a cat"]
QUESTION = "what is moving?"
ANSWERS = ["red", "blue square", "a cat", "the bar"]
PROMPT = "Do you wish to run the custom code"
"""What transformers' `resolve_trust_remote_code` asks when `trust_remote_code` is not given for custom code."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    processor = tiny_processor()
    retrieval, qa = build_retrieval(), build_qa()
    vision = TestaVisionModel(retrieval.config.vision_config).eval()
    vision.load_state_dict(retrieval.vision_model.state_dict())
    vision.save_pretrained(root / "vision")
    return SimpleNamespace(
        root=root,
        videos=write_videos(root / "videos"),
        processor=processor,
        retrieval=retrieval,
        qa=qa,
        vision=vision,
        retrieval_folder=save_folder(retrieval, processor, root / "retrieval"),
        qa_folder=save_folder(qa, processor, root / "qa"),
        vision_folder=root / "vision",
    )


def test_auto_registration():
    assert AutoConfig.for_model("testa").__class__ is TestaConfig
    assert isinstance(AutoConfig.for_model("testa_vision_model"), TestaVisionConfig)
    config = tiny_testa_config()
    assert type(AutoModel.from_config(config)) is TestaForVideoTextRetrieval
    assert type(AutoModelForVisualQuestionAnswering.from_config(config)) is TestaForVideoQA
    assert type(AutoModelForPreTraining.from_config(config)) is TestaForPreTraining
    assert type(AutoModel.from_config(config.vision_config)) is TestaVisionModel
    assert TestaConfig._auto_class == "AutoConfig"
    assert TestaForVideoTextRetrieval._auto_class == "AutoModel"
    assert TestaForVideoQA._auto_class == "AutoModelForVisualQuestionAnswering"
    assert TestaForPreTraining._auto_class == "AutoModelForPreTraining"


@torch.no_grad()
def _in_process_results(setup) -> dict:
    """Everything the subprocess computes, computed here with the installed package's classes."""
    videos, processor = setup.videos, setup.processor
    tokens = torch.cat([setup.retrieval.get_video_tokens(processor(videos=v)["pixel_values"]).last_hidden_state
                        for v in videos])
    text = processor(text=QUERIES)
    ranking = setup.retrieval.rank_videos(text["input_ids"], tokens, text["attention_mask"], k=len(videos))
    retrieval_pipe = pipeline("video-text-retrieval", model=setup.retrieval, processor=processor, device="cpu")
    ranked_all = retrieval_pipe(text=QUERIES, videos=videos, rerank_k=len(videos))
    zero_shot = pipeline("zero-shot-video-classification", model=setup.retrieval, processor=processor, device="cpu")
    qa_pipe = pipeline("video-question-answering", model=setup.qa, processor=processor, device="cpu")
    assert type(retrieval_pipe).__module__ == "modeling_testa.pipeline_testa"  # the installed package's class
    vision_out = setup.vision(processor(videos=videos[0])["pixel_values"]).last_hidden_state
    return {
        "direct": ranking.scores.tolist(),
        "similarity": ranking.similarity.tolist(),
        "ranked": [[(str(i["video"]), i["score"]) for i in r] for r in retrieval_pipe(text=QUERIES, videos=videos)],
        "ranked_all": [[(str(i["video"]), i["score"]) for i in r] for r in ranked_all],
        "zero_shot": [(i["label"], i["score"]) for i in zero_shot(videos[0], candidate_labels=LABELS)],
        "qa_generate": [(i["answer"], i["score"]) for i in qa_pipe(video=videos[1], question=QUESTION)],
        "qa_rank": [(i["answer"], i["score"]) for i in qa_pipe(video=videos[1], question=QUESTION,
                                                                candidate_answers=ANSWERS, top_k=3)],
        "vision": vision_out[0, :3, :4].tolist(),
    }


REMOTE_SCRIPT = """
import contextlib, io, json, os, sys
with_library = {with_library!r}
if not with_library:  # none of the library importable here (run outside the repository: not on the path either)
    for package in ("modeling_testa", "testa_search", "testa_runtimes"):
        sys.modules[package] = None
        try:
            __import__(package)
            raise SystemExit(package + " must not be importable here")
        except ImportError:
            pass
import torch
from transformers import AutoModel, AutoModelForVisualQuestionAnswering, AutoProcessor, pipeline

retrieval_dir, qa_dir, vision_dir, out_dir = {retrieval!r}, {qa!r}, {vision!r}, {out!r}
videos, queries, labels = {videos!r}, {queries!r}, {labels!r}
untrusted = io.StringIO()  # without trust_remote_code transformers asks (stdin is closed: the answer is no)
try:
    with contextlib.redirect_stdout(untrusted), contextlib.redirect_stderr(untrusted):
        AutoModel.from_pretrained(retrieval_dir)
    raise SystemExit("loading custom code without trust_remote_code must fail")
except ValueError as error:
    assert "trust_remote_code" in str(error), error
assert {prompt!r} in untrusted.getvalue(), "the check of the prompt would not see it"

def remote(obj):
    module = type(obj).__module__
    # once the Hub code ran the installed library, the library's classes are registered in-process and load instead
    assert module.startswith("transformers_modules.") or (with_library and "modeling_testa" in sys.modules), module
    return type(obj).__name__

with torch.no_grad():
    model = AutoModel.from_pretrained(retrieval_dir, trust_remote_code=True).eval()
    # re-saving a remote-code model before any pipeline code was loaded still writes the pipeline code
    model.save_pretrained(os.path.join(out_dir, "model_only"))
    processor = AutoProcessor.from_pretrained(retrieval_dir, trust_remote_code=True)
    classes = [remote(model), remote(processor), remote(processor.video_processor)]
    tokens = torch.cat([model.get_video_tokens(processor(videos=v)["pixel_values"]).last_hidden_state for v in videos])
    text = processor(text=queries)
    direct = model.rank_videos(text["input_ids"], tokens, text["attention_mask"], k=len(videos)).scores

    retrieval_pipe = pipeline("video-text-retrieval", model=retrieval_dir, trust_remote_code=True, device="cpu")
    zero_shot = pipeline("zero-shot-video-classification", model=retrieval_dir, trust_remote_code=True, device="cpu")
    qa_pipe = pipeline("video-question-answering", model=qa_dir, trust_remote_code=True, device="cpu")
    classes += [remote(p) for p in (retrieval_pipe, zero_shot, qa_pipe)]
    qa_model = AutoModelForVisualQuestionAnswering.from_pretrained(qa_dir, trust_remote_code=True)
    classes += [remote(qa_pipe.model), remote(qa_model)]
    ranked = retrieval_pipe(text=queries, videos=videos)
    searched, missing = None, []
    if with_library:  # the Hub code's methods run the installed search package
        index = retrieval_pipe.encode_videos(videos, batch_size=2)
        index.save(os.path.join(out_dir, "index"))
        searched = retrieval_pipe.search(queries, type(index).load(os.path.join(out_dir, "index")), top_k=None)
    else:  # what the folder does not ship says in one line what to install
        for call in (lambda: retrieval_pipe.encode_videos(videos), lambda: retrieval_pipe.search(queries, None),
                     lambda: pipeline("video-text-retrieval", model=retrieval_dir, trust_remote_code=True,
                                      device="cpu", precision="bf16")):
            try:
                call()
                raise SystemExit("a method of the library ran without it")
            except ImportError as error:
                missing.append(str(error))

    vision = AutoModel.from_pretrained(vision_dir, trust_remote_code=True).eval()
    classes.append(remote(vision))
    vision_out = vision(processor(videos=videos[0])["pixel_values"]).last_hidden_state

    # re-saving remote-code objects writes a complete repo again (code, auto_map, custom_pipelines, card)
    retrieval_pipe.save_pretrained(os.path.join(out_dir, "resaved"))
    leaked = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in ("modeling_testa", "testa_search", "testa_runtimes") and v is not None)
    result = dict(
        classes=classes,
        leaked=leaked,
        direct=direct.tolist(),
        ranked=[[(str(i["video"]), i["score"]) for i in r] for r in ranked],
        searched=searched and [[(str(i["video"]), i["score"]) for i in r] for r in searched],
        missing=missing,
        zero_shot=[(i["label"], i["score"]) for i in zero_shot(videos[0], candidate_labels=labels)],
        qa_generate=[(i["answer"], i["score"]) for i in qa_pipe(video=videos[1], question={question!r})],
        qa_rank=[(i["answer"], i["score"]) for i in qa_pipe(video=videos[1], question={question!r},
                                                             candidate_answers={answers!r}, top_k=3)],
        vision=vision_out[0, :3, :4].tolist(),
    )
print("RESULT " + json.dumps(result))
"""


def _assert_pairs_close(got, expected, rtol=1e-4, atol=1e-5):
    assert [a for a, _ in got] == [a for a, _ in expected]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=rtol, atol=atol)


@pytest.mark.parametrize("with_library", [False, True], ids=["hub-folder-alone", "with-the-library"])
def test_remote_code_loads_without_the_package(setup, tmp_path, with_library):
    """A saved folder, loaded as Hub code in a process started outside the repository: its models, processors and
    pipeline calls give the in-process results. Without the library (nothing of it importable) `encode_videos`,
    `search` and `precision=` say in one line what to install; with it installed, the Hub code's methods run it."""
    expected = _in_process_results(setup)
    script = REMOTE_SCRIPT.format(
        retrieval=str(setup.retrieval_folder), qa=str(setup.qa_folder),
        vision=str(setup.vision_folder), out=str(tmp_path), videos=setup.videos, queries=QUERIES, labels=LABELS,
        question=QUESTION, answers=ANSWERS, prompt=PROMPT, with_library=with_library,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), TOKENIZERS_PARALLELISM="false")
    # stdin closed, as in a job: a prompt would read EOF and fail the load, and must not even be printed
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert PROMPT not in result.stdout and PROMPT not in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    assert not str(tmp_path).startswith(str(REPO))  # the script ran outside the repository
    got = json.loads(result.stdout.split("RESULT ", 1)[1])

    if with_library:
        assert got["missing"] == []
        for remote_list, local_list in zip(got["searched"], expected["ranked"]):
            _assert_pairs_close(remote_list, local_list)
    else:
        assert got["leaked"] == [] and got["searched"] is None
        assert len(got["missing"]) == 3
        for message in got["missing"]:
            assert "pip install testa-hf" in message and "\n" not in message, message
    assert got["classes"] == [
        "TestaForVideoTextRetrieval", "TestaProcessor", "TestaVideoProcessor", "VideoTextRetrievalPipeline",
        "ZeroShotVideoClassificationPipeline", "VideoQuestionAnsweringPipeline", "TestaForVideoQA",
        "TestaForVideoQA", "TestaVisionModel",
    ]
    np.testing.assert_allclose(got["direct"], expected["direct"], atol=1e-5, rtol=0)
    for remote_list, local_list in zip(got["ranked"], expected["ranked"]):
        _assert_pairs_close(remote_list, local_list)
    # the pipeline's scores are the model's own two-stage scores (re-ranking every video)
    for q, ranked in enumerate(expected["ranked_all"]):
        by_video = dict(ranked)
        np.testing.assert_allclose([by_video[v] for v in setup.videos], expected["direct"][q], atol=1e-4)
    # by default (top_k=None) the k_test best by cosine are re-ranked and come first, with those same scores
    k_test = setup.retrieval.config.k_test
    for q, ranked in enumerate(expected["ranked"]):
        assert len(ranked) == len(setup.videos)
        head = [v for v, _ in ranked[:k_test]]
        nearest = np.argsort(expected["similarity"][q])[::-1][:k_test]
        assert sorted(head) == sorted(setup.videos[int(i)] for i in nearest)
        by_video = dict(expected["ranked_all"][q])
        np.testing.assert_allclose([s for _, s in ranked[:k_test]], [by_video[v] for v in head], atol=1e-5)
        tail = [v for v, _ in ranked[k_test:]]
        by_index = {v: i for i, v in enumerate(setup.videos)}
        np.testing.assert_allclose([s for _, s in ranked[k_test:]],
                                   [expected["similarity"][q][by_index[v]] for v in tail], atol=1e-5)
    _assert_pairs_close(got["zero_shot"], expected["zero_shot"])
    _assert_pairs_close(got["qa_generate"], expected["qa_generate"])
    _assert_pairs_close(got["qa_rank"], expected["qa_rank"])
    np.testing.assert_allclose(got["vision"], expected["vision"], atol=1e-5, rtol=0)

    code = {"modeling_testa.py", "pipeline_testa.py", "saving.py", "processing_testa.py",
            "video_processing_testa.py", "configuration_testa.py", "aggregation.py"}
    resaved = tmp_path / "resaved"
    files = {p.name for p in resaved.iterdir()}
    assert code | {"README.md", "processor_config.json", "tokenizer.json", "model.safetensors"} <= files
    assert "hub.py" not in files  # the export code is not part of the remote code
    config = json.loads((resaved / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_testa.TestaForVideoTextRetrieval"
    assert "video-text-retrieval" in config["custom_pipelines"]
    assert "## Video processor" in (resaved / "README.md").read_text()
    model_only = tmp_path / "model_only"
    assert code <= {p.name for p in model_only.iterdir()}
    assert set(json.loads((model_only / "config.json").read_text())["custom_pipelines"]) == {
        "video-text-retrieval", "zero-shot-video-classification", "video-question-answering"}  # QA: refused


def test_pretraining_and_encoder_folders(setup, tmp_path):
    """A pre-training checkpoint serves retrieval (AutoModel -> the retrieval head, as the original evaluates
    zero-shot retrieval); the bare encoder is an AutoModel of its own config."""
    vision_config = json.loads((setup.vision_folder / "config.json").read_text())
    assert vision_config["auto_map"] == {"AutoConfig": "configuration_testa.TestaVisionConfig",
                                         "AutoModel": "modeling_testa_vision.TestaVisionModel"}
    assert "custom_pipelines" not in vision_config and (setup.vision_folder / "README.md").is_file()
    assert "TESTA: TestaVisionModel" in (setup.vision_folder / "README.md").read_text()

    torch.manual_seed(0)
    pretraining = TestaForPreTraining(tiny_testa_config()).eval()
    folder = save_folder(pretraining, setup.processor, tmp_path / "pretrain")
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForPreTraining"] == "modeling_testa.TestaForPreTraining"
    assert config["auto_map"]["AutoModel"] == "modeling_testa.TestaForVideoTextRetrieval"
    assert set(config["custom_pipelines"]) == {"video-text-retrieval", "zero-shot-video-classification"}
    pipe = pipeline("video-text-retrieval", model=str(folder), trust_remote_code=True, device="cpu")
    assert type(pipe.model).__name__ == "TestaForVideoTextRetrieval"
    reference = TestaForVideoTextRetrieval.from_pretrained(folder).eval()
    shared = ("vision_proj.weight", "itm_head.weight", "text_encoder.encoder.layer.1.crossattention.self.key.weight")
    for name in shared:
        torch.testing.assert_close(pipe.model.state_dict()[name], pretraining.state_dict()[name])
    ranked = pipe(text="a red square", videos=setup.videos[:2])
    direct = pipeline("video-text-retrieval", model=reference, processor=setup.processor, device="cpu")(
        text="a red square", videos=setup.videos[:2])
    assert [i["video"] for i in ranked] == [i["video"] for i in direct]
    np.testing.assert_allclose([i["score"] for i in ranked], [i["score"] for i in direct], atol=1e-5)


def test_push_to_hub_uploads_the_generated_card(setup, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError
    from transformers.utils import hub as hub_utils

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return SimpleNamespace(repo_id=f"someone/{repo_id}")

    def record_upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        folder = Path(working_dir)
        uploads.append({"repo_id": repo_id, "files": sorted(p.name for p in folder.iterdir()),
                        "readme": (folder / "README.md").read_text(),
                        "config": json.loads((folder / "config.json").read_text())})
        return "https://hub.example/commit"

    hub_card = {"text": None}

    def load_card(repo_id, **kwargs):
        if hub_card["text"] is None:
            raise EntryNotFoundError("no README.md in the repo")
        return huggingface_hub.ModelCard(hub_card["text"])

    monkeypatch.setattr(hub_utils, "hf_api", lambda: FakeApi())
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", staticmethod(load_card))
    monkeypatch.setattr(TestaForVideoTextRetrieval, "_upload_modified_files", record_upload, raising=False)

    setup.retrieval.push_to_hub("tiny-testa", tags=["my-tag"])
    upload = uploads[-1]
    assert upload["repo_id"] == "someone/tiny-testa"
    assert {"modeling_testa.py", "pipeline_testa.py", "config.json", "model.safetensors", "README.md"} <= set(
        upload["files"])
    assert MODEL_CARD_MARKER in upload["readme"] and "- my-tag" in upload["readme"]
    assert "| spatial_reduction (R_S, patches per frame per block) | [3, 3] |" in upload["readme"]
    assert "custom_pipelines" in upload["config"]

    hub_card["text"] = "---\nlicense: mit\n---\n# A card written by hand\n"
    setup.retrieval.push_to_hub("tiny-testa")
    assert "A card written by hand" in uploads[-1]["readme"] and MODEL_CARD_MARKER not in uploads[-1]["readme"]
