"""Golden outputs of the public API, to show that a refactoring changes nothing: tiny seeded models of every head
(retrieval, QA, pre-training) and the three pipelines on real mp4 files; every output is written to one file, and two
files are compared exactly (`torch.equal`, strings by equality).

    python -m benchmarks.golden_outputs --output before.pt      # at the old commit (PYTHONPATH pointing there)
    python -m benchmarks.golden_outputs --output after.pt       # at the new one
    python -m benchmarks.golden_outputs --compare before.pt after.pt
    python -m benchmarks.golden_outputs --output fused.pt --fused-kernels interpret  # the GPU path's kernels, run
                                                                                     # by Triton's interpreter

What is recorded: forward losses and logits of each head (eval and training mode), `get_text_features` /
`get_video_features`, `rank_videos` / `rank_texts` (options included), `rank_answers`, `generate` of the QA and
pre-training heads (defaults and beam search), the retrieval, zero-shot classification and question answering
pipelines (generated answers with their scores, candidate answers), and the losses of a few training steps (both
momentum modes). Runs on the CPU in about a minute.
"""

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from modeling_testa import TestaForPreTraining, TestaVisionModel, fused_aggregation
from testa_runtimes import optimize_for_inference
from modeling_testa.pipeline_testa import (
    VideoQuestionAnsweringPipeline,
    VideoTextRetrievalPipeline,
    ZeroShotVideoClassificationPipeline,
)
from tests.helpers.models import randomize
from tests.helpers.pipelines import build_qa, build_retrieval, tiny_processor, tiny_testa_config, write_videos


QUESTIONS = ["what is the man doing?", "what colour is the car?"]
CAPTIONS = ["a man surfs a large wave", "a red car drives by the sea"]
ANSWERS = ["surfing", "red", "cooking a meal", "blue"]


def with_kernels(model: torch.nn.Module, fused_kernels: str) -> torch.nn.Module:
    """``model`` with every video encoder in it (a head's and its momentum copy's) run with the ``fused_kernels``
    option (`optimize_for_inference`); ``"auto"`` leaves the model as it is."""
    if fused_kernels != "auto":
        for module in model.modules():
            if isinstance(module, TestaVisionModel):
                optimize_for_inference(module, fused_kernels=fused_kernels)
    return model


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Tensors, strings and numbers of ``value`` (model outputs, lists, dicts) under dotted names."""
    if isinstance(value, torch.Tensor):
        out[prefix] = value.detach().cpu().clone()
    elif isinstance(value, dict) or hasattr(value, "items"):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(f"{prefix}[{i}]", item, out)
    elif value is not None:
        out[prefix] = value


def _pixels(seed: int, batch: int, frames: int = 4) -> torch.Tensor:
    return torch.randn(batch, frames, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _batch(processor, texts: list[str], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, pixel_values)`` of ``texts`` and as many seeded random videos."""
    encoded = processor(text=texts)
    return encoded["input_ids"], encoded["attention_mask"], _pixels(seed, len(texts))


def _train_steps(model: torch.nn.Module, batch: dict, steps: int, deferred: bool, seed: int) -> list[torch.Tensor]:
    """Losses of a few SGD steps, with the momentum updated per forward (default) or per optimiser step."""
    torch.manual_seed(seed)
    model.train()
    model.start_momentum()
    model.defer_momentum_updates(deferred)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        out = model(**batch, return_loss=True)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if deferred:
            model.momentum_step()
        losses.append(torch.stack([out.loss.detach(), out.loss_vtc.detach(), out.loss_vtm.detach()]))
    model.eval()
    return losses


@torch.no_grad()
def retrieval_outputs(out: dict[str, Any], processor, videos: list[str], fused_kernels: str) -> None:
    model = with_kernels(build_retrieval(), fused_kernels)
    ids, mask, pixels = _batch(processor, CAPTIONS, seed=0)
    _flatten("retrieval.itm", model(ids, pixels, mask), out)
    _flatten("retrieval.cosine", model(ids, pixels, mask, use_itm_head=False), out)
    _flatten("retrieval.text_features", model.get_text_features(ids, mask), out)
    _flatten("retrieval.video_features", model.get_video_features(pixels), out)
    tokens = model.get_video_tokens(_pixels(1, 5))
    for name, options in (("default", {}), ("softmax", {"itm_score": "softmax"}),
                          ("no_cosine", {"add_cosine": False, "k": 2, "batch_size": 3})):
        _flatten(f"retrieval.rank_videos.{name}", model.rank_videos(
            ids, tokens.last_hidden_state, mask, video_token_sizes=tokens.token_sizes, **options), out)
        _flatten(f"retrieval.rank_texts.{name}", model.rank_texts(
            ids, tokens.last_hidden_state, mask, video_token_sizes=tokens.token_sizes, **options), out)
    with torch.enable_grad():
        batch = {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask, "video_ids": torch.tensor([0, 1])}
        for deferred in (False, True):
            trained = with_kernels(build_retrieval(), fused_kernels)
            _flatten(f"retrieval.train.deferred={deferred}", _train_steps(trained, batch, 3, deferred, seed=5), out)
            out[f"retrieval.train.deferred={deferred}.video_queue"] = trained.momentum.video_queue.clone()
            out[f"retrieval.train.deferred={deferred}.text_proj"] = trained.text_proj.weight.detach().clone()

    retrieval = VideoTextRetrievalPipeline(model=model, processor=processor, device="cpu")
    _flatten("pipeline.retrieval", retrieval(CAPTIONS, videos=videos, top_k=4), out)
    index = retrieval.encode_videos(videos, store_tokens=True, progress_bar=False)
    _flatten("pipeline.retrieval.search", retrieval.search(CAPTIONS, index, top_k=3), out)
    zero_shot = ZeroShotVideoClassificationPipeline(model=model, processor=processor, device="cpu")
    _flatten("pipeline.zero_shot", zero_shot(videos[:3], candidate_labels=["surfing", "cooking", "driving"]), out)


@torch.no_grad()
def qa_outputs(out: dict[str, Any], processor, videos: list[str], fused_kernels: str) -> None:
    model = with_kernels(build_qa(), fused_kernels)
    ids, mask, pixels = _batch(processor, QUESTIONS, seed=2)
    answers = processor.tokenizer(ANSWERS[:2], padding="longest", return_tensors="pt")
    _flatten("qa.forward", model(ids, pixels, mask, labels=answers["input_ids"],
                                 decoder_attention_mask=answers["attention_mask"]), out)
    candidates = processor.tokenizer(ANSWERS, padding="longest", return_tensors="pt")
    _flatten("qa.rank_answers", model.rank_answers(ids, pixels, candidates["input_ids"], mask,
                                                   candidates["attention_mask"], k=3), out)
    out["qa.generate.default"] = model.generate(ids, pixels, mask)
    out["qa.generate.beams"] = model.generate(ids, pixels, mask, num_beams=3, max_length=10)
    out["qa.generate.new_tokens"] = model.generate(ids, pixels, mask, max_new_tokens=4, num_beams=2,
                                                   num_return_sequences=2)
    vqa = VideoQuestionAnsweringPipeline(model=model, processor=processor, device="cpu")
    _flatten("pipeline.vqa.default", vqa(video=videos[1], question=QUESTIONS), out)
    _flatten("pipeline.vqa.top_k", vqa(video=videos[2], question=QUESTIONS[0], top_k=2), out)
    _flatten("pipeline.vqa.options", vqa(video=videos[0], question=QUESTIONS[1], num_beams=2, max_new_tokens=5), out)
    _flatten("pipeline.vqa.candidates", vqa(video=videos[1], question=QUESTIONS[0], candidate_answers=ANSWERS,
                                            top_k=2), out)


@torch.no_grad()
def pretraining_outputs(out: dict[str, Any], processor, fused_kernels: str) -> None:
    def build() -> TestaForPreTraining:
        torch.manual_seed(3)
        return with_kernels(randomize(TestaForPreTraining(tiny_testa_config()), seed=3).eval(), fused_kernels)

    model = build()
    ids, mask, pixels = _batch(processor, CAPTIONS, seed=4)
    _flatten("pretraining.eval", model(ids, pixels, mask, return_loss=False), out)
    out["pretraining.generate.default"] = model.generate(pixels)
    out["pretraining.generate.beams"] = model.generate(pixels, num_beams=3, max_length=10)
    prompt = processor(text=["a man"])
    out["pretraining.generate.prompt"] = model.generate(pixels[:1], prompt["input_ids"], prompt["attention_mask"],
                                                        max_new_tokens=5)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    out["pretraining.generate.images"] = model.generate(images, max_new_tokens=3)
    with torch.enable_grad():
        batch = {"input_ids": ids, "pixel_values": pixels, "attention_mask": mask}
        trained = build()
        _flatten("pretraining.train", _train_steps(trained, batch, 3, deferred=True, seed=7), out)
        torch.manual_seed(8)
        trained.train()
        _flatten("pretraining.train.cap", trained(ids, pixels, mask).loss_cap, out)


def record(output: Path, fused_kernels: str = "auto") -> None:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    processor = tiny_processor()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        videos = write_videos(Path(directory) / "videos")
        retrieval_outputs(out, processor, videos, fused_kernels)
        qa_outputs(out, processor, videos, fused_kernels)
        pretraining_outputs(out, processor, fused_kernels)
    out = {key.replace(directory, "<videos>") if isinstance(key, str) else key: (
        value.replace(directory, "<videos>") if isinstance(value, str) else value) for key, value in out.items()}
    torch.save(out, output)
    print(f"{len(out)} outputs written to {output}")


def compare(first: Path, second: Path) -> int:
    a, b = torch.load(first), torch.load(second)
    differences = [f"only in {first}: {k}" for k in sorted(a.keys() - b.keys())]
    differences += [f"only in {second}: {k}" for k in sorted(b.keys() - a.keys())]
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) \
            else (type(x) is type(y) and x == y)
        if not same:
            differences.append(f"differs: {key}: {x!r} vs {y!r}"[:300])
    for line in differences:
        print(line)
    print(f"{len(a.keys() & b.keys())} common outputs, {len(differences)} differences")
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--output", type=Path, help="record the golden outputs into this file")
    group.add_argument("--compare", type=Path, nargs=2, metavar=("FIRST", "SECOND"), help="compare two files exactly")
    parser.add_argument("--fused-kernels", choices=fused_aggregation.FUSED_KERNELS, default="auto",
                        help="the video encoders' fused_kernels option: 'interpret' runs the fused merge kernels (the "
                             "GPU path) through Triton's interpreter on the CPU")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.output is not None:
        record(args.output, args.fused_kernels)
        return 0
    return compare(*args.compare)


if __name__ == "__main__":
    raise SystemExit(main())
