"""Synthetic checkpoints in the original TESTA layout (key names written out from the original module tree), and
the original TimeSformer forward re-stated in float64, for the converter and parity tests."""

import math

import torch
import torch.nn.functional as F

from .models import DEC, PAD, TEXT_SETTINGS


WIDTH, HEADS, MLP, PATCH, GRID, FRAMES, LAYERS = 32, 4, 64, 8, 4, 3, 2


def original_state(seed: int = 0, task: str = "retrieval") -> dict[str, torch.Tensor]:
    """A synthetic original TESTA state dict: the key names are written out from the original module tree
    (TimeSformer `visual_encoder`, med.py `text_encoder`), with tiny shapes and random values."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=None):
        scale = scale if scale is not None else (1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.2)
        return torch.randn(*shape, generator=g) * scale

    state = {}
    for prefix in ("visual_encoder", "visual_encoder_m") if task == "retrieval" else ("visual_encoder",):
        state[f"{prefix}.cls_token"] = rnd(1, 1, WIDTH, scale=1.0)
        state[f"{prefix}.pos_embed"] = rnd(1, 1 + GRID * GRID, WIDTH, scale=1.0)
        state[f"{prefix}.time_embed"] = rnd(1, FRAMES, WIDTH, scale=1.0)
        state[f"{prefix}.patch_embed.proj.weight"] = rnd(WIDTH, 3, PATCH, PATCH, scale=0.1)
        state[f"{prefix}.patch_embed.proj.bias"] = rnd(WIDTH)
        for i in range(LAYERS):
            b = f"{prefix}.blocks.{i}"
            for norm in ("norm1", "temporal_norm1", "norm2"):
                state[f"{b}.{norm}.weight"] = 1 + rnd(WIDTH)
                state[f"{b}.{norm}.bias"] = rnd(WIDTH)
            for attn in ("attn", "temporal_attn"):
                state[f"{b}.{attn}.qkv.weight"] = rnd(3 * WIDTH, WIDTH)
                state[f"{b}.{attn}.qkv.bias"] = rnd(3 * WIDTH)
                state[f"{b}.{attn}.proj.weight"] = rnd(WIDTH, WIDTH)
                state[f"{b}.{attn}.proj.bias"] = rnd(WIDTH)
            state[f"{b}.temporal_fc.weight"] = rnd(WIDTH, WIDTH)  # non-zero: temporal attention matters
            state[f"{b}.temporal_fc.bias"] = rnd(WIDTH)
            state[f"{b}.mlp.fc1.weight"], state[f"{b}.mlp.fc1.bias"] = rnd(MLP, WIDTH), rnd(MLP)
            state[f"{b}.mlp.fc2.weight"], state[f"{b}.mlp.fc2.bias"] = rnd(WIDTH, MLP), rnd(WIDTH)
        state[f"{prefix}.norm.weight"], state[f"{prefix}.norm.bias"] = 1 + rnd(WIDTH), rnd(WIDTH)
    text_prefixes = ("text_encoder", "text_encoder_m") if task == "retrieval" else ("text_encoder", "text_decoder.bert")
    for prefix in text_prefixes:
        state[f"{prefix}.embeddings.position_ids"] = torch.arange(64)[None]
        state[f"{prefix}.embeddings.word_embeddings.weight"] = rnd(TEXT_SETTINGS["vocab_size"], WIDTH, scale=1.0)
        state[f"{prefix}.embeddings.position_embeddings.weight"] = rnd(64, WIDTH, scale=1.0)
        state[f"{prefix}.embeddings.LayerNorm.weight"] = 1 + rnd(WIDTH)
        state[f"{prefix}.embeddings.LayerNorm.bias"] = rnd(WIDTH)
        for i in range(LAYERS):
            layer = f"{prefix}.encoder.layer.{i}"
            for attn in ("attention", "crossattention"):
                for proj in ("query", "key", "value"):
                    state[f"{layer}.{attn}.self.{proj}.weight"] = rnd(WIDTH, WIDTH)
                    state[f"{layer}.{attn}.self.{proj}.bias"] = rnd(WIDTH)
                state[f"{layer}.{attn}.output.dense.weight"] = rnd(WIDTH, WIDTH)
                state[f"{layer}.{attn}.output.dense.bias"] = rnd(WIDTH)
                state[f"{layer}.{attn}.output.LayerNorm.weight"] = 1 + rnd(WIDTH)
                state[f"{layer}.{attn}.output.LayerNorm.bias"] = rnd(WIDTH)
            state[f"{layer}.intermediate.dense.weight"], state[f"{layer}.intermediate.dense.bias"] = rnd(MLP, WIDTH), rnd(MLP)
            state[f"{layer}.output.dense.weight"], state[f"{layer}.output.dense.bias"] = rnd(WIDTH, MLP), rnd(WIDTH)
            state[f"{layer}.output.LayerNorm.weight"], state[f"{layer}.output.LayerNorm.bias"] = 1 + rnd(WIDTH), rnd(WIDTH)
    if task == "retrieval":
        for name in ("vision_proj", "text_proj", "vision_proj_m", "text_proj_m"):
            state[f"{name}.weight"], state[f"{name}.bias"] = rnd(16, WIDTH), rnd(16)
        state["itm_head.weight"], state["itm_head.bias"] = rnd(2, WIDTH), rnd(2)
        state["temp"] = torch.tensor(0.05)
        state["image_queue"], state["text_queue"] = rnd(16, 8), rnd(16, 8)
        state["idx_queue"], state["ptr_queue"] = torch.full((1, 8), -100), torch.zeros(1, dtype=torch.long)
        # What the original `load_checkpoint` leaves behind when given a TESTA checkpoint:
        state["visual_encoder.blocks.0.temporal_temporal_attn.qkv.weight"] = rnd(3 * WIDTH, WIDTH)
    else:
        state["text_decoder.cls.predictions.bias"] = rnd(TEXT_SETTINGS["vocab_size"])
        state["text_decoder.cls.predictions.transform.dense.weight"] = rnd(WIDTH, WIDTH)
        state["text_decoder.cls.predictions.transform.dense.bias"] = rnd(WIDTH)
        state["text_decoder.cls.predictions.transform.LayerNorm.weight"] = 1 + rnd(WIDTH)
        state["text_decoder.cls.predictions.transform.LayerNorm.bias"] = rnd(WIDTH)
        state["text_decoder.cls.predictions.decoder.weight"] = state["text_decoder.bert.embeddings.word_embeddings.weight"]
        state["text_decoder.cls.predictions.decoder.bias"] = state["text_decoder.cls.predictions.bias"]
    return state


def original_config(**overrides) -> dict:
    config = dict(num_frames=FRAMES, image_size=GRID * PATCH, testa_r=[1, 3, 0, 2], merging_type="frame&patch",
                  token_merging=True, num_heads=HEADS, queue_size=8, alpha=0.4, k_test=16, negative_all_rank=True,
                  learnable_temporal_scaling=False)
    config.update(overrides)
    return config


TEXT_OVERRIDES = dict(num_attention_heads=HEADS, bos_token_id=DEC, sep_token_id=102, pad_token_id=PAD)


def reference_timesformer(state: dict, video: torch.Tensor) -> torch.Tensor:
    """The original TimeSformer divided space-time forward (no merging), written from the notes with the original
    key names, in float64. Returns ``[CLS, patch tokens]`` in the original ``(l t)`` (patch-major) order."""
    s = {k[len("visual_encoder."):]: v.double() for k, v in state.items() if k.startswith("visual_encoder.")}
    b, t = video.shape[:2]
    d, heads = WIDTH, HEADS

    def ln(x, name):
        return F.layer_norm(x, (d,), s[f"{name}.weight"], s[f"{name}.bias"], eps=1e-6)

    def attention(x, name):
        n, length = x.shape[:2]
        qkv = F.linear(x, s[f"{name}.qkv.weight"], s[f"{name}.qkv.bias"]).view(n, length, 3, heads, d // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) * (d // heads) ** -0.5).softmax(-1)
        out = (weights @ v).transpose(1, 2).reshape(n, length, d)
        return F.linear(out, s[f"{name}.proj.weight"], s[f"{name}.proj.bias"])

    frames = video.double().flatten(0, 1)
    x = F.conv2d(frames, s["patch_embed.proj.weight"], s["patch_embed.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([s["cls_token"].expand(b * t, -1, -1), x], 1) + s["pos_embed"]
    cls = x[:b, :1]
    patches = x[:, 1:].reshape(b, t, GRID * GRID, d).transpose(1, 2) + s["time_embed"][:, None]  # (b, l, t, d)
    length = GRID * GRID
    x = torch.cat([cls, patches.reshape(b, length * t, d)], 1)  # 'b (l t) d'
    for i in range(LAYERS):
        blk = f"blocks.{i}"
        xt = x[:, 1:].reshape(b * length, t, d)
        res_t = attention(ln(xt, f"{blk}.temporal_norm1"), f"{blk}.temporal_attn").reshape(b, length * t, d)
        xt = x[:, 1:] + F.linear(res_t, s[f"{blk}.temporal_fc.weight"], s[f"{blk}.temporal_fc.bias"])
        init_cls = x[:, :1]
        xs = xt.reshape(b, length, t, d).transpose(1, 2).reshape(b * t, length, d)
        xs = torch.cat([init_cls.repeat_interleave(t, 0), xs], 1)
        res_s = attention(ln(xs, f"{blk}.norm1"), f"{blk}.attn")
        cls_res = res_s[:, :1].reshape(b, t, d).mean(1, keepdim=True)
        res_s = res_s[:, 1:].reshape(b, t, length, d).transpose(1, 2).reshape(b, length * t, d)
        x = torch.cat([init_cls, xt], 1) + torch.cat([cls_res, res_s], 1)
        h = F.gelu(F.linear(ln(x, f"{blk}.norm2"), s[f"{blk}.mlp.fc1.weight"], s[f"{blk}.mlp.fc1.bias"]))
        x = x + F.linear(h, s[f"{blk}.mlp.fc2.weight"], s[f"{blk}.mlp.fc2.bias"])
    return ln(x, "norm")
