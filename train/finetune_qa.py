"""Fine-tunes TESTA for long-form VideoQA (answer LM loss) and evaluates exact-match accuracy by ranking a
candidate list built from the TRAINING answers (the original used the evaluated split's own answers, a leak).

    accelerate launch [accelerate flags] train/finetune_qa.py --config configuration/vqa_activitynet_f32.yaml \
        [--dataset DIR_OR_HUB_ID] [--output-dir OUT] [--max-steps N] [--resume-from CKPT]
"""


import torch

from modeling_testa import TestaForVideoQA
from train.evaluation import evaluate_qa
from train.loop import Task, load_rows, main


ANSWERS: list[str] = []


def training_answers(model, processor, recipe, accelerator) -> None:
    """The candidate answers: every distinct answer of the training split, in first-seen order."""
    rows = load_rows(recipe, recipe.data.train_split, "qa", streaming=False)
    ANSWERS[:] = list(dict.fromkeys(str(answer) for answer in rows["answer"]))


def compute_loss(model, batch: dict, warmup_progress: float) -> torch.Tensor:
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
        labels=batch["answer_input_ids"], decoder_attention_mask=batch["answer_attention_mask"],
    ).loss


def evaluate(model, processor, recipe, accelerator) -> dict:
    return evaluate_qa(model, processor, recipe, accelerator, ANSWERS)


TASK = Task(
    name="qa",
    model_class=TestaForVideoQA,
    text_lengths={"question": "max_question_length", "answer": "max_answer_length"},
    compute_loss=compute_loss,
    evaluate=evaluate,
    prepare_model=training_answers,
)

if __name__ == "__main__":
    main(TASK)
