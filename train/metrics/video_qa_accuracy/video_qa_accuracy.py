"""Open-ended VideoQA accuracy as ActivityNet-QA's official evaluation computes it, with per-question-type accuracy.

An `evaluate` module: ``evaluate.load("train/metrics/video_qa_accuracy")`` works offline; the folder can be pushed to
the Hub as a metric unchanged. See README.md beside this file for the answer normalisation and its source.
"""

import datasets
import evaluate


_CITATION = """\
@inproceedings{yu2019activitynetqa,
  title     = {ActivityNet-QA: A Dataset for Understanding Complex Web Videos via Question Answering},
  author    = {Yu, Zhou and Xu, Dejing and Yu, Jun and Yu, Ting and Zhao, Zhou and Zhuang, Yueting and Tao, Dacheng},
  booktitle = {AAAI},
  year      = {2019}
}
"""

_DESCRIPTION = """\
Accuracy of free-form answers by exact match, the rule of ActivityNet-QA's official evaluation script
(MILVLG/activitynet-qa, evaluation/eval.py), which compares the predicted and ground-truth answer strings with `==`
and no normalisation; TESTA's VideoQA evaluation does the same. `normalization="whitespace_lowercase"` is offered
for predictions from a generator (strip, lowercase, collapse runs of whitespace); it is not the official rule.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: `list[str]`, one predicted answer per question.
    references: `list[str]`, the ground-truth answer of every question.
    question_types (optional): one type per question (`int` or `str`); accuracy is also reported per type.
    type_names (optional): `"activitynet-qa"` names ActivityNet-QA's integer types 0-8 (motion, spatial_relation,
        temporal_relation, yes_no, color, object, location, number, other) and adds `accuracy_free` over types
        3-8, as the official script prints; or a dict from type to name.
    normalization: `"exact"` (default, the official rule) or `"whitespace_lowercase"`.

Returns:
    `accuracy` (percent), `num_questions`, and with `question_types` an `accuracy_<type>` per type.

Examples:
    >>> import evaluate
    >>> qa = evaluate.load("train/metrics/video_qa_accuracy")
    >>> qa.compute(predictions=["yes", "red", "2"], references=["yes", "blue", "2"])
    {'accuracy': 66.66666666666667, 'num_questions': 3}
"""

ACTIVITYNET_QA_TYPES = {
    0: "motion", 1: "spatial_relation", 2: "temporal_relation", 3: "yes_no", 4: "color", 5: "object",
    6: "location", 7: "number", 8: "other",
}
ACTIVITYNET_QA_FREE_TYPES = (3, 4, 5, 6, 7, 8)
NORMALIZATIONS = ("exact", "whitespace_lowercase")


def normalize_answer(answer: str, normalization: str) -> str:
    if normalization == "exact":
        return answer
    return " ".join(answer.lower().split())


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class VideoQaAccuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            reference_urls=["https://github.com/MILVLG/activitynet-qa/blob/master/evaluation/eval.py"],
        )

    def _compute(self, predictions, references, question_types=None, type_names=None, normalization="exact") -> dict:
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"Unknown normalization={normalization!r}; use one of {NORMALIZATIONS}.")
        if len(predictions) == 0:
            raise ValueError("`predictions` is empty: accuracy over no questions is undefined.")
        correct = [
            normalize_answer(p, normalization) == normalize_answer(r, normalization)
            for p, r in zip(predictions, references)
        ]
        results = {"accuracy": 100.0 * sum(correct) / len(correct), "num_questions": len(correct)}
        if question_types is None:
            if type_names is not None:
                raise ValueError("`type_names` needs `question_types`.")
            return results
        if len(question_types) != len(correct):
            raise ValueError(f"`question_types` has {len(question_types)} entries for {len(correct)} questions.")
        names = ACTIVITYNET_QA_TYPES if type_names == "activitynet-qa" else (type_names or {})
        if type_names is not None and not isinstance(names, dict):
            raise ValueError(f"`type_names` must be 'activitynet-qa' or a dict, got {type_names!r}.")
        if type_names == "activitynet-qa":
            unknown = sorted({t for t in question_types if t not in ACTIVITYNET_QA_TYPES}, key=str)
            if unknown:
                raise ValueError(f"ActivityNet-QA question types are 0-8; got {unknown}.")
        by_type: dict = {}
        for kind, hit in zip(question_types, correct):
            by_type.setdefault(kind, []).append(hit)
        for kind in sorted(by_type, key=str):
            hits = by_type[kind]
            results[f"accuracy_{names.get(kind, kind)}"] = 100.0 * sum(hits) / len(hits)
        if type_names == "activitynet-qa":
            free = [hit for kind, hit in zip(question_types, correct) if kind in ACTIVITYNET_QA_FREE_TYPES]
            results["accuracy_free"] = 100.0 * sum(free) / len(free) if free else None
        return results
