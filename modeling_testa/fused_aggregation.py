"""Fused GPU kernels (Triton) for the geometry matching and its merge: one launch each per matching.

On a GPU every ATen call is a kernel launch and some microseconds of host time, and the matching and merge of
:mod:`.aggregation` take 22 of them per matching (10 to decide, 12 to merge): 540 per batch-1 forward of ViT-B at 32
frames, where the whole unmerged encoder launches 273 (``python -m benchmarks.merge_kernels``). Here the same work is
two kernels per matching:

* :func:`geometry_pairs`: normalises the keys, computes the cosines of set A (even tokens) against set B (odd
  tokens) divided by the score grid and rounded to whole grid steps, picks every A token's first best partner, ranks
  the A tokens (stable: among equal scores the lower index merges first) and writes the three index tensors of a
  :class:`.aggregation.Bipartite` (unmerged A ascending, sources most similar first, their partners). One program per
  matched sequence (a frame's patches, or a video's frames).
* :func:`merge_pairs`: writes the merged tokens and their sizes in one pass, ``[protected, unmerged A, B]``: copied
  rows are exact copies, and every B row that receives sources becomes ``x_t + sum_j (x_j - x_t) s_j / S_t`` over its
  sources j in rank order (``S_t``: the summed size), computed in fp32. Sizes travel with the features (the same
  program writes both), and no index the size of the hidden states exists.

They take the decisions and compute the outputs of :func:`.aggregation.geometry_matching` and
:func:`.aggregation.merge_bipartite` with other roundings: the cosines are summed in another order (a decision can
differ only for a pair whose score sits within about 1e-4 grid steps of a rounding boundary, as between any two
runtimes; with TF32 matrix products allowed, the PyTorch path's own cosines move by far more), and a merged row is
computed in fp32 and rounded once where the PyTorch path rounds each step to the model's dtype (bf16: within one
bf16 step, at the features' magnitude, of it; itself within half a bf16 step of the exact average).
`tests/test_fused_aggregation.py` checks both against the PyTorch path, through Triton's interpreter, which runs the
argmax's combine function as numpy's first-maximum argmax: the compiled combine (`_argmax_combine_tie_break_left`) is
trusted to break ties the same way, and the once-per-device check (`aggregation.check_fused_kernels`, exact ties
included) verifies it on the GPU before use.

**When they run** is an option of the runtime that runs the encoder (``optimize_for_inference(model,
fused_kernels=...)``, one of :data:`FUSED_KERNELS`; a model without a runtime uses ``"auto"``), handed down to the
blocks, which ask :func:`uses_fused_kernels`: with ``"auto"``, for CUDA tensors at inference (no autograd: training
keeps the PyTorch merge and its hand-written backward), when Triton imports, and after the kernels agreed once per
device with the PyTorch path (:func:`check_fused_kernels`). On the CPU they run only through Triton's interpreter
(``"interpret"``), which is how the tests and ``benchmarks.merge_kernels --fused`` run the very same kernel code
without a GPU. Nothing here is a process-wide switch.
"""

import importlib
import math
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from .aggregation import (
    DEFAULT_SCORE_GRID,
    Bipartite,
    Matching,
    differentiable,
    exporting,
    geometry_matching,
    merge_bipartite,
    shift_protected,
)


FUSED_KERNELS = ("auto", "off", "interpret")
"""The values of the ``fused_kernels`` option: ``"auto"`` (CUDA tensors at inference, when Triton imports and the
kernels agreed with the PyTorch path on this device), ``"off"`` (never: the PyTorch path everywhere) or
``"interpret"`` (also CPU tensors, through Triton's interpreter: slow, for tests and kernel counts)."""

MAX_SCORE_TILE = 128 * 128
"""The largest ``A x B`` score block one matching program holds (both sides padded to a power of two): ViT-B/16 at
224 px (99 x 98 patches per frame) fits; larger matchings (448 px: 393 x 392) take the PyTorch path."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Feature dtypes the merge kernel takes (it computes in fp32; fp64 models take the PyTorch path)."""

try:  # comes with PyTorch's CUDA wheels (and is imported by PyTorch itself); CPU-only wheels lack it
    import triton.language as tl
except ImportError:
    tl = None
constexpr = tl.constexpr if tl is not None else None  # the kernels' compile-time parameters
_build_lock = threading.Lock()
_kernels: dict[bool, tuple] = {}  # interpreted or not -> (pairs kernel, merge kernel), decorated on first use
launches = 0
"""Fused kernel launches so far in this process (what ``benchmarks.merge_kernels --fused`` counts)."""
_checked: dict[str, bool] = {}  # CUDA device -> whether the kernels agreed with the PyTorch path there (a fact, kept)
_check_lock = threading.Lock()


def check_option(fused_kernels: str) -> str:
    """``fused_kernels`` itself; raises a ValueError naming the option and the allowed values for any other."""
    if fused_kernels not in FUSED_KERNELS:
        raise ValueError(f"fused_kernels={fused_kernels!r} is not allowed; use one of "
                         f"{', '.join(map(repr, FUSED_KERNELS))}.")
    return fused_kernels


def triton_available() -> bool:
    """Whether Triton imports (it comes with PyTorch's CUDA wheels; CPU-only wheels lack it)."""
    return tl is not None


# The kernels' Python sources, decorated by `_build` on first use: Triton chooses its interpreter when a function is
# decorated. They reduce with `triton.language.standard`'s own combine functions rather than `tl.sum`/`tl.argmax`:
# those are jit functions that PyTorch's import of Triton decorated uninterpreted, which the interpreter cannot call,
# while it runs these combine functions as numpy reductions (and compiled, they are what `tl.sum`/`tl.argmax` run).


def _pairs_kernel_source(
    metric_ptr, unmerged_ptr, sources_ptr, partners_ptr,
    stride_row, stride_token, stride_channel,
    num_a, num_b, channels, r, first, scale,
    SNAP: constexpr, BLOCK_A: constexpr, BLOCK_B: constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = metric_ptr + row * stride_row
    a = tl.arange(0, BLOCK_A)
    b = tl.arange(0, BLOCK_B)
    a_valid = a < num_a
    b_valid = b < num_b
    a_rows = base + (2 * a).to(tl.int64) * stride_token  # set A: even tokens
    b_rows = base + (2 * b + 1).to(tl.int64) * stride_token  # set B: odd tokens
    a_squares = tl.full([BLOCK_A], 0.0, tl.float32)
    b_squares = tl.full([BLOCK_B], 0.0, tl.float32)
    for c in range(channels):
        xa = tl.load(a_rows + c * stride_channel, mask=a_valid, other=0.0).to(tl.float32)
        xb = tl.load(b_rows + c * stride_channel, mask=b_valid, other=0.0).to(tl.float32)
        a_squares += xa * xa
        b_squares += xb * xb
    # x / max(|x|, 1e-12), as the PyTorch path normalises (IEEE square root and division)
    a_norms = tl.maximum(tl.sqrt_rn(a_squares), 1e-12)
    b_norms = tl.maximum(tl.sqrt_rn(b_squares), 1e-12)
    scores = tl.full([BLOCK_A, BLOCK_B], 0.0, tl.float32)
    for c in range(channels):
        ua = tl.div_rn(tl.load(a_rows + c * stride_channel, mask=a_valid, other=0.0).to(tl.float32), a_norms)
        ub = tl.div_rn(tl.load(b_rows + c * stride_channel, mask=b_valid, other=0.0).to(tl.float32), b_norms)
        scores += ua[:, None] * ub[None, :]
    scores = scores * scale  # 1 / grid, a power of two: exact
    if SNAP:  # torch.round (ties to even) in operations the interpreter has too; v - floor(v) is exact here
        low = tl.floor(scores)
        fraction = scores - low
        odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
        scores = tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), low + 1.0, low)
    # NaN (keys with inf or NaN) ranks above every score, as in torch's argmax and descending sort: the ranks stay a
    # permutation, so every index slot is written
    scores = tl.where(scores != scores, float("inf"), scores)
    scores = tl.where(b_valid[None, :], scores, -float("inf"))
    columns = b[None, :] + tl.full([BLOCK_A, BLOCK_B], 0, tl.int32)
    best, partner = tl.reduce((scores, columns), 1, tl.standard._argmax_combine_tie_break_left)  # ties: lowest
    # Rank of every A token in a stable descending sort of the best scores (the protected one left out).
    rankable = a_valid & (a >= first)
    before = (best[None, :] > best[:, None]) | ((best[None, :] == best[:, None]) & (a[None, :] < a[:, None]))
    rank = tl.reduce((before & rankable[None, :]).to(tl.int32), 1, tl.standard._sum_combine)
    is_source = rankable & (rank < r)
    index = (a - first).to(tl.int64)
    tl.store(sources_ptr + row * r + rank, index, mask=is_source)
    tl.store(partners_ptr + row * r + rank, partner.to(tl.int64), mask=is_source)
    stays = (rankable & (rank >= r)).to(tl.int32)
    slot = tl.associative_scan(stays, 0, tl.standard._sum_combine) - stays  # unmerged A tokens in ascending order
    tl.store(unmerged_ptr + row * (num_a - first - r) + slot, index, mask=stays == 1)


def _merge_kernel_source(
    x_ptr, size_ptr, unmerged_ptr, sources_ptr, partners_ptr, out_ptr, out_size_ptr,
    x_row, x_token, x_position, x_depth, size_row, size_token, size_position,
    num_out, depth, features, r, kept_a, protected, a_start, b_start,
    ROUND_BF16: constexpr, BLOCK_O: constexpr, BLOCK_F: constexpr,
):
    # x is (rows, tokens, positions, depth) and size (rows, tokens, positions), any strides; feature f of a token is
    # (position f // depth, channel f % depth). The outputs are contiguous (rows, num_out, positions[, depth]).
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    f = tl.program_id(2) * BLOCK_F + tl.arange(0, BLOCK_F)
    o_valid = o < num_out
    f_valid = f < features
    in_a = (o >= protected) & (o < protected + kept_a)
    in_b = o_valid & (o >= protected + kept_a)
    t = o - protected - kept_a  # the B index of a B output
    u = tl.load(unmerged_ptr + row * kept_a + (o - protected), mask=in_a & o_valid, other=0)
    token = tl.where(in_a, a_start + 2 * u, tl.where(in_b, b_start + 2 * t, o)).to(tl.int64)
    position = (f // depth).to(tl.int64)  # every feature's size: one per patch position
    x_feature = position * x_position + (f % depth).to(tl.int64) * x_depth
    valid = o_valid[:, None] & f_valid[None, :]
    x_rows = x_ptr + row * x_row
    size_rows = size_ptr + row * size_row + position * size_position
    value = tl.load(x_rows + token[:, None] * x_token + x_feature[None, :], mask=valid, other=0.0).to(tl.float32)
    total = tl.load(size_rows[None, :] + token[:, None] * size_token, mask=valid, other=0.0)
    for j in range(r):  # the target's new size: its own plus its sources', in rank order
        partner = tl.load(partners_ptr + row * r + j)
        source = (a_start + 2 * tl.load(sources_ptr + row * r + j)).to(tl.int64)
        hit = in_b & (t == partner)
        source_size = tl.load(size_rows + source * size_token, mask=f_valid, other=0.0)
        total = tl.where(hit[:, None], total + source_size[None, :], total)
    merged = value
    for j in range(r):  # x_t + sum_j (x_j - x_t) s_j / S_t, the sources in rank order
        partner = tl.load(partners_ptr + row * r + j)
        source = (a_start + 2 * tl.load(sources_ptr + row * r + j)).to(tl.int64)
        hit = in_b & (t == partner)
        source_size = tl.load(size_rows + source * size_token, mask=f_valid, other=0.0)
        source_row = tl.load(x_rows + source * x_token + x_feature, mask=f_valid, other=0.0).to(tl.float32)
        merging = hit[:, None] & valid  # the lanes that divide (others: no 0 / 0)
        weight = tl.div_rn(tl.where(merging, source_size[None, :], 0.0), tl.where(merging, total, 1.0))
        merged = tl.where(merging, merged + (source_row[None, :] - value) * weight, merged)
    if ROUND_BF16:  # to the nearest bf16 (ties to even) in integer arithmetic, so that the cast below is exact on
        # every backend (a GPU's cast rounds so too; Triton's interpreter truncates)
        bits = merged.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        merged = tl.where(merged != merged, merged, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    out_rows = row * num_out + o[:, None]
    tl.store(out_ptr + out_rows * features + f[None, :], merged.to(out_ptr.dtype.element_ty), mask=valid)
    first_of_position = (f % depth) == 0  # one feature per position writes its size
    tl.store(out_size_ptr + out_rows * (features // depth) + position[None, :], total,
             mask=valid & first_of_position[None, :])


def _build(interpret: bool) -> tuple:
    """Decorates the kernels, for the GPU or (``interpret``) for Triton's interpreter, once per process."""
    # not an import statement: remote code's import check would then require Triton of every user, CPU-only ones too
    triton = importlib.import_module("triton")

    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(_pairs_kernel_source), triton.jit(_merge_kernel_source)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _kernels_for(device: torch.device) -> tuple:
    """The kernels for ``device``: compiled for CUDA, run by Triton's interpreter for the CPU."""
    interpret = device.type != "cuda"
    with _build_lock:
        if interpret not in _kernels:
            _kernels[interpret] = _build(interpret)
        return _kernels[interpret]


def compile_for_gpu(capability: int = 90) -> dict[str, str]:
    """Compiles both kernels ahead of time for an NVIDIA GPU of compute ``capability`` (80: A100, 90: H100/H200) at
    ViT-B/16's tile sizes, in bf16, and returns their PTX by kernel name. No GPU or driver is needed: it shows that the
    installed Triton takes the kernels (types, loop-carried values, reductions), which its interpreter cannot."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    pairs_kernel, merge_kernel = _build(interpret=False)
    types = dict(metric_ptr="*bf16", x_ptr="*bf16", out_ptr="*bf16", size_ptr="*fp32", out_size_ptr="*fp32",
                 unmerged_ptr="*i64", sources_ptr="*i64", partners_ptr="*i64", scale="fp32")  # the rest: i32
    builds = {"geometry_pairs": (pairs_kernel, dict(SNAP=True, BLOCK_A=128, BLOCK_B=128), 8),
              "merge_pairs": (merge_kernel, dict(ROUND_BF16=True, BLOCK_O=16, BLOCK_F=128), 4)}
    ptx = {}
    for name, (kernel, constants, warps) in builds.items():
        signature = {arg: "constexpr" if arg in constants else types.get(arg, "i32") for arg in kernel.arg_names}
        compiled = triton_compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": warps})
        ptx[name] = compiled.asm["ptx"]
    return ptx


@contextmanager
def _launching(name: str, device: torch.device) -> Iterator[None]:
    """Around a launch: the tensors' GPU as the current one (Triton launches on the current device, whatever device
    the tensors are on), and, only while a profiler records (entering one costs microseconds otherwise), a profiler
    range named ``testa::<kernel>``: GPU traces name the kernel, and ``benchmarks.merge_kernels`` counts launches."""
    on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    named = torch.profiler.record_function(f"testa::{name}") if torch.autograd.profiler._is_profiler_enabled \
        else nullcontext()
    with on_device, named:
        yield


def _block(n: int, cap: int | None = None) -> int:
    block = max(16, 1 << max(0, n - 1).bit_length())
    return block if cap is None else min(block, cap)


def fits(num_tokens: int, r: int = 1, first: int = 0) -> bool:
    """Whether :func:`geometry_pairs` takes a matching of ``num_tokens`` tokens merging ``r`` pairs (``first``: 1
    with a protected first token): it fits one program (:data:`MAX_SCORE_TILE`) and ``0 < r <= nA - first``."""
    num_a = (num_tokens + 1) // 2
    return 0 < r <= num_a - first and _block(num_a) * _block(num_tokens // 2) <= MAX_SCORE_TILE


def geometry_pairs(
    metric: torch.Tensor, r: int, first: int, scale: float, snap: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decisions of :func:`.aggregation.geometry_matching` (``vote_dim=None``) in one kernel.

    Args:
        metric: ``(*batch, N, C)`` keys; ``N``, ``r`` and ``first`` must satisfy :func:`fits`.
        r: pairs to merge, ``0 < r <= nA - first`` (nA = ``(N + 1) // 2``).
        first: 1 to keep A token 0 (the CLS) out of the sources, else 0.
        scale: what the cosines are multiplied by (``1 / grid``, a power of two, or 1 for raw scores).
        snap: round the scaled cosines to whole grid steps before deciding.

    Returns:
        ``(unmerged, sources, partners)``, int64, ``(*batch, nA - first - r)``, ``(*batch, r)``, ``(*batch, r)``: the
        A indices that stay (ascending, counted after the protected token), the A indices merged away (most similar
        first) and the B index each joins.
    """
    global launches
    *batch, num_tokens, channels = metric.shape
    num_a, num_b = (num_tokens + 1) // 2, num_tokens // 2
    if not fits(num_tokens, r, first):
        raise ValueError(f"geometry_pairs: {num_tokens} tokens and r={r} (first={first}) do not fit one program "
                         f"of at most {MAX_SCORE_TILE} scores with 0 < r <= {num_a - first}.")
    rows = metric.reshape(-1, num_tokens, channels)  # a view for the keys of every host
    indices = dict(dtype=torch.long, device=metric.device)
    unmerged = torch.empty(*batch, num_a - first - r, **indices)
    sources = torch.empty(*batch, r, **indices)
    partners = torch.empty(*batch, r, **indices)
    if rows.shape[0] == 0:
        return unmerged, sources, partners
    pairs_kernel, _ = _kernels_for(metric.device)
    with _launching("geometry_pairs", metric.device):
        pairs_kernel[(rows.shape[0],)](
            rows, unmerged, sources, partners, *rows.stride(), num_a, num_b, channels, r, first, float(scale),
            SNAP=bool(snap), BLOCK_A=_block(num_a), BLOCK_B=_block(num_b), num_warps=8,
        )
    launches += 1
    return unmerged, sources, partners


def merge_pairs(x: torch.Tensor, size: torch.Tensor, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.aggregation.merge_bipartite`'s merged tokens and sizes in one kernel (no autograd).

    Args:
        x: ``(*batch, N, *positions, D)`` features (fp32, bf16 or fp16); the token axis is ``len(batch)``, the
            index tensors' last axis. Any strides that view it as ``(rows, N, positions, D)`` (else it is copied).
        size: ``(*batch, N, *positions)`` fp32 sizes: one per position (frames: every patch position of a frame;
            patches: none, ``x`` is ``(*batch, N, D)``).
        pairs: the :class:`.aggregation.Bipartite` to apply (over ``N`` tokens).

    Returns:
        The merged features and sizes, contiguous, ``N`` replaced by ``protected + nA_unmerged + nB``.
    """
    global launches
    axis = pairs.sources.ndim - 1
    if (x.dtype not in FLOAT_DTYPES or size.dtype != torch.float32 or x.shape[:-1] != size.shape
            or x.ndim < axis + 2 or x.shape[axis] != pairs.num_tokens or x.shape[:axis] != pairs.sources.shape[:-1]):
        raise ValueError(f"merge_pairs takes {FLOAT_DTYPES} features (*batch, N, *positions, D) and fp32 sizes of "
                         f"their shape without D, for a matching over N = {pairs.num_tokens} tokens with batch "
                         f"{tuple(pairs.sources.shape[:-1])}; got x {x.dtype} {tuple(x.shape)}, size {size.dtype} "
                         f"{tuple(size.shape)}.")
    rows, num_tokens, depth = math.prod(x.shape[:axis]), x.shape[axis], x.shape[-1]
    positions = math.prod(size.shape[axis + 1:])
    unmerged, sources, partners = (t if t.is_contiguous() else t.contiguous()
                                   for t in (pairs.unmerged, pairs.sources, pairs.partners))
    kept_a, r = unmerged.shape[-1], sources.shape[-1]
    num_out = pairs.protected + kept_a + len(range(pairs.b_start, num_tokens, 2))
    merged = x.new_empty(*x.shape[:axis], num_out, *x.shape[axis + 1:])
    new_size = size.new_empty(*size.shape[:axis], num_out, *size.shape[axis + 1:])
    if rows == 0 or num_out == 0 or positions == 0:
        return merged, new_size
    if depth == 0:
        raise ValueError(f"merge_pairs: the features of x {tuple(x.shape)} are empty (D = 0).")
    # views where the strides allow (the block's layouts do), copies otherwise
    x4, size3 = x.reshape(rows, num_tokens, positions, depth), size.reshape(rows, num_tokens, positions)
    _, merge_kernel = _kernels_for(x.device)
    features = positions * depth
    block_o, block_f = _block(num_out, 16), _block(features, 128)
    grid = (rows, -(-num_out // block_o), -(-features // block_f))
    with _launching("merge_pairs", x.device):
        merge_kernel[grid](
            x4, size3, unmerged, sources, partners, merged, new_size, *x4.stride(), *size3.stride(),
            num_out, depth, features, r, kept_a, pairs.protected, pairs.a_start, pairs.b_start,
            ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_O=block_o, BLOCK_F=block_f, num_warps=4,
        )
    launches += 1
    return merged, new_size


# ----------------------------------------------------------------------------------------------------------------------
# When they run, and the check before they do
# ----------------------------------------------------------------------------------------------------------------------


def uses_fused_kernels(x: torch.Tensor, fused_kernels: str = "auto") -> bool:
    """Whether the geometry matching and merge of ``x`` run as the fused kernels, under the runtime's
    ``fused_kernels`` option (:data:`FUSED_KERNELS`).

    ``"auto"``: for CUDA tensors, when Triton imports, and once the kernels have agreed with the PyTorch path on this
    device (:func:`check_fused_kernels`, run on first use, outside CUDA-graph capture; if they disagree or fail to
    build, a warning says so and the PyTorch path is used). ``"interpret"`` also takes CPU tensors, through Triton's
    interpreter; ``"off"``: never. Never while ``torch.compile`` or an exporter traces the model: those get the plain
    ATen ops. (The merge also stays PyTorch's under autograd: :func:`merges`.)"""
    if check_option(fused_kernels) == "off" or (x.device.type != "cuda" and fused_kernels != "interpret"):
        return False  # the CPU's calls end here, cheaply
    if not triton_available() or torch.compiler.is_compiling() or exporting():
        return False
    if x.device.type != "cuda":
        return True  # "interpret"
    device = str(x.device)
    if device not in _checked:
        if torch.cuda.is_current_stream_capturing():  # a check would synchronise: the PyTorch path until then
            return False
        with _check_lock:  # one check per device, however many threads start at once
            if device not in _checked:
                _checked[device] = check_fused_kernels(x.device)
    return _checked[device]


def fused_bipartite(metric: torch.Tensor, r: int, first: int, score_grid: float) -> Bipartite:
    """:func:`.aggregation.geometry_matching`'s decisions (``vote_dim=None``) as one fused kernel
    (:func:`geometry_pairs`)."""
    unmerged, sources, partners = geometry_pairs(metric, r, first, 1.0 / score_grid if score_grid else 1.0,
                                                 snap=bool(score_grid))
    return Bipartite(unmerged, sources, partners, 2 * first, 1, first, metric.shape[-2])


def matches(metric: torch.Tensor, r: int, first: int, fused_kernels: str) -> bool:
    """Whether a geometry matching of ``metric`` (``vote_dim=None``) takes :func:`fused_bipartite`."""
    return (uses_fused_kernels(metric, fused_kernels) and metric.dtype in FLOAT_DTYPES
            and fits(metric.shape[-2], r, first))


def merges(x: torch.Tensor, size: torch.Tensor, fused_kernels: str) -> bool:
    """Whether a geometry matching is applied to ``x`` by :func:`merge_pairs` (what the kernel takes; it checks the
    shapes against the matching and names a mismatch): not under autograd, where training keeps the PyTorch merge
    and its hand-written backward (the decisions are fused there too)."""
    return (uses_fused_kernels(x, fused_kernels) and not differentiable(x) and x.dtype in FLOAT_DTYPES
            and size.dtype == torch.float32 and x.numel() > 0)


def check_fused_kernels(device: torch.device | str, warn: bool = True) -> bool:
    """Runs the fused kernels against the PyTorch path on ``device``, at the tile sizes ViT-B/16 at 224 px uses
    (197 patch tokens, hidden 256 and more), for frames and for patches, in fp32 and bf16, on snapped scores (the
    default grid) and on raw ones.

    The keys are +-1 vectors of 64 channels, so every cosine is exactly ``1 - k / 32`` on any hardware (sums of
    +-1/64), and scaled copies of a few of them, so that many scores tie exactly: the decisions, ties included, must
    be identical. The merged features (random) must be within 1e-5 (fp32) or one bf16 step at their largest magnitude
    (bf16) of the PyTorch path's, the sizes identical. Returns whether all agree; with ``warn``, a disagreement or a
    failure to build is warned about, naming the reason (the caller then takes the PyTorch path). Changes no
    setting, so it is safe while other threads run."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    try:
        signs = torch.randint(0, 2, (6, 64), generator=generator).float() * 2 - 1
        flips = torch.rand(6, 64, generator=generator) < torch.linspace(0, 0.5, 6).unsqueeze(-1)
        directions = torch.where(flips, -signs, signs)  # distinct and tied cosines alike
        pick = torch.randint(0, 6, (1, 2, 197), generator=generator)
        scale = torch.randint(1, 4, (1, 2, 197, 1), generator=generator).float()
        patch_keys = (directions[pick] * scale).to(device)  # [CLS, 196 patches] of 2 frames
        frame_keys = patch_keys[:, 0, :32]  # 32 frames
        cases = (
            (patch_keys, torch.randn(1, 2, 196, 256, generator=generator), 12, 1),  # patches: (B, T, L, D)
            (frame_keys, torch.randn(1, 32, 5, 64, generator=generator), 1, 0),  # frames: (B, T, L, D)
        )
        for grid in (DEFAULT_SCORE_GRID, 0.0):
            for dtype in (torch.float32, torch.bfloat16):
                for keys, features, r, first in cases:
                    x = features.to(device, dtype)
                    size = torch.randint(1, 4, x.shape[:-1], generator=generator).float().to(device)
                    expected = geometry_matching(keys, r, protect_first=bool(first), score_grid=grid).bipartite
                    got = fused_bipartite(keys, r, first, grid)
                    decided = all(torch.equal(getattr(got, name), getattr(expected, name))
                                  for name in ("unmerged", "sources", "partners"))
                    if first:  # the patch tensor has no CLS
                        got, expected = (shift_protected(Matching(bipartite=p)).bipartite for p in (got, expected))
                    expected_x, expected_size = merge_bipartite(x, size, expected)[:2]
                    got_x, got_size = merge_pairs(x, size, got)
                    # bf16: the PyTorch path rounds every step to bf16 (the fused one rounds once): one bf16 step at
                    # the features' largest magnitude
                    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7 * x.abs().max().item()
                    if not (decided and torch.equal(got_size, expected_size)
                            and torch.allclose(got_x.float(), expected_x.float(), rtol=0, atol=tolerance)):
                        raise RuntimeError(f"they disagree with the PyTorch path in {dtype}, score grid {grid} "
                                           f"(decisions identical: {decided})")
    except Exception as error:  # noqa: BLE001 - any failure means: do not use them, and say why
        if warn:
            warnings.warn(f"TESTA's fused merge kernels are not used on {device}: {error}. The PyTorch path is used "
                          "instead (optimize_for_inference(..., fused_kernels='off') skips this check).",
                          stacklevel=2)
        return False
    return True


__all__ = ["FLOAT_DTYPES", "FUSED_KERNELS", "MAX_SCORE_TILE", "check_fused_kernels", "check_option", "compile_for_gpu",
           "fits", "fused_bipartite", "geometry_pairs", "matches", "merge_pairs", "merges", "triton_available",
           "uses_fused_kernels"]
