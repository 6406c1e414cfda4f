"""Re-ranking with int8 tokens (one scale per token, `testa_search.store.int8_tokens`) against fp16 tokens.

    python -m benchmarks.int8_tokens                                   # the demo's model (b) and test set
    python -m benchmarks.int8_tokens --model DIR --data DIR --split test

Encodes the split's videos once (fp32 tokens in memory), then searches every caption with
`VideoTextRetrievalPipeline.search(top_k=10, rerank_k=k_test)` over two indexes that differ only in their tokens:
fp16, and int8 (the fp16 tokens quantized and read back as a video store with ``token_dtype="int8"`` does). Reports
the agreement of the two rankings (top-1 equal, top-10 lists equal, top-10 overlap), the largest difference of a
re-ranked score, R@1/R@5 of each against the captions' videos, and the bytes of one video's tokens.
"""

import argparse
import json
from pathlib import Path

import torch

from modeling_testa import TestaForVideoTextRetrieval, TestaProcessor, VideoTextRetrievalPipeline
from testa_search.store.int8_tokens import SCALE_BYTES, pack, unpack
from testa_search.index import VideoIndex
from train.evaluation import load_metric

DEMO = Path("outputs/demo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEMO / "runs/b/final"))
    parser.add_argument("--data", default=str(DEMO / "data"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (Path(args.data) / f"{args.split}.jsonl").read_text().splitlines() if line]
    videos = sorted({str(Path(args.data) / row["video"]) for row in rows})
    pipe = VideoTextRetrievalPipeline(model=TestaForVideoTextRetrieval.from_pretrained(args.model),
                                      processor=TestaProcessor.from_pretrained(args.model), device="cpu")
    encoded = pipe.encode_videos(videos, batch_size=8, token_dtype=torch.float32)
    fp16 = VideoIndex(videos=encoded.videos, embeddings=encoded.embeddings, tokens=encoded.tokens.half(),
                      token_sizes=encoded.token_sizes, info=encoded.info)
    int8 = VideoIndex(videos=encoded.videos, embeddings=encoded.embeddings, tokens=unpack(pack(encoded.tokens.half())),
                      token_sizes=encoded.token_sizes, info=encoded.info)
    texts = [row["text"] for row in rows]
    truth = [str(Path(args.data) / row["video"]) for row in rows]
    k_test = int(pipe.model.config.k_test)
    results = {}
    for name, index in (("fp16", fp16), ("int8", int8)):
        results[name] = pipe.search(texts, index, top_k=10, rerank_k=min(k_test, len(videos)))
    first = [a[0]["video"] == b[0]["video"] for a, b in zip(results["fp16"], results["int8"])]
    lists = [[r["video"] for r in a] == [r["video"] for r in b] for a, b in zip(results["fp16"], results["int8"])]
    overlap = [len({r["video"] for r in a} & {r["video"] for r in b}) / 10
               for a, b in zip(results["fp16"], results["int8"])]
    differences = []
    for a, b in zip(results["fp16"], results["int8"]):
        scores = {r["video"]: r["score"] for r in b if r["reranked"]}
        differences += [abs(r["score"] - scores[r["video"]]) for r in a if r["reranked"] and r["video"] in scores]

    position = {video: i for i, video in enumerate(videos)}
    metric = load_metric("video_text_retrieval", "ranked_lists")
    retrieval = {name: metric.compute(predictions=[[position[r["video"]] for r in ranked] for ranked in results[name]],
                                      references=[[position[t]] for t in truth], ks=[1, 5], truncated="miss")
                 for name in results}

    hidden, count = int(encoded.tokens.shape[2]), int(encoded.tokens.shape[1])
    report = {
        "model": args.model, "videos": len(videos), "queries": len(texts), "rerank_k": min(k_test, len(videos)),
        "top1_equal": sum(first) / len(first), "top10_lists_equal": sum(lists) / len(lists),
        "top10_overlap": sum(overlap) / len(overlap), "max_abs_score_difference": max(differences),
        "R@1": {name: retrieval[name]["R@1"] / 100 for name in results},
        "R@5": {name: retrieval[name]["R@5"] / 100 for name in results},
        "token_bytes_per_video": {"fp16": count * hidden * 2, "int8": count * (hidden + SCALE_BYTES)},
        "tokens_per_video": count, "hidden_size": hidden,
    }
    print(json.dumps(report, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
