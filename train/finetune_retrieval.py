"""Fine-tunes TESTA for paragraph-to-video retrieval (VTC + VTM) and evaluates R@1/5/10 with two-stage ranking.

    accelerate launch [accelerate flags] train/finetune_retrieval.py --config configuration/retrieval_queryd_f32.yaml \
        [--dataset DIR_OR_HUB_ID] [--output-dir OUT] [--max-steps N] [--resume-from CKPT | --overwrite]

`OUT/final/` is a `save_pretrained` folder (model, processor, remote code). See train/recipe.py for every recipe key and train/loop.py for the loop.
"""

import zlib

import torch

from modeling_testa import TestaForVideoTextRetrieval
from train.evaluation import evaluate_retrieval
from train.loop import Task, main


def video_ids(keys: list[str], device) -> torch.Tensor:
    """Stable integer ids (the same on every process) for the idx-aware contrastive positives."""
    return torch.tensor([zlib.crc32(key.encode()) & 0x7FFFFFFF for key in keys], device=device)


def compute_loss(model, batch: dict, warmup_progress: float) -> torch.Tensor:
    unwrapped = getattr(model, "module", model)
    alpha = unwrapped.config.alpha * warmup_progress  # the original ramps distillation in over the first epoch
    output = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
        video_ids=video_ids(batch["video_key"], batch["input_ids"].device), return_loss=True, alpha=alpha,
    )
    return output.loss


TASK = Task(
    name="retrieval",
    model_class=TestaForVideoTextRetrieval,
    text_lengths={"text": "max_text_length"},
    compute_loss=compute_loss,
    evaluate=evaluate_retrieval,
)

if __name__ == "__main__":
    main(TASK)
