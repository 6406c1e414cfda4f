"""Peak memory of one 96-frame forward pass: TESTA R_T=4, R_S=8 against no aggregation (ViT-B/16, 224 px, batch 1).

    python -m benchmarks.memory_96                 # inference (inference_mode), fp32 and int8, fresh processes
    python -m benchmarks.memory_96 --train         # + forward and backward, as in training (the paper's setting)
    python -m benchmarks.memory_96 --small         # a quick look (24 frames, 112 px, 4 layers)

Every measurement runs in a fresh subprocess (as `encoder_speed.py` does): the model is built, the resident-set
high-water mark is reset (CPU: `/proc/self/clear_refs`; CUDA: `torch.cuda.reset_peak_memory_stats`), and the peak
growth of one pass is read afterwards, so that peaks do not mix. On the CPU the subprocesses run with glibc's
`MALLOC_MMAP_THRESHOLD_=65536`, so that freed tensors leave the resident set and it follows the live tensors. The
same subprocess then runs a second pass and reads the peak during every encoder block (hooks), over the memory
before the pass, which shows where the peak comes from.

Then, from the token schedule, the activation sizes per block: tokens x hidden of the residual stream, the qkv and
MLP intermediate tensors, and the attention matrices (temporal: patches x heads x frames^2; spatial: frames x heads x
(patches + 1)^2) with the attention implementation in use. With SDPA the attention matrices are not materialised
(PyTorch's CPU flash-attention kernel works on blocks); with `eager` they are.

The paper's 19.2 -> 12.6 GB (66%) is a training measurement: there every block's activations are kept for the
backward pass, so memory follows the sum over blocks, which merging shrinks block after block. In inference only one
block's activations are alive at a time, so the peak follows the largest block: the first, where all 96 frames and
196 patches per frame are still there (merging happens inside it).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from modeling_testa import TestaVisionConfig, TestaVisionModel, token_schedule
from testa_runtimes import optimize_for_inference
from benchmarks.encoder_args import add_encoder_arguments, encoder_settings, status_kib


MiB = 2**20


def config_of(args, merged: bool) -> TestaVisionConfig:
    return TestaVisionConfig(
        **encoder_settings(args),
        temporal_reduction=args.temporal_reduction if merged else 0,
        spatial_reduction=args.spatial_reduction if merged else 0,
        attn_implementation=args.attention,
    )


class Meter:
    """Peak memory growth (MiB) over a starting point: resident set on the CPU, allocator on CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def reset(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / MiB
        Path("/proc/self/clear_refs").write_text("5")
        return status_kib("VmRSS:") / 1024

    def peak(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MiB
        return status_kib("VmHWM:") / 1024


def child(args) -> None:
    """One measurement in this (fresh) process; prints a json line."""
    merged = args.child.startswith("merged")
    precision = args.child.split("-", 1)[1]
    model = TestaVisionModel(config_of(args, merged)).to(args.device).eval()
    if precision != "fp32":
        optimize_for_inference(model, precision)
    video = torch.randn(1, args.frames, 3, args.image_size, args.image_size, device=args.device)
    meter = Meter(args.device)
    base = meter.reset()
    start = time.perf_counter()
    if args.mode == "train":
        model.train()
        model(video).last_hidden_state.mean().backward()
    else:
        with torch.inference_mode():
            model(video)
    seconds = time.perf_counter() - start
    total = meter.peak() - base

    blocks = []
    if args.mode == "inference" and not args.no_blocks:  # a second pass, block by block (resets hide the total)
        def pre(module, inputs):
            meter.reset()

        def post(module, inputs, output):
            blocks.append(meter.peak() - base)  # the peak during the block, over the memory before the pass

        handles = [h for layer in model.layers
                   for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))]
        base = meter.reset()
        with torch.inference_mode():
            model(video)
        for handle in handles:
            handle.remove()
    print(json.dumps({"peak_mib": total, "blocks_mib": blocks, "seconds": seconds,
                      "attention": model.config._attn_implementation}))


def measure(name: str, mode: str) -> dict:
    arguments, skip = [], False
    for a in sys.argv[1:]:  # everything but --json (and its value)
        if skip or a.startswith("--json"):
            skip = a == "--json"
            continue
        arguments.append(a)
    command = [sys.executable, "-m", __spec__.name, *arguments, "--child", name, "--mode", mode]
    # glibc: every allocation of 64 KiB or more gets its own mapping, returned to the system when freed, so that the
    # resident set follows the live tensors (otherwise freed heap, e.g. the fp32 weights int8 replaces, is reused
    # without showing up as growth)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{name} ({mode}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def activation_rows(config: TestaVisionConfig, attention: str) -> list[str]:
    """Per block: tokens and the size (MiB, fp32, batch 1) of the largest tensors."""
    frames, patches = config.num_frames, config.num_patches_per_frame
    hidden, heads = config.hidden_size, config.num_attention_heads
    size = lambda n: 4 * n / MiB  # noqa: E731
    materialised = attention == "eager"
    rows = []
    for index, (frames_out, patches_out) in enumerate(token_schedule(config)):
        temporal_tokens = frames * patches
        spatial_tokens = frames_out * (patches + 1)
        mlp_tokens = 1 + frames_out * patches_out
        temporal_attention = patches * heads * frames**2
        spatial_attention = frames_out * heads * (patches + 1) ** 2
        rows.append(
            f"| {index} | {frames}x{patches} -> {frames_out}x{patches} -> {frames_out}x{patches_out} | "
            f"{temporal_tokens} / {spatial_tokens} / {mlp_tokens} | {size(temporal_tokens * hidden):.0f} | "
            f"{size(3 * max(temporal_tokens, spatial_tokens) * hidden):.0f} | {size(mlp_tokens * config.intermediate_size):.0f} | "
            f"{size(temporal_attention):.0f} / {size(spatial_attention):.0f}"
            f"{'' if materialised else ' (not materialised)'} |"
        )
        frames, patches = frames_out, patches_out
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_encoder_arguments(parser, frames=96, temporal_reduction=4, spatial_reduction=8)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--train", action="store_true", help="also measure forward + backward (fp32)")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 inference rows")
    parser.add_argument("--no-blocks", action="store_true", help="skip the per-block measurement pass")
    parser.add_argument("--small", action="store_true", help="24 frames, 112 px, 4 layers: a quick look")
    parser.add_argument("--threads", type=int, help="torch threads in the measuring processes (default: PyTorch's)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="inference", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        args.frames, args.image_size, args.layers = 24, 112, 4
    if args.child:
        if args.threads:
            torch.set_num_threads(args.threads)
        child(args)
        return

    runs = [("inference", "fp32")] + ([] if args.no_int8 or args.device != "cpu" else [("inference", "int8")])
    runs += [("train", "fp32")] if args.train else []
    results = {}
    for mode, precision in runs:
        for name in (f"none-{precision}", f"merged-{precision}"):
            results[(mode, name)] = measure(name, mode)
            print(f"{mode} {name}: {results[(mode, name)]['peak_mib']:.0f} MiB", flush=True)

    merged_config = config_of(args, True)
    attention = next(iter(results.values()))["attention"]
    print(f"\n{args.frames} frames, {args.image_size} px, hidden {args.hidden_size}, {args.layers} layers, batch 1, "
          f"{args.device}; R_T={args.temporal_reduction}, R_S={args.spatial_reduction}; attention: {attention}; "
          "one fresh process per row; load average " + "{:.1f} {:.1f} {:.1f}\n".format(*os.getloadavg()))
    print("| pass | precision | no aggregation (MiB) | R_T, R_S aggregation (MiB) | ratio | target <= 70% |")
    print("|---|---|---|---|---|---|")
    for mode, precision in runs:
        none = results[(mode, f"none-{precision}")]["peak_mib"]
        merged = results[(mode, f"merged-{precision}")]["peak_mib"]
        ratio = merged / none
        label = "forward (inference_mode)" if mode == "inference" else "forward + backward"
        print(f"| {label} | {precision} | {none:.0f} | {merged:.0f} | {100 * ratio:.0f}% | "
              f"{'PASS' if ratio <= 0.70 else 'FAIL'} |")

    if not args.no_blocks:
        print("\nMeasured peak during each block of the inference pass (fp32, MiB over the memory before the pass):\n")
        none_blocks = results[("inference", "none-fp32")]["blocks_mib"]
        merged_blocks = results[("inference", "merged-fp32")]["blocks_mib"]
        print("| block | no aggregation | R_T, R_S aggregation |")
        print("|---|---|---|")
        for index, (a, b) in enumerate(zip(none_blocks, merged_blocks)):
            print(f"| {index} | {a:.0f} | {b:.0f} |")

    print(f"\nActivation sizes per block with aggregation (fp32, batch 1; attention: {attention}):\n")
    print("| block | frames x patches: in -> after frame merge -> out | tokens: temporal attn / spatial attn / MLP | "
          "residual stream (MiB) | qkv output (MiB) | MLP hidden (MiB) | attention matrices temporal / spatial (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for row in activation_rows(merged_config, attention):
        print(row)
    print("\nWithout aggregation every block is block 0's size:\n")
    print("| block | frames x patches: in -> after frame merge -> out | tokens: temporal attn / spatial attn / MLP | "
          "residual stream (MiB) | qkv output (MiB) | MLP hidden (MiB) | attention matrices temporal / spatial (MiB) |")
    print("|---|---|---|---|---|---|---|")
    print(activation_rows(config_of(args, False), attention)[0])
    if args.json:
        args.json.write_text(json.dumps({f"{m} {n}": r for (m, n), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
