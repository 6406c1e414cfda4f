"""Peak memory of the retrieval evaluation against the collection size, and a memory plan for ActivityNet.

    python -m benchmarks.eval_memory                       # 200, 800 and 3200 videos, store path and the old path
    python -m benchmarks.eval_memory --modes store --malloc-mmap-threshold 65536 --no-plan   # allocator isolated

Part 1 runs `train.evaluation` (`encode_to_store` + `retrieval_metrics`: the code `evaluate_retrieval` runs after
reading the rows) on N synthetic videos with one paragraph each, **each size in a fresh process**, with a tiny
TESTA (vision 8 frames of 64 px, 8-px patches, R_T=1, R_S=8: 289 tokens of 64 dims per video; 2-layer BERT of 64
dims), one process, CPU. Decoding is bypassed: each video's `pixel_values` are random numbers seeded by its index,
made in the DataLoader's collate exactly where `DecodeVideos` would decode (decoding cost and memory are not the
point here; `DecodeVideos` holds one decoded batch per worker). Peak RSS is the process's high-water mark
(`VmHWM`), reset (`/proc/self/clear_refs`) after the model is built, so "evaluation peak" is the peak resident set
during evaluation and "growth" is that peak minus the resident set before it. Store reads use `os.preadv`, so
pages of the store file sit in the kernel's page cache, not in the process.

`--modes in-memory` also runs the evaluation as it was before the store: every video's tokens gathered in memory
(fp32), then `model.rank_videos`/`rank_texts` over the whole collection (full query x video score matrices).

Part 2 prints, per process, a memory plan for ActivityNet-Captions val (4917 videos, one paragraph each) on 8
processes with ViT-B/16 + BERT-base sizes at 32 frames (1041 tokens x 768 after R_T=1, R_S=12) and 96 frames (4801
tokens, R_T=4, R_S=8), with the recipes' values (configuration/retrieval_activitynet_f{32,96}.yaml: eval.batch_size
256 / 64 global, k_test 128, max_text_length 64, 8 DataLoader workers per process): the token store on disk, what
a process holds in host and device memory, and the largest tensor. The plan is arithmetic on those shapes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MiB = 2**20
GB = 1e9


# ------------------------------------------------------------------------------------------------- measurement


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def tiny_model():
    import torch

    from modeling_testa import TestaConfig, TestaForVideoTextRetrieval

    vision = {"num_frames": 8, "image_size": 64, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128, "temporal_reduction": 1, "spatial_reduction": 8}
    text = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "max_position_embeddings": 32, "bos_token_id": 998, "sep_token_id": 102,
            "pad_token_id": 0}
    config = TestaConfig(vision_config=vision, text_config=text, projection_dim=32, queue_size=8, enc_token_id=999,
                         dec_token_id=998)
    torch.manual_seed(0)
    return TestaForVideoTextRetrieval(config).eval()


class SyntheticPixels:
    """Collate for `encode_to_store` that bypasses decoding: random pixel values seeded by the video's index."""

    def __call__(self, batch):
        import torch

        indices = [index for index, _ in batch]
        pixels = torch.stack([torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(i)) for i in indices])
        return indices, pixels, []


def child(size: int, mode: str, k_test: int, batch_size: int, threads: int) -> dict:
    import torch
    from accelerate import Accelerator

    from train.evaluation import RERANK_BATCH_SIZE, encode_to_store, load_metric, retrieval_metrics

    torch.set_num_threads(threads)
    model = tiny_model()
    accelerator = Accelerator(cpu=True)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1000 % 997, 990, (size, 16), generator=generator)
    input_ids[:, 0], input_ids[:, -1] = 101, 102
    attention_mask = torch.ones_like(input_ids)
    text_video = list(range(size))
    with torch.no_grad():  # warm up the kernels outside the measurement
        warm = model.get_video_tokens(torch.zeros(2, 8, 3, 64, 64)).last_hidden_state
        model.itm_logits(input_ids[:2], attention_mask[:2], warm)
    load_metric("video_text_retrieval", "ranked_lists")  # import `evaluate` (seconds, ~100 MiB) before measuring
    rss_before = _status("VmRSS")
    reset = _reset_peak()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eval-memory-") as directory:
        if mode == "store":
            store, _ = encode_to_store(model, [f"video{i}" for i in range(size)], SyntheticPixels(), accelerator,
                                       directory, batch_size, token_dtype=torch.float16)
            metrics = retrieval_metrics(model, store, input_ids, attention_mask, text_video, accelerator, k_test)
            store_bytes = sum(f.stat().st_size for f in Path(directory).iterdir())
            tokens = store.num_tokens
            similarity_bytes = 2 * min(RERANK_BATCH_SIZE, size) * size * 4  # one chunk of similarity + score rows
            store.close()
        else:  # the evaluation before the store: all tokens in memory, full score matrices
            collate, token_list, size_list, feature_list = SyntheticPixels(), [], [], []
            with torch.no_grad():
                for i in range(0, size, batch_size):
                    _, pixels, _ = collate([(j, None) for j in range(i, min(i + batch_size, size))])
                    out = model.get_video_tokens(pixels)
                    token_list.append(out.last_hidden_state)
                    size_list.append(out.token_sizes)
                    feature_list.append(model.get_video_features(video_tokens=out.last_hidden_state,
                                                                 video_token_sizes=out.token_sizes).pooler_output)
                video_tokens, sizes = torch.cat(token_list), torch.cat(size_list)
                features = torch.cat(feature_list)
                del token_list, size_list, feature_list
                k = min(k_test, size)
                t2v = model.rank_videos(input_ids, video_tokens, attention_mask, video_token_sizes=sizes,
                                        video_features=features, k=k).scores
                v2t = model.rank_texts(input_ids, video_tokens, attention_mask, video_token_sizes=sizes,
                                       video_features=features, k=k).scores
            metrics = load_metric("video_text_retrieval").compute(
                predictions=t2v.tolist(), references=[[v] for v in text_video], reverse_predictions=v2t.tolist(),
                reverse_references=[[t] for t in text_video],
            )
            store_bytes, tokens = 0, video_tokens.shape[1]
            similarity_bytes = 2 * 2 * size * size * 4  # similarity + scores, both directions
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"size": size, "mode": mode, "rss_before": rss_before, "peak": peak, "growth": peak - rss_before,
            "peak_was_reset": reset, "similarity_bytes": similarity_bytes, "store_bytes": store_bytes,
            "tokens_per_video": tokens, "seconds": seconds, "t2v_R@1": metrics["t2v_R@1"]}


def run_child(size: int, mode: str, args) -> dict:
    command = [sys.executable, "-m", __spec__.name, "--child", str(size), "--mode", mode, "--k-test", str(args.k_test),
               "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- memory plan


def memory_plan(num_videos: int, tokens: int, frames: int, global_batch: int, processes: int = 8, hidden: int = 768,
                projection: int = 256, text_length: int = 64, k_test: int = 128, rerank_pairs: int = 128,
                workers: int = 8, image_size: int = 224, patch: int = 16, heads: int = 12,
                token_bytes: int = 2, compute_bytes: int = 4) -> dict:
    """Bytes per process of `evaluate_retrieval` (one paragraph per video)."""
    num_texts = num_videos
    per_process_videos = -(-num_videos // processes)
    batch = max(1, global_batch // processes)
    patches = (image_size // patch) ** 2
    video_pixels = frames * 3 * image_size * image_size * 4  # fp32 pixel_values
    disk = {
        "tokens (fp16)": num_videos * tokens * hidden * token_bytes,
        "token sizes (fp32)": num_videos * tokens * 4,
        "embeddings (fp32)": num_videos * projection * 4,
    }
    host = {
        "all video embeddings": num_videos * projection * 4,
        "all texts (ids + mask, int64)": 2 * num_texts * text_length * 8,
        f"decoded batches in flight ({workers} workers x 1 + 1 being encoded)": (workers + 1) * batch * video_pixels,
        "similarity + score rows of 128 queries": 2 * min(rerank_pairs, num_texts) * num_videos * 4,
        "tokens of one re-rank batch (fp16, read from the store)": rerank_pairs * tokens * hidden * token_bytes,
    }
    single_host = {  # single tensors among the host items
        "host: one decoded batch (pixel_values)": batch * video_pixels,
        "host: tokens of one re-rank batch": rerank_pairs * tokens * hidden * token_bytes,
        "host: similarity rows of 128 queries": min(rerank_pairs, num_texts) * num_videos * 4,
    }
    device = {
        "pixel_values of one batch": batch * video_pixels,
        "encoder MLP activation, first block": batch * (1 + frames * patches) * 4 * hidden * compute_bytes,
        "text features": num_texts * projection * compute_bytes,
        "re-rank batch tokens": rerank_pairs * tokens * hidden * compute_bytes,
        "re-rank cross-attention K (or V), one layer": rerank_pairs * tokens * hidden * compute_bytes,
        "re-rank cross-attention probabilities, one layer": rerank_pairs * heads * text_length * tokens * compute_bytes,
    }
    items = {**single_host, **{f"device: {k}": v for k, v in device.items()}}
    largest = max(items, key=items.get)
    return {
        "num_videos": num_videos, "frames": frames, "tokens": tokens, "processes": processes,
        "per_process_videos": per_process_videos, "per_process_batch": batch,
        "disk": disk, "disk_total": sum(disk.values()), "disk_per_process_shard": sum(disk.values()) / processes,
        "host": host, "host_total": sum(host.values()), "device": device, "largest": (largest, items[largest]),
        "before (all tokens gathered in fp32 on every process)": num_videos * tokens * hidden * 4,
    }


def print_plan(plan: dict) -> None:
    print(f"\nActivityNet val, {plan['frames']} frames: {plan['num_videos']} videos x {plan['tokens']} tokens x 768, "
          f"{plan['processes']} processes ({plan['per_process_videos']} videos and paragraphs each, "
          f"{plan['per_process_batch']} videos per encoder step)")
    print(f"  token store on disk: {plan['disk_total'] / GB:.2f} GB in all, "
          f"{plan['disk_per_process_shard'] / GB:.2f} GB per process shard")
    for name, value in plan["disk"].items():
        print(f"    {name:<60} {value / GB:9.3f} GB")
    print(f"  host memory per process (evaluation data): {plan['host_total'] / GB:.2f} GB")
    for name, value in plan["host"].items():
        print(f"    {name:<60} {value / GB:9.3f} GB")
    print("  device memory per process (besides the weights):")
    for name, value in plan["device"].items():
        print(f"    {name:<60} {value / GB:9.3f} GB")
    name, value = plan["largest"]
    print(f"  largest tensor: {name} = {value / GB:.2f} GB")
    before = plan["before (all tokens gathered in fp32 on every process)"]
    print(f"  before the store, every process held all tokens in fp32: {before / GB:.1f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 800, 3200])
    parser.add_argument("--modes", nargs="+", default=["store", "in-memory"], choices=["store", "in-memory"])
    parser.add_argument("--k-test", type=int, default=8, help="candidates re-ranked per query (default 8)")
    parser.add_argument("--batch-size", type=int, default=16, help="videos per encoder step (default 16)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0,
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ in the measured processes (fixes the threshold that "
                             "glibc otherwise raises as large blocks are freed, which lets heap fragmentation grow "
                             "with the number of batches)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="store", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--no-plan", action="store_true", help="skip the ActivityNet memory plan")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.mode, args.k_test, args.batch_size, args.threads)))
        return

    allocator = f"MALLOC_MMAP_THRESHOLD_={args.malloc_mmap_threshold}" if args.malloc_mmap_threshold else \
        "default glibc allocator settings"
    print(f"Evaluation peak RSS (fresh process per size; k_test={args.k_test}, {args.batch_size} videos per encoder "
          f"step, {args.threads} thread(s), {allocator}, synthetic pixel values: decoding bypassed)")
    header = ("mode", "videos", "tokens/video", "store on disk (MiB)", "RSS before (MiB)", "peak (MiB)",
              "growth (MiB)", "sim.+score rows (MiB)", "growth - rows (MiB)", "time (s)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    results = []
    for mode in args.modes:
        for size in args.sizes:
            r = run_child(size, mode, args)
            results.append(r)
            print(f"| {mode} | {size} | {r['tokens_per_video']} | {r['store_bytes'] / MiB:.1f} | "
                  f"{r['rss_before'] / MiB:.0f} | {r['peak'] / MiB:.0f} | {r['growth'] / MiB:.1f} | "
                  f"{r['similarity_bytes'] / MiB:.1f} | {(r['growth'] - r['similarity_bytes']) / MiB:.1f} | "
                  f"{r['seconds']:.1f} |", flush=True)
    for mode in args.modes:
        rows = [r for r in results if r["mode"] == mode]
        small, large = rows[0], rows[-1]
        ratio_peak = large["peak"] / small["peak"]
        ratio_growth = (large["growth"] - large["similarity_bytes"]) / max(
            small["growth"] - small["similarity_bytes"], 1)
        print(f"{mode}: {small['size']} -> {large['size']} videos: peak RSS x{ratio_peak:.2f}, "
              f"growth without the similarity/score rows x{ratio_growth:.2f}")

    plans = [] if args.no_plan else [memory_plan(4917, 1041, 32, 256), memory_plan(4917, 4801, 96, 64)]
    for plan in plans:
        print_plan(plan)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "plans": plans}, indent=1))


if __name__ == "__main__":
    main()
