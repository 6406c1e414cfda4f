"""Pretrains TESTA with VTC + VTM + CAP on video-text and image-text pairs (images become static videos of
`num_frames` identical frames, as the paper does with CC3M). Streams its data by default.

    accelerate launch [accelerate flags] train/pretrain.py --config configuration/pretrain.yaml \
        [--dataset DIR_OR_HUB_ID] [--output-dir OUT] [--max-steps N] [--resume-from CKPT]
"""



from modeling_testa import TestaForPreTraining
from train.evaluation import evaluate_retrieval
from train.finetune_retrieval import compute_loss  # the same call: VTC + VTM (+ CAP) loss
from train.loop import Task, main


def evaluate(model, processor, recipe, accelerator) -> dict:
    """Zero-shot retrieval on the evaluation split, when the recipe names one."""
    if not recipe.data.eval_split:  # pretraining evaluates only when the recipe names a split
        return {}
    return evaluate_retrieval(model, processor, recipe, accelerator)


TASK = Task(
    name="pretrain",
    model_class=TestaForPreTraining,
    text_lengths={"text": "max_text_length"},  # 30 tokens unless the recipe says otherwise (TASK_DEFAULTS)
    compute_loss=compute_loss,
    evaluate=evaluate,
)

if __name__ == "__main__":
    main(TASK)
