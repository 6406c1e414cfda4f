"""Pretrains TESTA with VTC + VTM + CAP on video-text and image-text pairs (images become static videos of
`num_frames` identical frames, as the paper does with CC3M). Streams its data by default.

    accelerate launch [accelerate flags] train/pretrain.py --config configuration/pretrain.yaml \
        [--dataset DIR_OR_HUB_ID] [--output-dir OUT] [--max-steps N] [--resume-from CKPT]
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling_testa import TestaForPreTraining  # noqa: E402
from train.evaluation import evaluate_retrieval  # noqa: E402
from train.finetune_retrieval import video_ids  # noqa: E402
from train.loop import Task, main  # noqa: E402


def compute_loss(model, batch: dict, warmup_progress: float) -> torch.Tensor:
    unwrapped = getattr(model, "module", model)
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
        video_ids=video_ids(batch["video_key"], batch["input_ids"].device),
        alpha=unwrapped.config.alpha * warmup_progress, return_loss=True,
    ).loss


def evaluate(model, processor, recipe, accelerator) -> dict:
    """Zero-shot retrieval on the evaluation split, when the recipe names one."""
    if not recipe["data"].get("eval_split"):
        return {}
    return evaluate_retrieval(model, processor, recipe, accelerator)


TASK = Task(
    name="pretrain",
    model_class=TestaForPreTraining,
    text_lengths={"text": ("max_text_length", 30)},
    compute_loss=compute_loss,
    evaluate=evaluate,
)

if __name__ == "__main__":
    main(TASK)
