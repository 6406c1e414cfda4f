"""End-to-end indexing throughput: `VideoTextRetrievalPipeline.encode_videos` over a folder of videos, with and without
the fast path (decoding in parallel workers, `num_workers`, and the int8 encoder, `precision="int8"`), next to
decoding alone and encoding alone, so that the bottleneck on this machine shows.

    python -m processing.synthetic --output-dir /tmp/x --num-videos 32       # some mp4 files, if you have none
    python -m benchmarks.indexing_speed --videos /tmp/x/videos --model /tmp/demo_run/train/final
    python -m benchmarks.indexing_speed --videos /tmp/x/videos --vit-b        # random ViT-B/16, 32 frames of 224 px
    python -m benchmarks.indexing_speed --videos /tmp/x/videos --vit-b --fast openvino:int8   # the exported encoder

Rows, in one process, each over the same videos (the first ``--limit``):

* decode only: the pipeline's decode path (`TestaVideoProcessor`, decoder helper process) for every video, in this
  thread, then with ``--workers`` threads that each have their own decoder process;
* encode only: the encoder on already-decoded videos, in batches of ``--batch-size`` (fp32, then int8);
* end to end: `encode_videos` with ``num_workers=0`` and ``num_workers=--workers``, for fp32 and int8; the index's
  `stats` give the share of the time the encoder waited for decoding.

All rows are run in turn, ``--repeats`` times, and medians are reported, so the ratios come from one run.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from modeling_testa import TestaConfig, TestaForVideoTextRetrieval, TestaProcessor, TestaVideoProcessor
from testa_runtimes import optimize_for_inference
from testa_search.encoding import DecodeAhead, InMemorySink, encode_videos
from modeling_testa.pipeline_testa import VideoTextRetrievalPipeline
from modeling_testa.video_decoding import own_decoder_process


def vit_b_model() -> tuple[TestaForVideoTextRetrieval, TestaProcessor]:
    """Random ViT-B/16 video encoder (32 frames of 224 px, R_T=1, R_S=12) with a tiny text side (unused here)."""
    text = dict(vocab_size=30524, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                bos_token_id=30522, sep_token_id=102, pad_token_id=0)
    config = TestaConfig(vision_config=dict(num_frames=32, temporal_reduction=1, spatial_reduction=12),
                         text_config=text, projection_dim=256)
    torch.manual_seed(0)
    model = TestaForVideoTextRetrieval(config).eval()
    video_processor = TestaVideoProcessor(num_frames=32, size={"shortest_edge": 224},
                                          crop_size={"height": 224, "width": 224})
    return model, TestaProcessor(video_processor=video_processor)


def load(args):
    if args.vit_b:
        return vit_b_model()
    return TestaForVideoTextRetrieval.from_pretrained(str(args.model)).eval(), TestaProcessor.from_pretrained(str(args.model))


def make_pipe(model, processor) -> VideoTextRetrievalPipeline:
    return VideoTextRetrievalPipeline(model=model, processor=processor, device="cpu")


def decode_all(pipe, videos, workers: int) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    decode = lambda i: pipe.video_processor(videos[i], return_tensors="pt")["pixel_values"]  # noqa: E731
    with DecodeAhead(decode, len(videos), workers, max(2 * workers, 1), own_decoder_process) as decoded:
        pixels = [decoded.get(i) for i in range(len(videos))]
    return time.perf_counter() - start, pixels


@torch.inference_mode()
def encode_all(pipe, pixels, batch_size: int) -> float:
    batches = ((list(range(i, min(i + batch_size, len(pixels)))), torch.cat(pixels[i : i + batch_size]), [])
               for i in range(0, len(pixels), batch_size))
    return encode_videos(pipe.model, batches, InMemorySink()).encode_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=Path, required=True, help="a folder of .mp4 files")
    parser.add_argument("--model", type=Path, help="a TestaForVideoTextRetrieval folder with its processor")
    parser.add_argument("--vit-b", action="store_true", help="a random ViT-B/16 encoder, 32 frames of 224 px")
    parser.add_argument("--limit", type=int, default=32, help="how many videos (the first, sorted by name)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: PyTorch's, one per core)")
    parser.add_argument("--fast", default="torch:int8",
                        help="the fast encoder, BACKEND:PRECISION (default torch:int8; e.g. openvino:int8, the "
                             "exported encoder, cached in --cache-dir)")
    parser.add_argument("--cache-dir", type=Path, help="exported encoders' cache (default: $HF_HOME/testa/engines)")
    args = parser.parse_args()
    backend, precision = args.fast.split(":")
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.model is None) == (not args.vit_b):
        parser.error("pass exactly one of --model DIR and --vit-b")
    videos = sorted(str(p) for p in args.videos.glob("*.mp4"))[: args.limit]
    if not videos:
        parser.error(f"no .mp4 files in {args.videos}")

    model, processor = load(args)
    fp32 = make_pipe(model, processor)
    engine = {} if backend == "torch" else {"cache_dir": args.cache_dir}
    int8 = make_pipe(optimize_for_inference(load(args)[0], precision, backend=backend, **engine), processor)
    fast = precision if backend == "torch" else f"{precision} ({backend})"
    vision = model.config.vision_config
    print(f"{len(videos)} videos from {args.videos}; encoder: {vision.num_hidden_layers} layers, hidden "
          f"{vision.hidden_size}, {processor.video_processor.num_frames} frames of "
          f"{processor.video_processor.crop_size['height']} px; batch {args.batch_size}; "
          f"{torch.get_num_threads()} torch threads; {os.cpu_count()} cores, load average "
          + "{:.1f} {:.1f} {:.1f}\n".format(*os.getloadavg()), flush=True)

    _, pixels = decode_all(fp32, videos, 0)  # starts the decoder helper; the decoded videos for "encode only"
    for pipe in (fp32, int8):  # warm-up
        encode_all(pipe, pixels[: args.batch_size], args.batch_size)

    def decode_only(workers):
        return len(videos) / decode_all(fp32, videos, workers)[0], None

    def encode_only(pipe):
        return len(videos) / encode_all(pipe, pixels, args.batch_size), None

    def end_to_end(pipe, workers):
        stats = pipe.encode_videos(videos, batch_size=args.batch_size, num_workers=workers, progress_bar=False).stats
        return stats["videos_per_second"], stats["decode_wait_seconds"] / stats["seconds"]

    contenders = {
        "decode only, in this thread": lambda: decode_only(0),
        f"decode only, {args.workers} workers": lambda: decode_only(args.workers),
        "encode only, fp32": lambda: encode_only(fp32),
        f"encode only, {fast}": lambda: encode_only(int8),
        "end to end, fp32, num_workers=0 (no fast path)": lambda: end_to_end(fp32, 0),
        f"end to end, fp32, num_workers={args.workers}": lambda: end_to_end(fp32, args.workers),
        f"end to end, {fast}, num_workers=0": lambda: end_to_end(int8, 0),
        f"end to end, {fast}, num_workers={args.workers}": lambda: end_to_end(int8, args.workers),
    }
    rates, waits = {name: [] for name in contenders}, {name: [] for name in contenders}
    for repeat in range(args.repeats):  # the contenders alternate
        for name, run in contenders.items():
            rate, wait = run()
            rates[name].append(rate)
            waits[name].append(wait)
            print(f"repeat {repeat + 1}: {name}: {rate:.2f} videos/s", flush=True)
    baseline = statistics.median(rates["end to end, fp32, num_workers=0 (no fast path)"])
    rows = []
    for name in contenders:
        rate = statistics.median(rates[name])
        extra = "-" if waits[name][0] is None else \
            f"{100 * statistics.median(waits[name]):.0f}% | {rate / baseline:.2f}x"
        rows.append((name, rate, extra))

    print("\n| configuration | videos/s | encoder waiting for decoding | vs end to end without fast path |")
    print("|---|---|---|---|")
    for label, rate, extra in rows:
        extra = extra if extra != "-" else "- | -"
        print(f"| {label} | {rate:.2f} | {extra} |")
    decode_rate = max(r for label, r, _ in rows if label.startswith("decode only"))
    encode_rate = max(r for label, r, _ in rows if label.startswith("encode only"))
    bottleneck = "decoding" if decode_rate < encode_rate else "the encoder"
    print("\nload average at the end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"\nOn this machine the bottleneck is {bottleneck}: decoding reaches {decode_rate:.2f} videos/s at best, "
          f"the encoder {encode_rate:.2f} videos/s.")


if __name__ == "__main__":
    main()
