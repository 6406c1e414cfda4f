"""int8 re-ranking tokens with one scale per token, for collections whose fp16 tokens do not fit (about 1.6 MB per
video at ViT-B and 32 frames in fp16; int8 halves it, plus 4 bytes per token).

A token ``x`` (hidden_size values) is kept as ``round(x / s)`` in int8 with ``s = max|x| / 127`` (a symmetric,
per-token scale: the tokens' norms differ a lot between tokens, so one scale per tensor would waste the range of the
small ones). On disk (a video store with ``token_dtype="int8"``) each token is its codes followed by the 4 bytes of
its float32 scale: ``hidden_size + 4`` bytes. Reading dequantizes to float32. The re-ranking agreement with fp16 is
measured by `benchmarks/int8_tokens.py` (docs/inference.md).
"""

import torch

SCALE_BYTES = 4


def quantize(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 (..., hidden), scales float32 (...))`` of `tokens` (one symmetric scale per token)."""
    values = tokens.detach().float()
    scales = values.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(values / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 tokens `quantize` encoded."""
    return codes.float() * scales.unsqueeze(-1)


def pack(tokens: torch.Tensor) -> torch.Tensor:
    """``(..., hidden + 4)`` uint8: each token's int8 codes, then its float32 scale's bytes (the on-disk row)."""
    codes, scales = quantize(tokens.cpu())
    scale_bytes = scales.contiguous().view(torch.uint8).view(*scales.shape, SCALE_BYTES)
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The float32 tokens of `pack`'s rows."""
    codes = packed[..., :-SCALE_BYTES].contiguous().view(torch.int8)
    scales = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)
    return dequantize(codes, scales)


__all__ = ["SCALE_BYTES", "dequantize", "pack", "quantize", "unpack"]
