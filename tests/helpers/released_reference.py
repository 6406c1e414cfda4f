"""An independent float64 re-statement of the released TESTA video encoder (RenShuhuai-Andy/TESTA @41b9486).

Written from the behaviour documented in ``shared/notes/original-testa-implementation.md`` (sections 1, 2 and 9), not
from our modeling code and not copied from the released code: one video at a time, tokens kept in the released
``[CLS, (position, frame)]`` layout, and every matching decision taken with plain Python loops.

The released rules re-stated here:

* Temporal attention per patch position over the frames (CLS excluded), ``temporal_fc``, residual.
* Frame merge (``R_T``): per patch position, every A frame (even index) finds its most similar B frame (odd index)
  by the cosine of the temporal attention keys averaged over heads. The destination is the most frequent choice over
  positions (ties: smallest index) and the pair score is the most frequent of the positions' best similarities (ties:
  smallest value) -- ``torch.mode`` as it runs on CPU, which for distinct floats is the minimum. The ``R_T`` best A
  frames merge into their destinations (size-weighted, every position with its own size); the output frame order is
  ``[unmerged A (ascending), B]``. The cap is ``(T - 1) // 2``.
* Spatial attention per frame over ``[CLS, patches]``; the CLS outputs are averaged over frames.
* Patch merge (``R_S``) per frame on ``[CLS, patches]`` with CLS never a source; output ``[CLS, unmerged A, B]``.
* MLP and the final LayerNorm.

Only the layout-free parts (LayerNorm, linear layers, softmax attention) use torch ops.
"""

from collections import Counter

import torch
import torch.nn.functional as F


def _mode(values: list) -> object:
    """CPU ``torch.mode``: the most frequent value, ties to the smallest."""
    counts = Counter(values)
    best = max(counts.values())
    return min(v for v, c in counts.items() if c == best)


def _layer_norm(x, state, name, eps):
    return F.layer_norm(x, x.shape[-1:], state[f"{name}.weight"], state[f"{name}.bias"], eps)


def _linear(x, state, name):
    return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]


def _attention(x, state, name, heads):
    """``(N, D)`` -> output ``(N, D)`` and the keys averaged over heads ``(N, D / heads)``."""
    tokens, dim = x.shape
    qkv = _linear(x, state, f"{name}.qkv").view(tokens, 3, heads, dim // heads).permute(1, 2, 0, 3)
    q, k, v = qkv[0], qkv[1], qkv[2]
    probs = ((q @ k.transpose(-1, -2)) * (dim // heads) ** -0.5).softmax(dim=-1)
    out = (probs @ v).transpose(0, 1).reshape(tokens, dim)
    return _linear(out, state, f"{name}.proj"), k.mean(0)


def _cosine(a, b):
    return float(F.normalize(a, dim=-1) @ F.normalize(b, dim=-1))


def _weighted_merge(tokens, sizes, sources, destinations):
    """Size-weighted average of every ``(token, size)`` source into ``tokens[destination]``."""
    sums = [t * s for t, s in zip(tokens, sizes)]
    totals = list(sizes)
    for (source_token, source_size), j in zip(sources, destinations):
        sums[j] = sums[j] + source_token * source_size
        totals[j] = totals[j] + source_size
    return [s / t for s, t in zip(sums, totals)], totals


def _frame_merge(x, sizes, keys, r):
    """x: ``(L, T, D)``, sizes ``(L, T)``, keys ``(L, T, C)`` -> merged x ``(L, T - r, D)`` and sizes."""
    positions, frames, _ = x.shape
    r = min(r, (frames - 1) // 2)
    if r <= 0:
        return x, sizes
    a_frames, b_frames = list(range(0, frames, 2)), list(range(1, frames, 2))
    best_sim = [[None] * len(a_frames) for _ in range(positions)]
    best_idx = [[None] * len(a_frames) for _ in range(positions)]
    for p in range(positions):
        for i, a in enumerate(a_frames):
            sims = [_cosine(keys[p, a], keys[p, b]) for b in b_frames]
            best_idx[p][i] = max(range(len(sims)), key=lambda j: (sims[j], -j))  # first maximum
            best_sim[p][i] = sims[best_idx[p][i]]
    score = [_mode([best_sim[p][i] for p in range(positions)]) for i in range(len(a_frames))]
    destination = [_mode([best_idx[p][i] for p in range(positions)]) for i in range(len(a_frames))]
    order = sorted(range(len(a_frames)), key=lambda i: -score[i])  # stable: the earlier frame first on ties
    merged_a, kept_a = order[:r], sorted(order[r:])
    out_x, out_sizes = [], []
    for p in range(positions):
        b_tokens = [x[p, b] for b in b_frames]
        b_sizes = [sizes[p, b] for b in b_frames]
        sources = [(x[p, a_frames[i]], sizes[p, a_frames[i]]) for i in merged_a]
        merged, merged_sizes = _weighted_merge(b_tokens, b_sizes, sources, [destination[i] for i in merged_a])
        out_x.append(torch.stack([x[p, a_frames[i]] for i in kept_a] + merged))
        out_sizes.append(torch.stack([sizes[p, a_frames[i]] for i in kept_a] + merged_sizes))
    return torch.stack(out_x), torch.stack(out_sizes)


def _patch_merge(frame_tokens, frame_sizes, keys, r):
    """One frame: ``[CLS, patches]`` tokens ``(1 + L, D)``, sizes ``(1 + L,)``, keys ``(1 + L, C)``."""
    n = frame_tokens.shape[0]
    r = min(r, (n - 1) // 2)
    if r <= 0:
        return frame_tokens, frame_sizes
    a_tokens, b_tokens = list(range(0, n, 2)), list(range(1, n, 2))
    score, destination = [], []
    for i, a in enumerate(a_tokens):
        sims = [_cosine(keys[a], keys[b]) for b in b_tokens]
        j = max(range(len(sims)), key=lambda k: (sims[k], -k))
        score.append(-float("inf") if i == 0 else sims[j])  # CLS (A[0]) is never a source
        destination.append(j)
    order = sorted(range(len(a_tokens)), key=lambda i: -score[i])
    merged_a, kept_a = order[:r], sorted(order[r:])
    sources = [(frame_tokens[a_tokens[i]], frame_sizes[a_tokens[i]]) for i in merged_a]
    merged, merged_sizes = _weighted_merge(
        [frame_tokens[b] for b in b_tokens], [frame_sizes[b] for b in b_tokens], sources,
        [destination[i] for i in merged_a],
    )
    tokens = torch.stack([frame_tokens[a_tokens[i]] for i in kept_a] + merged)
    sizes = torch.stack([frame_sizes[a_tokens[i]] for i in kept_a] + merged_sizes)
    return tokens, sizes


def released_encoder(
    state: dict[str, torch.Tensor],
    video: torch.Tensor,
    temporal_reduction: list[int],
    spatial_reduction: list[int],
    heads: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The released encoder's output ``(1 + L' T', D)`` in its ``[CLS, (position, frame)]`` order.

    Args:
        state: the released ``visual_encoder.*`` weights with the prefix removed (``blocks.0.attn.qkv.weight``, ...).
        video: ``(T, 3, H, W)`` one video.
    """
    state = {k: v.double() for k, v in state.items()}
    video = video.double()
    frames = video.shape[0]
    patch = F.conv2d(video, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=state[
        "patch_embed.proj.weight"].shape[-1])
    patch = patch.flatten(2).transpose(1, 2)  # (T, L, D)
    positions = patch.shape[1]
    cls = state["cls_token"][0, 0] + state["pos_embed"][0, 0]
    patch = patch + state["pos_embed"][0, 1:]
    time_embed = state["time_embed"][0]
    if time_embed.shape[0] != frames:
        time_embed = F.interpolate(time_embed.T[None], size=frames, mode="nearest")[0].T
    x = patch.transpose(0, 1) + time_embed  # (L, T, D): the released (position, frame) layout
    sizes = torch.ones(positions, frames, dtype=torch.float64)
    depth = len(temporal_reduction)
    for i in range(depth):
        block = f"blocks.{i}"
        # temporal attention per position
        outs, keys = zip(*(_attention(_layer_norm(x[p], state, f"{block}.temporal_norm1", eps), state,
                                      f"{block}.temporal_attn", heads) for p in range(x.shape[0])))
        x = x + _linear(torch.stack(outs), state, f"{block}.temporal_fc")
        x, sizes = _frame_merge(x, sizes, torch.stack(keys), temporal_reduction[i])
        # spatial attention per frame, CLS averaged over frames
        frames = x.shape[1]
        new_frames, new_sizes = [], []
        frame_inputs = [torch.cat([cls[None], x[:, t]]) for t in range(frames)]
        results = [_attention(_layer_norm(f, state, f"{block}.norm1", eps), state, f"{block}.attn", heads)
                   for f in frame_inputs]
        cls_new = cls + torch.stack([out[0] for out, _ in results]).mean(0)
        for t, (out, key) in enumerate(results):
            tokens = torch.cat([cls_new[None], x[:, t] + out[1:]])
            frame_sizes = torch.cat([torch.ones(1, dtype=torch.float64), sizes[:, t]])
            tokens, frame_sizes = _patch_merge(tokens, frame_sizes, key, spatial_reduction[i])
            new_frames.append(tokens[1:])
            new_sizes.append(frame_sizes[1:])
        x = torch.stack(new_frames, dim=1)  # (L', T, D)
        sizes = torch.stack(new_sizes, dim=1)
        cls = cls_new
        flat = torch.cat([cls[None], x.reshape(-1, x.shape[-1])])
        flat = flat + _linear(F.gelu(_linear(_layer_norm(flat, state, f"{block}.norm2", eps), state,
                                             f"{block}.mlp.fc1")), state, f"{block}.mlp.fc2")
        cls, x = flat[0], flat[1:].view(x.shape)
    return _layer_norm(torch.cat([cls[None], x.reshape(-1, x.shape[-1])]), state, "norm", eps)
