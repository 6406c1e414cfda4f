"""fp32 GEMM speed on this CPU: PyTorch's default `F.linear` against oneDNN's linear with a pre-packed weight.

    python -m benchmarks.gemm_backends [--threads N] [--repeats 5]

The encoder is linear-layer bound (see `encoder_speed.py`), so whether a oneDNN fp32 path would speed up inference
depends on this ratio. The shape is a ViT-B/16 MLP layer over 2048 tokens (2048 x 768 -> 3072). The contenders
alternate in every repeat; medians are printed with GFLOP/s and the ratio to `F.linear`, and the outputs are
compared (the largest absolute difference) so that a faster path computing something else cannot pass unnoticed.
"""

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def contenders(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict:
    """The GEMMs that run on this build; each is called once here, so that one failing is skipped with a message."""
    found = {"F.linear (PyTorch default)": lambda: F.linear(x, weight, bias)}
    if not torch.backends.mkldnn.is_available():
        print("oneDNN (mkldnn) is not available in this PyTorch build")
        return found

    def packed():
        weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
        return lambda: torch.ops.mkldnn._linear_pointwise(x, weight_packed, bias, "none", [], "")

    def mkldnn_tensors():
        x_mkldnn, w_mkldnn, b_mkldnn = x.to_mkldnn(), weight.to_mkldnn(), bias.to_mkldnn()
        # the output is a mkldnn tensor; a drop-in linear has to return a dense one, so the conversion is timed too
        return lambda: torch._C._nn.mkldnn_linear(x_mkldnn, w_mkldnn, b_mkldnn).to_dense()

    for name, make in (("oneDNN linear, packed weight (mkldnn._linear_pointwise)", packed),
                       ("oneDNN linear, mkldnn tensors (mkldnn_linear + to_dense)", mkldnn_tensors)):
        try:
            fn = make()
            fn()
        except (RuntimeError, AttributeError, NotImplementedError) as error:
            print(f"{name}: unavailable ({type(error).__name__}: {error})")
            continue
        found[name] = fn
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, help="torch threads (default: PyTorch's, one per core)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="calls per timing")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokens, width, hidden = 2048, 768, 3072
    x, weight, bias = torch.randn(tokens, width), torch.randn(hidden, width), torch.randn(hidden)
    flop = 2 * tokens * width * hidden
    found = contenders(x, weight, bias)
    reference = F.linear(x, weight, bias)
    times = {name: [] for name in found}
    for fn in found.values():  # warm-up (weight packing, first-call allocations)
        fn(), fn()
    for _ in range(args.repeats):
        for name, fn in found.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"linear {tokens}x{width} -> {hidden}, medians of {args.repeats} x {args.calls} calls\n")
    print("| GEMM | ms per call | GFLOP/s | vs F.linear | max abs difference to F.linear |")
    print("|---|---|---|---|---|")
    base = statistics.median(times["F.linear (PyTorch default)"])
    for name, fn in found.items():
        median = statistics.median(times[name])
        difference = (fn() - reference).abs().max().item()
        print(f"| {name} | {1e3 * median:.1f} | {flop / median / 1e9:.0f} | {base / median:.2f}x | {difference:.1e} |")


if __name__ == "__main__":
    main()
