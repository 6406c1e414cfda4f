"""How well the demo's model answers the README's example query: the table the README's search snippet gives.

    make demo                                    # once: outputs/demo/runs/b/final and outputs/demo/data
    python -m benchmarks.readme_query [--query TEXT] [--top-k 5] [--candidates 0]

Indexes the demo's videos as the README's "Search a folder of videos" snippet does (every video of
``outputs/demo/data/videos``, in memory, cosine ranking: ``rerank=False``), then prints, for the query (default: the
one in the README's snippet), the top ``--top-k`` videos with their score and their own caption (from the demo's
``train.jsonl`` / ``test.jsonl``), and how many of the videos whose caption starts with the query's first two sentences
are among them. ``--candidates N`` also ranks the first N test captions as queries and prints, for each, the rank of
its own video: how to pick a query the model answers well.
"""

import argparse
import json
import re
from glob import glob
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_query() -> str:
    """The query of the README's search snippet (its first ``pipe.search("...")`` or ``query = "..."``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Search a folder of videos"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return re.search(r"(?:query = |pipe\.search\()\"([^\"]+)\"", code).group(1)


def captions(data: Path) -> dict[str, str]:
    """Video file name -> caption, over the demo's splits."""
    found = {}
    for split in ("train", "test"):
        for line in (data / f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                found[Path(row["video"]).name] = row["text"]
    return found


def opening(text: str, sentences: int = 2) -> str:
    return ". ".join(text.split(". ")[:sentences])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/demo/runs/b/final")
    parser.add_argument("--data", type=Path, default=Path("outputs/demo/data"))
    parser.add_argument("--query", default=None, help="default: the README's")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--candidates", type=int, default=0, help="also rank the first N test captions")
    args = parser.parse_args()
    for path in (Path(args.model), args.data):
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `make demo` first.")
    from transformers import pipeline

    query = args.query or readme_query()
    pipe = pipeline("video-text-retrieval", model=args.model, trust_remote_code=True)
    index = pipe.encode_videos(sorted(glob(str(args.data / "videos" / "*.mp4"))))
    caption_of = captions(args.data)
    hits = pipe.search(query, index, top_k=args.top_k, rerank=False)
    sharing = {name for name, text in caption_of.items() if opening(text) == opening(query)}
    print(f"query: {query!r} ({len(index)} videos; {len(sharing)} captions start with its first two sentences)\n")
    print("| rank | video | cosine | its caption |\n|---|---|---|---|")
    for rank, hit in enumerate(hits, 1):
        name = Path(hit["video"]).name
        print(f"| {rank} | {name} | {hit['score']:.4f} | {caption_of.get(name, '?')} |")
    found = sum(Path(hit["video"]).name in sharing for hit in hits)
    exact = [rank for rank, hit in enumerate(hits, 1) if caption_of.get(Path(hit["video"]).name) == query]
    print(f"\n{found} of the top {args.top_k} start with the query's first two sentences; the video captioned "
          f"exactly by the query: {'rank ' + str(exact[0]) if exact else 'not in the top ' + str(args.top_k)}")
    if args.candidates:
        test = [json.loads(line) for line in (args.data / "test.jsonl").read_text().splitlines() if line.strip()]
        texts = [row["text"] for row in test[:args.candidates]]
        ranked = pipe.search(texts, index, top_k=None, rerank=False)
        print("\n| own video's rank | caption |\n|---|---|")
        for row, hits in zip(test, ranked):
            names = [Path(hit["video"]).name for hit in hits]
            print(f"| {names.index(Path(row['video']).name) + 1} | {row['text']} |")


if __name__ == "__main__":
    main()
