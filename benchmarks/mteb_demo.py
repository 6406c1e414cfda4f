"""MTEB on the demo's model (b) and its test split, next to the library's own evaluation (`train/evaluation.py`).

    make demo                               # once: trains outputs/demo/runs/b/final, writes outputs/demo/data
    python -m benchmarks.mteb_demo [--output docs/mteb_demo.md]

Rows: the library's two-stage evaluation with the demo recipe (`k_test` 1: ranking by cosine, see
`configuration/short_events.yaml`) and with `k_test` 10; MTEB with the Sentence Transformers bi-encoder of the same folder (first stage,
cosine); and MTEB re-ranking the bi-encoder's top ``k`` with the `CrossEncoder` of the same weights (matching head +
cosine), for ``k`` = 1 (the recipe's `k_test`) and 10. MTEB scores a re-ranking task on its candidates only, so its
R@K for K above ``k`` counts only the ``k`` candidates (the library's evaluation ranks the rest by cosine).
Videos are decoded by TESTA's processor (no torchcodec); the folder is re-saved first so that it holds the
Sentence Transformers files of this version.
"""

import argparse
import tempfile
from pathlib import Path

import mteb
from sentence_transformers import CrossEncoder, SentenceTransformer

from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.processing_testa import TestaProcessor
from modeling_testa.cross_encoder import save_cross_encoder
from train.demo import RECIPE, evaluate_variant
from train.mteb_evaluation import TestaMTEBCrossEncoder, TestaMTEBEncoder, first_stage_top_k, local_retrieval_task

KS = (1, 5, 10)


def mteb_row(model, task) -> dict[str, float]:
    scores = mteb.evaluate(model, task, cache=None, show_progress_bar=False).task_results[0].scores["test"][0]
    # R@K as the library counts it (the best positive in the top K) is MTEB's hit rate; its recall differs for a
    # query with several positives (a video with several texts)
    return {**{f"R@{k}": 100 * scores[f"hit_rate_at_{k}"] for k in KS}, "MRR@10": 100 * scores["mrr_at_10"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("outputs/demo/runs/b/final"))
    parser.add_argument("--data", type=Path, default=Path("outputs/demo/data"))
    parser.add_argument("--output", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    for path in (args.model, args.data):
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `make demo` first, or pass --model/--data.")

    library = evaluate_variant(args.model, args.data)
    with tempfile.TemporaryDirectory() as scratch:  # the same recipe with k_test 10
        recipe = Path(scratch) / "k10.yaml"
        recipe.write_text(RECIPE.read_text().replace("k_test: 1\n", "k_test: 10\n"))
        library_k10 = evaluate_variant(args.model, args.data, recipe)
    rows = {"t2v": {}, "v2t": {}}
    for direction in rows:
        for name, result in (("library evaluation (two-stage, k_test 1)", library),
                             ("library evaluation (two-stage, k_test 10)", library_k10)):
            rows[direction][name] = {**{f"R@{k}": result[f"{direction}_R@{k}"] for k in KS}, "MRR@10": None}
    with tempfile.TemporaryDirectory() as scratch:
        model = TestaForVideoTextRetrieval.from_pretrained(args.model).eval()
        processor = TestaProcessor.from_pretrained(args.model)
        bi, ce = Path(scratch) / "bi", Path(scratch) / "ce"
        model.save_pretrained(bi)
        processor.save_pretrained(bi)
        save_cross_encoder(model, processor, ce)
        encoder = TestaMTEBEncoder(SentenceTransformer(str(bi), trust_remote_code=True))
        reranker = TestaMTEBCrossEncoder(CrossEncoder(str(ce), trust_remote_code=True))
        for direction in rows:
            task = local_retrieval_task(str(args.data), direction=direction)
            rows[direction]["MTEB, bi-encoder (cosine)"] = mteb_row(encoder, task)
            for k in (1, 10):
                top = first_stage_top_k(encoder, task, k)
                rerank = local_retrieval_task(str(args.data), direction=direction, top_ranked=top,
                                              name=f"TestaDemo{direction.upper()}Rerank{k}")
                rows[direction][f"MTEB, bi-encoder top {k} + CrossEncoder"] = mteb_row(reranker, rerank)

    lines = [f"MTEB 2 on the demo's model (b) ({args.model}), test split of {args.data} "
             f"({library['num_videos']} videos, {library['num_texts']} paragraphs), percent:", ""]
    for direction, table in rows.items():
        lines += [f"| {direction} | R@1 | R@5 | R@10 | MRR@10 |", "|---|---|---|---|---|"]
        for name, row in table.items():
            cells = ["-" if row[key] is None else f"{row[key]:.2f}" for key in ("R@1", "R@5", "R@10", "MRR@10")]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Command: `python -m benchmarks.mteb_demo --output docs/mteb_demo.md`")
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
