"""Convert a checkpoint of the original TESTA code (github.com/RenShuhuai-Andy/TESTA) into a TESTA model.

    python -m modeling_testa.convert_original_testa --checkpoint testa_model_base_queryd_f32_f1p12.pth \\
        --output-dir testa-base-queryd-f32 [--task retrieval|qa|pretraining] [--tokenizer DIR]

The original files are ``torch.save({'model': state_dict, 'config': yaml_dict, ...})``; they are read with
``torch.load(weights_only=True)``. The aggregation schedule comes from the config: ``testa_r`` holds one value per
merge call, and with ``merging_type: frame&patch`` every block merges twice (frames, then patches), so the list is
interleaved ``[R_T, R_S] * 12`` (``[1, 12] * 12`` is the paper's 32-frame "f1p12").

Frames are matched with ``frame_matching="original"`` by default: the released code's own rule (majority vote for the
destination, ``torch.mode`` of the positions' best similarities for the pair score, as it runs on CPU), so a converted
checkpoint computes what the released code computes. ``--frame-matching mean|vote`` picks another rule. Whatever the
frame rule, a converted model decides on raw scores (``score_grid=0``): the released code was trained on them, with no
grid (`TestaVisionConfig.score_grid`).

Every checkpoint key is accounted for: mapped to our name, dropped with a stated reason (queues, momentum copies that
`save_pretrained` does not keep, ``temporal_scaling``, the original loader's junk ``temporal_temporal_*`` keys), or
reported as unmapped, which raises unless ``strict=False``.
"""

import argparse
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import BlipTextConfig

from .configuration_testa import FRAME_MATCHINGS, RAW_SCORES, TestaConfig, TestaVisionConfig
from .convert_blip_to_testa import resize_position_embedding, save_processor
from .modeling_testa import TestaForPreTraining, TestaForVideoQA, TestaForVideoTextRetrieval, TestaPreTrainedModel
from .momentum import QUEUE_BUFFERS, legacy_key


logger = logging.getLogger(__name__)

TASKS = {"retrieval": TestaForVideoTextRetrieval, "qa": TestaForVideoQA, "pretraining": TestaForPreTraining}
# The rule the released code merges frames with; see `TestaVisionConfig.frame_matching`.
DEFAULT_FRAME_MATCHING = "original"

# Original block / embedding names -> ours (suffixes after `visual_encoder.`).
_VISION_BLOCK_RENAMES = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "temporal_norm1": "temporal_layer_norm",
    "temporal_attn.qkv": "temporal_attention.qkv",
    "temporal_attn.proj": "temporal_attention.projection",
    "temporal_fc": "temporal_fc",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_RENAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "time_embed": "embeddings.temporal_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_DROPPED = {
    r"(^|\.)(image_queue|text_queue|idx_queue|ptr_queue|queue_ptr)$": "contrastive queue (training state; the original "
    "loader deletes queues too)",
    r"(^|\.)embeddings\.position_ids$": "position-id buffer (recreated by the model)",
    r"\.temporal_temporal_": "junk key written by the original `load_checkpoint` rename (never used)",
}


@dataclass
class ConversionReport:
    """What happened to every key of the original checkpoint."""

    mapped: dict[str, str] = field(default_factory=dict)  # original -> ours
    dropped: dict[str, str] = field(default_factory=dict)  # original -> reason
    unmapped: list[str] = field(default_factory=list)  # original keys with no place in our model
    missing: list[str] = field(default_factory=list)  # our keys the checkpoint did not provide (freshly initialised)
    temporal_reduction: list[int] = field(default_factory=list)
    spatial_reduction: list[int] = field(default_factory=list)
    frame_matching: str = DEFAULT_FRAME_MATCHING

    def summary(self) -> str:
        rule = (
            "the released code's rule, as it runs on CPU" if self.frame_matching == "original"
            else "not the released code's rule: merged frames can differ from the original model's"
        )
        lines = [
            f"mapped {len(self.mapped)} tensors; R_T={self.temporal_reduction} R_S={self.spatial_reduction}",
            f"frame_matching={self.frame_matching!r} ({rule})",
            f"dropped {len(self.dropped)}: " + ", ".join(f"{k} ({v})" for k, v in sorted(self.dropped.items())),
            f"unmapped {len(self.unmapped)}: {self.unmapped}",
            f"missing (fresh init) {len(self.missing)}: {self.missing}",
        ]
        return "\n".join(lines)


def parse_testa_r(
    testa_r: int | list[int], merging_type: str = "frame&patch", num_layers: int = 12, token_merging: bool = True
) -> tuple[list[int], list[int]]:
    """Per-block ``(R_T, R_S)`` from the original ``testa_r``.

    Every merge call pops one value: ``frame&patch`` blocks pop two (frames first), ``frame`` or ``patch`` blocks one.
    A short list is zero-padded (the original ``parse_r``); an int is a constant per-call value.
    """
    if not token_merging:
        return [0] * num_layers, [0] * num_layers
    calls = {"frame&patch": 2, "frame": 1, "patch": 1}.get(merging_type)
    if calls is None:
        raise ValueError(
            f"Unsupported merging_type={merging_type!r}; the converter handles 'frame&patch', 'frame' and 'patch'."
        )
    values = [testa_r] * (calls * num_layers) if isinstance(testa_r, int) else [int(v) for v in testa_r]
    if len(values) > calls * num_layers:
        raise ValueError(
            f"testa_r has {len(values)} entries; {merging_type!r} over {num_layers} blocks uses {calls * num_layers}."
        )
    values += [0] * (calls * num_layers - len(values))
    if merging_type == "frame&patch":
        return values[0::2], values[1::2]
    if merging_type == "frame":
        return values, [0] * num_layers
    return [0] * num_layers, values


def _rename(key: str, vision_prefixes: dict[str, str]) -> str | None:
    """Our name for an original key, or None."""
    for original, ours in vision_prefixes.items():
        if key.startswith(original + "."):
            rest = key[len(original) + 1 :]
            if rest in _VISION_RENAMES:
                return f"{ours}.{_VISION_RENAMES[rest]}"
            match = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", rest)
            if match and match.group(2) in _VISION_BLOCK_RENAMES:
                return f"{ours}.layers.{match.group(1)}.{_VISION_BLOCK_RENAMES[match.group(2)]}.{match.group(3)}"
            return None
    # The text side, the projections, the heads and `temp` keep their names (BERT/BLIP layout); the momentum copies
    # (`text_encoder_m`, `*_proj_m`) live in the head's `momentum` component.
    return legacy_key(key)


def _text_config_from_state(
    state: dict[str, torch.Tensor], prefix: str, encoder_width: int, **overrides
) -> BlipTextConfig:
    """The `BlipTextConfig` of the original med.py BERT, read from the tensor shapes (heads: 64 wide, as BERT)."""
    words = state[f"{prefix}embeddings.word_embeddings.weight"]
    layers = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"encoder\.layer\.(\d+)\.", k))}
    settings = dict(
        vocab_size=words.shape[0],
        hidden_size=words.shape[1],
        num_hidden_layers=max(layers) + 1,
        num_attention_heads=max(words.shape[1] // 64, 1),  # BERT heads are 64 wide
        intermediate_size=state[f"{prefix}encoder.layer.0.intermediate.dense.weight"].shape[0],
        max_position_embeddings=state[f"{prefix}embeddings.position_embeddings.weight"].shape[0],
        encoder_hidden_size=encoder_width,
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        label_smoothing=0.1,
    )
    settings.update(overrides)
    return BlipTextConfig(**settings)


def _infer_task(state: dict[str, torch.Tensor]) -> str:
    has_decoder = any(k.startswith("text_decoder.") for k in state)
    has_itm = "itm_head.weight" in state
    if has_decoder and has_itm:
        return "pretraining"
    return "qa" if has_decoder else "retrieval"


@torch.no_grad()
def convert_original_testa(
    checkpoint: str | Path | dict,
    task: str | None = None,
    num_frames: int | None = None,
    text_config: dict | None = None,
    strict: bool = True,
    frame_matching: str = DEFAULT_FRAME_MATCHING,
    **config_overrides,
) -> tuple[TestaPreTrainedModel, ConversionReport]:
    """Converts an original TESTA checkpoint.

    Args:
        checkpoint: path of the ``.pth`` file, or the loaded dict (``{'model': ..., 'config': ...}``, or a bare state
            dict).
        task: ``"retrieval"``, ``"qa"`` or ``"pretraining"`` (inferred from the keys when omitted).
        num_frames: frames of the temporal embedding (defaults to the config's ``num_frames``, else the checkpoint's);
            resized with nearest interpolation as the original loader does.
        text_config: overrides of the inferred `BlipTextConfig` fields (e.g. ``num_attention_heads``, token ids).
        strict: raise when a checkpoint key has no place in the model.
        frame_matching: ``"original"`` (default: the released code's frame rule, so the converted model computes
            what the released code computes on CPU), ``"vote"`` or ``"mean"``; see `TestaVisionConfig`.
        **config_overrides: `TestaVisionConfig` / `TestaConfig` fields, overriding what the checkpoint says.

    Returns:
        ``(model, report)``.
    """
    source = str(checkpoint) if isinstance(checkpoint, (str, Path)) else "the checkpoint dict"
    if isinstance(checkpoint, (str, Path)):
        if not Path(checkpoint).is_file():
            raise FileNotFoundError(f"Original TESTA checkpoint {source!r} does not exist.")
        checkpoint = load_checkpoint_file(checkpoint)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{source}: expected a checkpoint dict, got {type(checkpoint).__name__}.")
    if frame_matching not in FRAME_MATCHINGS:
        raise ValueError(f"Unknown frame_matching={frame_matching!r}; use one of {FRAME_MATCHINGS}.")
    state = checkpoint.get("model", checkpoint)
    if not isinstance(state, dict):
        raise ValueError(f"{source}: 'model' holds a {type(state).__name__}, not a state dict.")
    original_config = checkpoint.get("config", {}) if "model" in checkpoint else {}
    original_config = dict(original_config or {})
    state = {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}

    vision_keys = [k for k in state if k.startswith("visual_encoder.")]
    if not vision_keys:
        raise ValueError(
            f"{source} has no `visual_encoder.*` tensors, so it is not an original TESTA checkpoint (found e.g. "
            f"{sorted(state)[:5]})."
        )
    required = ("cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.mlp.fc1.weight")
    absent = [f"visual_encoder.{k}" for k in required if f"visual_encoder.{k}" not in state]
    if absent:
        raise ValueError(f"{source} is not an original TESTA checkpoint: it lacks {absent}.")
    if "visual_encoder.time_embed" not in state or not any(".temporal_attn." in k for k in vision_keys):
        raise ValueError(
            f"{source} has an image encoder without `time_embed` / `temporal_attn`: it looks like a BLIP image "
            "checkpoint. Convert it with `modeling_testa.convert_blip_to_testa` instead."
        )
    if not any(k.startswith("text_encoder.") for k in state):
        raise ValueError(f"{source} has no `text_encoder.*` tensors; the converter needs a full TESTA checkpoint.")
    cls_token = state["visual_encoder.cls_token"]
    width = cls_token.shape[-1]
    layers = {int(m.group(1)) for k in vision_keys if (m := re.match(r"visual_encoder\.blocks\.(\d+)\.", k))}
    num_layers = max(layers) + 1
    patch = state["visual_encoder.patch_embed.proj.weight"].shape[-1]
    grid = int((state["visual_encoder.pos_embed"].shape[1] - 1) ** 0.5)
    image_size = int(original_config.get("image_size", grid * patch))
    time_embed = state["visual_encoder.time_embed"]
    frames = num_frames or int(original_config.get("num_frames", time_embed.shape[1]))
    r_t, r_s = parse_testa_r(
        original_config.get("testa_r", 0),
        original_config.get("merging_type", "frame&patch"),
        num_layers,
        bool(original_config.get("token_merging", "testa_r" in original_config)),
    )
    vision_fields = set(TestaVisionConfig.__dataclass_fields__)
    vision_settings = dict(
        num_frames=frames,
        image_size=image_size,
        patch_size=patch,
        hidden_size=width,
        num_hidden_layers=num_layers,
        num_attention_heads=int(original_config.get("num_heads", max(width // 64, 1))),
        intermediate_size=state["visual_encoder.blocks.0.mlp.fc1.weight"].shape[0],
        layer_norm_eps=1e-6,
        temporal_reduction=r_t,
        spatial_reduction=r_s,
        frame_matching=frame_matching,
        score_grid=RAW_SCORES,  # the released code decides every merge on raw scores
    )
    vision_settings.update({k: config_overrides.pop(k) for k in list(config_overrides) if k in vision_fields})
    vision_config = TestaVisionConfig(**vision_settings)
    text = _text_config_from_state(state, "text_encoder.", width, **(text_config or {}))
    task = task or _infer_task(state)
    if task not in TASKS:
        raise ValueError(f"Unknown task={task!r}; use one of {sorted(TASKS)}.")
    head_settings = {
        k: original_config[k] for k in ("queue_size", "alpha", "k_test", "negative_all_rank") if k in original_config
    }
    if "vision_proj.weight" in state:
        head_settings["projection_dim"] = state["vision_proj.weight"].shape[0]
    head_settings.update(config_overrides)
    head_settings.setdefault("dec_token_id", text.bos_token_id if text.bos_token_id is not None else 30522)
    config = TestaConfig(vision_config=vision_config, text_config=text, **head_settings)
    model = TASKS[task](config)
    ours = model.state_dict()

    report = ConversionReport(
        temporal_reduction=r_t, spatial_reduction=r_s, frame_matching=vision_config.frame_matching
    )
    vision_prefixes = {"visual_encoder": "vision_model", "visual_encoder_m": "momentum.vision_model"}
    new_state: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        reason = next((why for pattern, why in _DROPPED.items() if re.search(pattern, key)), None)
        if reason is None and re.search(r"\.temporal_scaling$", key):
            unused_scaling = not original_config.get("learnable_temporal_scaling", False)
            reason = (
                "learnable_temporal_scaling is off in this checkpoint's config (the original model ignores it too)"
                if unused_scaling
                else "learnable temporal scaling is not supported; the original fine-tuning configs drop it as well"
            )
            if not unused_scaling and value.abs().max() > 0:
                logger.warning("Dropping %s, which the original pre-training model used (max |value| %.3g).", key,
                               float(value.abs().max()))
        if reason is not None:
            report.dropped[key] = reason
            continue
        name = _rename(key, vision_prefixes)
        if name is None or name not in ours:
            report.unmapped.append(key)
            continue
        if name.endswith("embeddings.position_embedding") and name.startswith("vision_model"):
            value = resize_position_embedding(value, image_size // patch)
        elif name.endswith("embeddings.temporal_embedding") and value.shape[1] != frames:
            value = F.interpolate(value.float().transpose(1, 2), size=frames, mode="nearest").transpose(1, 2)
        if value.shape != ours[name].shape:
            raise ValueError(f"{key} has shape {tuple(value.shape)} but {name} needs {tuple(ours[name].shape)}.")
        new_state[name] = value.to(ours[name].dtype)
        report.mapped[key] = name

    if report.unmapped and strict:
        raise ValueError(
            f"{len(report.unmapped)} checkpoint keys have no place in {type(model).__name__}: {report.unmapped}. "
            "Pick another `task`, or pass strict=False to drop them (they are listed in the report)."
        )
    missing, unexpected = model.load_state_dict(new_state, strict=False)
    # Keys filled through sharing (encoder/decoder modules, the tied LM head) are not missing.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[name]) for name in new_state if name in params}
    training_state = tuple(f"momentum.{name}" for name in QUEUE_BUFFERS)
    report.missing = sorted(
        name
        for name in missing
        if not (name in params and id(params[name]) in loaded)
        and name not in training_state
        and not name.endswith("position_ids")
    )
    if unexpected:
        raise RuntimeError(f"Conversion bug, unexpected keys: {unexpected}")
    if any(k.startswith("momentum.vision_model.") for k in new_state) and not any(
        n.startswith("momentum.") for n in report.missing
    ):
        model.momentum.initialized.fill_(True)  # the checkpoint's own momentum encoder (kept in memory only)
    if report.missing:
        logger.warning("Not in the checkpoint (freshly initialised): %s", report.missing)
    return model.eval(), report


TORCH_SAVE_SIGNATURES = (b"PK\x03\x04", b"\x80")
"""How a file written by `torch.save` begins: a zip archive (the default since PyTorch 1.6) or a pickle."""


def load_checkpoint_file(path: str | Path) -> Any:
    """The contents of a ``.pth`` file, read with ``torch.load(weights_only=True)`` (no code runs). Raises a
    one-line `ValueError` naming the file and what was expected: a file that `torch.save` did not write (e.g. text
    renamed ``.pth``), or one holding objects other than tensors and plain values (without torch's advice to load
    it with ``weights_only=False``, which would run the file's code)."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not head.startswith(TORCH_SAVE_SIGNATURES):
        raise ValueError(f"{str(path)!r} is not a PyTorch checkpoint: expected a file written by torch.save (a zip "
                         f"archive or a pickle), but it begins with {head!r}.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling refused something that is not a tensor / plain container
        message = str(error)
        reason = message.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in message else \
            message.splitlines()[0] if message.strip() else type(error).__name__
        reason = " ".join(reason.split()).split(" Check the documentation")[0]
        raise ValueError(f"{str(path)!r} cannot be read as tensors and plain values (torch.load with "
                         f"weights_only=True: {reason}): expected an original TESTA checkpoint; re-save its state "
                         "dict with torch.save.") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="original .pth file")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--task", choices=sorted(TASKS), default=None, help="default: inferred from the keys")
    parser.add_argument("--num-frames", type=int, default=None, help="default: the checkpoint config's num_frames")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder/Hub id for the saved processor (default: the package's)"
    )
    parser.add_argument("--no-strict", action="store_true", help="drop unmapped keys instead of raising")
    parser.add_argument(
        "--frame-matching", choices=FRAME_MATCHINGS, default=DEFAULT_FRAME_MATCHING,
        help="how frames are matched (default: 'original', the released code's rule, for parity with it)",
    )
    args = parser.parse_args(argv)
    try:
        model, report = convert_original_testa(
            args.checkpoint, args.task, args.num_frames, strict=not args.no_strict, frame_matching=args.frame_matching
        )
    except (OSError, ValueError) as error:  # a bad input: one line naming it, as `train.index` prints
        raise SystemExit(f"error: {' '.join(str(error).split())}") from None
    model.save_pretrained(args.output_dir)
    save_processor(args.output_dir, model, args.tokenizer)
    print(f"Saved {type(model).__name__} to {args.output_dir}\n{report.summary()}")


if __name__ == "__main__":
    main()
