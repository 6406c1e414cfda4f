"""Shared by tests/test_evaluation.py and the 2-process run it launches (from tests/: `python -m
accelerate.commands.launch -m helpers.evaluation OUT_JSON DATASET_JSONL`): a tiny retrieval model, synthetic pixel inputs, and the
evaluations whose results must not depend on the number of processes."""

import json
import sys
from pathlib import Path

import torch


from .models import randomize, text_ids, tiny_config, videos

from modeling_testa import TestaForVideoTextRetrieval

NUM_VIDEOS, FRAMES, SIZE = 12, 8, 32
# 18 texts: videos 0..5 have two texts, 6..10 one, video 11 none (it is only a candidate)
TEXT_VIDEO = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 10][:17] + [3]


def tiny_model(vocab_size: int | None = None) -> TestaForVideoTextRetrieval:
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    config = tiny_config()
    if overrides:
        config.text_config.vocab_size = vocab_size
    torch.manual_seed(0)
    return randomize(TestaForVideoTextRetrieval(config)).eval()


def pixel_inputs() -> torch.Tensor:
    return videos(NUM_VIDEOS, FRAMES, SIZE, seed=5)


def text_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = text_ids(len(TEXT_VIDEO), 7, seed=6, pad_to=9)
    return ids, ids.ne(0).long()


class PixelCollate:
    """Bypasses decoding: item ``i`` is row ``i`` of a pixel tensor; items listed in ``broken`` fail."""

    def __init__(self, pixels: torch.Tensor, broken: tuple[int, ...] = ()):
        self.pixels, self.broken = pixels, set(broken)

    def __call__(self, batch):
        good = [i for i, _ in batch if i not in self.broken]
        from testa_search.encoding import Failure

        failures = [Failure(item, "unreadable", "synthetic failure", i) for i, item in batch if i in self.broken]
        return good, (self.pixels[good] if good else None), failures


def store_metrics(model, accelerator, directory, text_video=TEXT_VIDEO, num_videos=NUM_VIDEOS, k_test=5,
                  batch_size=5, rerank_batch_size=4, token_dtype=torch.float32, broken=()) -> dict:
    from train.evaluation import encode_to_store, retrieval_metrics

    pixels = pixel_inputs()[:num_videos]
    ids, mask = text_inputs()
    ids, mask = ids[: len(text_video)], mask[: len(text_video)]
    store, _ = encode_to_store(model, [f"video{i}" for i in range(num_videos)], PixelCollate(pixels, broken),
                               accelerator, directory, batch_size, token_dtype=token_dtype)
    metrics = retrieval_metrics(model, store, ids, mask, list(text_video), accelerator, k_test, rerank_batch_size)
    metrics["failures"] = store.failures
    store.close()
    return metrics


def tiny_processor():
    from modeling_testa import TestaProcessor, TestaVideoProcessor

    video_processor = TestaVideoProcessor(num_frames=FRAMES, size={"shortest_edge": SIZE},
                                          crop_size={"height": SIZE, "width": SIZE})
    return TestaProcessor(video_processor=video_processor)


def recipe_for(dataset: str) -> dict:
    return {"data": {"dataset": dataset, "num_frames": FRAMES, "max_text_length": 12, "num_workers": 0},
            "eval": {"k_test": 3, "batch_size": 4}}


def write_dataset(directory: Path) -> Path:
    """A jsonl split over 5 tiny mp4 files and one corrupt file: 7 paragraphs (videos 0 and 2 have two, the
    corrupt one has one)."""
    from .videos import write_video

    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    words = ["a red square moves left", "a blue bar falls", "the square stops", "two bars cross", "it turns dark"]
    for i in range(5):
        path = directory / f"clip{i}.mp4"
        write_video(path, num_frames=12 + 3 * i, width=160, height=64)
        rows.append({"video": path.name, "text": words[i], "video_id": f"clip{i}"})
    corrupt = directory / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    rows.insert(2, {"video": corrupt.name, "text": "nothing can be seen", "video_id": "corrupt"})
    rows.append({"video": "clip0.mp4", "text": "a square and a bar", "video_id": "clip0"})
    rows.append({"video": "clip2.mp4", "text": "the square rests", "video_id": "clip2"})
    path = directory / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def all_runs(accelerator, out_dir: Path, dataset: str) -> dict:
    """The three evaluations compared between 1 and 2 processes."""
    from train.evaluation import evaluate_retrieval

    model = tiny_model()
    results = {
        "synthetic": store_metrics(model, accelerator, out_dir / "store_a"),
        # one video and one text: the second process gets empty shares everywhere
        "one_video": store_metrics(model, accelerator, out_dir / "store_b", text_video=[0], num_videos=1),
    }
    processor = tiny_processor()
    results["decoded"] = evaluate_retrieval(tiny_model(vocab_size=len(processor.tokenizer)), processor,
                                            recipe_for(dataset), accelerator)
    results["decoded"].pop("encoder_seconds")
    return results


if __name__ == "__main__":
    from accelerate import Accelerator

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    out = Path(sys.argv[1])
    results = all_runs(accelerator, out.parent / f"run{accelerator.num_processes}", sys.argv[2])
    if accelerator.is_main_process:
        out.write_text(json.dumps({"num_processes": accelerator.num_processes, **results}))
