"""Draws the text-grounding heat map (the paper's Figure 4) for one synthetic test video with the demo's model.

    python -m benchmarks.make_grounding [--model outputs/synthetic/train/final] [--data outputs/synthetic/data] \
        [--output docs/grounding_example.png]

The phrases are the sentences of the video's own paragraph; each row shows, for one phrase, the cosine similarity of
its VTC embedding with every aggregated region (red = most similar), the best region outlined in white.
"""

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.grounding import draw_grounding, ground_phrases
from modeling_testa.processing_testa import TestaProcessor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "outputs" / "synthetic" / "train" / "final")
    parser.add_argument("--data", type=Path, default=REPO / "outputs" / "synthetic" / "data")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "grounding_example.png")
    parser.add_argument("--row", type=int, default=0, help="which test video")
    args = parser.parse_args()
    model = TestaForVideoTextRetrieval.from_pretrained(str(args.model)).eval()
    processor = TestaProcessor.from_pretrained(str(args.model))
    example = [json.loads(line) for line in (args.data / "test.jsonl").read_text().splitlines()][args.row]
    phrases = [s.strip() + "." for s in example["text"].split(".") if s.strip()]
    grounding = ground_phrases(model, processor, str(args.data / example["video"]), phrases)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    draw_grounding(grounding).save(args.output)
    print(f"{example['video']}: best region per phrase {grounding.best_regions()}; wrote {args.output}")


if __name__ == "__main__":
    main()
