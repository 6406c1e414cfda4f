"""Convert a transformers BLIP checkpoint into a TESTA model, the way the original TESTA initialises from BLIP.

    python -m modeling_testa.convert_blip_to_testa --blip Salesforce/blip-itm-base-coco --num-frames 32 \\
        --image-size 224 --output-dir testa-base-coco-f32

* `BlipForImageTextRetrieval` -> `TestaForVideoTextRetrieval`, `BlipForQuestionAnswering` -> `TestaForVideoQA`,
  `BlipForConditionalGeneration` -> `TestaForPreTraining` (its captioning decoder).
* The spatial half of every block keeps BLIP's weights (the names are identical). Temporal attention and its
  LayerNorm are copied from the spatial ones (the original `load_checkpoint` rule), `temporal_fc` and the time
  embedding start at zero (TimeSformer), so a converted model *is* BLIP applied to every frame until it is trained.
* The position embedding is resized bicubically when `image_size` differs (e.g. 384 -> 224), exactly like BLIP's own
  `interpolate_pos_encoding`.
* Every setting that matters is carried over: the full BLIP text config, and the vision widths, heads, MLP size,
  activation, `layer_norm_eps` and patch size.
"""

import argparse
import copy
import logging

import torch
from transformers import PreTrainedModel

from .configuration_testa import TestaConfig, TestaVisionConfig
from .modeling_testa import TestaForPreTraining, TestaForVideoQA, TestaForVideoTextRetrieval, TestaPreTrainedModel
from .modeling_testa_vision import resize_position_embedding


logger = logging.getLogger(__name__)

BLIP_TO_TESTA = {
    "BlipForImageTextRetrieval": TestaForVideoTextRetrieval,
    "BlipForQuestionAnswering": TestaForVideoQA,
    "BlipForConditionalGeneration": TestaForPreTraining,
}


def _load_blip(blip: str | PreTrainedModel) -> PreTrainedModel:
    if isinstance(blip, PreTrainedModel):
        return blip
    import transformers
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(blip)
    except (OSError, ValueError) as error:  # transformers' own multi-paragraph message: its first sentence
        first = " ".join(str(error).split()).split(". ")[0]
        raise ValueError(f"{blip!r} is not a BLIP checkpoint folder or Hub id (expected a config.json of "
                         f"{', '.join(sorted(BLIP_TO_TESTA))}): {first}.") from None
    architectures = [a for a in (config.architectures or []) if a in BLIP_TO_TESTA]
    if not architectures:
        raise ValueError(
            f"{blip!r} is not a BLIP checkpoint this converter knows: its architectures are {config.architectures}, "
            f"expected one of {sorted(BLIP_TO_TESTA)}."
        )
    return getattr(transformers, architectures[0]).from_pretrained(blip, dtype=torch.float32)


def testa_config_from_blip(
    blip_config, num_frames: int, image_size: int | None = None, enc_token_id: int | None = None, **overrides
) -> TestaConfig:
    """The `TestaConfig` of a BLIP config: vision hyper-parameters and the whole text config are copied.

    Args:
        blip_config: a transformers `BlipConfig`.
        num_frames: frames the temporal embedding is built for.
        image_size: input resolution (defaults to BLIP's).
        enc_token_id: id of [ENC] (defaults to the token after [DEC], i.e. 30523 for BLIP's 30524-word vocabulary).
        **overrides: `TestaVisionConfig` fields (`temporal_reduction`, `spatial_reduction`, ...) and `TestaConfig`
            fields (`queue_size`, `k_test`, ...). BLIP merges no tokens, so it has no merge rule of its own: the
            converted encoder, a TESTA model to fine-tune, takes the library's default `score_grid` unless one is
            given here.
    """
    vision, text = blip_config.vision_config, copy.deepcopy(blip_config.text_config)
    vision_fields = set(TestaVisionConfig.__dataclass_fields__)
    vision_overrides = {k: overrides.pop(k) for k in list(overrides) if k in vision_fields}
    vision_config = TestaVisionConfig(
        num_frames=num_frames,
        image_size=image_size or vision.image_size,
        patch_size=vision.patch_size,
        num_channels=getattr(vision, "num_channels", 3),
        hidden_size=vision.hidden_size,
        num_hidden_layers=vision.num_hidden_layers,
        num_attention_heads=vision.num_attention_heads,
        intermediate_size=vision.intermediate_size,
        hidden_act=vision.hidden_act,
        layer_norm_eps=vision.layer_norm_eps,
        qkv_bias=True,  # BLIP's fused qkv always has a bias
        attention_dropout=float(vision.attention_dropout),
        initializer_range=vision.initializer_range,
        **vision_overrides,
    )
    dec_token_id = text.bos_token_id
    if dec_token_id is None:
        raise ValueError("The BLIP text config has no `bos_token_id` ([DEC]); cannot set `dec_token_id`.")
    enc_token_id = dec_token_id + 1 if enc_token_id is None else enc_token_id
    overrides.setdefault("projection_dim", blip_config.image_text_hidden_size)
    overrides.setdefault("initializer_range", blip_config.initializer_range)
    return TestaConfig(
        vision_config=vision_config,
        text_config=text,
        enc_token_id=enc_token_id,
        dec_token_id=dec_token_id,
        **overrides,
    )


def _source_name(name: str, blip_state: dict[str, torch.Tensor]) -> tuple[str | None, str]:
    """The BLIP key that fills TESTA key ``name``, and how: ``("key", "copy")``, ``(None, "zero")`` or
    ``(None, "fresh")``."""
    if name.startswith("vision_model.layers."):
        _, _, index, rest = name.split(".", 3)
        base = f"vision_model.encoder.layers.{index}."
        if rest.startswith("temporal_fc."):
            return None, "zero"
        if rest.startswith("temporal_layer_norm."):
            return base + "layer_norm1." + rest.split(".", 1)[1], "copy"
        if rest.startswith("temporal_attention."):
            return base + "self_attn." + rest.split(".", 1)[1], "copy"
        return base + rest, "copy"
    if name == "vision_model.embeddings.temporal_embedding":
        return None, "zero"
    if name.startswith("text_encoder.") and name not in blip_state:
        # A captioning checkpoint has no encoder: the encoder reads the decoder's weights (shared in pre-training
        # anyway; only self-attention is the encoder's own, and it starts from the decoder's).
        candidate = "text_decoder.bert." + name[len("text_encoder.") :]
        if candidate in blip_state:
            return candidate, "copy"
    if name in blip_state:
        return name, "copy"
    return None, "fresh"


@torch.no_grad()
def convert_blip_to_testa(
    blip: str | PreTrainedModel,
    num_frames: int,
    image_size: int | None = None,
    model_class: type[TestaPreTrainedModel] | None = None,
    enc_token_id: int | None = None,
    **config_overrides,
) -> TestaPreTrainedModel:
    """Builds a TESTA model from a transformers BLIP model (or a local folder / Hub id of one).

    Args:
        blip: `BlipForImageTextRetrieval`, `BlipForQuestionAnswering` or `BlipForConditionalGeneration`, or its path.
        num_frames: frames of the temporal embedding (zero-initialised).
        image_size: input resolution; the position embedding is resized bicubically (defaults to BLIP's).
        model_class: the TESTA head to build (defaults by BLIP class: retrieval, QA, pre-training).
        enc_token_id: id of [ENC] (defaults to [DEC] + 1).
        **config_overrides: `TestaVisionConfig` / `TestaConfig` fields, e.g. `temporal_reduction=1,
            spatial_reduction=12` or `queue_size=32`.

    Returns:
        The TESTA model (eval mode), equal to BLIP applied frame by frame while aggregation is off.
    """
    blip = _load_blip(blip)
    blip_class = type(blip).__name__
    if model_class is None:
        if blip_class not in BLIP_TO_TESTA:
            raise ValueError(f"Cannot infer the TESTA head for {blip_class}; pass `model_class`.")
        model_class = BLIP_TO_TESTA[blip_class]
    config = testa_config_from_blip(blip.config, num_frames, image_size, enc_token_id, **config_overrides)
    model = model_class(config)
    blip_state = blip.state_dict()
    grid = config.vision_config.image_size // config.vision_config.patch_size

    new_state, used, fresh = {}, set(), []
    for name, tensor in model.state_dict().items():
        if name.startswith("momentum."):
            continue  # training state: rebuilt by the model (momentum copies are synchronised at the first step)
        source, how = _source_name(name, blip_state)
        if how == "zero":
            new_state[name] = torch.zeros_like(tensor)
        elif how == "fresh":
            fresh.append(name)
        else:
            value = blip_state[source]
            if name == "vision_model.embeddings.position_embedding":
                value = resize_position_embedding(value, grid)
            if value.shape != tensor.shape:
                raise ValueError(f"{source} has shape {tuple(value.shape)} but {name} needs {tuple(tensor.shape)}.")
            new_state[name] = value.to(tensor.dtype)
            used.add(source)
    unused = sorted(k for k in blip_state if k not in used and not k.endswith("position_ids"))
    # Everything the head does not have is listed; nothing that it has is left behind silently.
    if unused:
        logger.warning("BLIP weights not used by %s: %s", model_class.__name__, unused)
    if fresh:
        logger.warning("%s weights not in the BLIP checkpoint (freshly initialised): %s", model_class.__name__, fresh)
    missing, unexpected = model.load_state_dict(new_state, strict=False)
    allowed_missing = set(fresh) | {
        k for k in missing if k.startswith("momentum.") or k.endswith("position_ids")
    }
    if unexpected or set(missing) - allowed_missing:
        unexplained = sorted(set(missing) - allowed_missing)
        raise RuntimeError(f"Conversion bug: missing {unexplained}, unexpected {unexpected}.")
    model.conversion_report = {"unused_blip_keys": unused, "freshly_initialised": fresh}
    return model.eval()


def save_processor(output_dir: str, model: TestaPreTrainedModel, blip_path: str | None = None) -> bool:
    """Saves a `TestaProcessor` next to a converted model when this package ships one: the video processor set to the
    model's frames and resolution, and the BLIP checkpoint's tokenizer when it has [ENC] at the model's
    `enc_token_id` (otherwise the package's default BLIP tokenizer). Returns whether a processor was saved."""
    try:
        from .processing_testa import TestaProcessor
        from .video_processing_testa import TestaVideoProcessor
    except ImportError as error:  # the processor modules are optional for the converter
        logger.warning("No processor saved (%s).", error)
        return False
    vision = model.config.vision_config
    video_processor = TestaVideoProcessor.for_model_input(vision.num_frames, vision.image_size)
    tokenizer = None
    if blip_path is not None:
        try:
            from transformers import AutoTokenizer

            candidate = AutoTokenizer.from_pretrained(blip_path)
            if candidate.convert_tokens_to_ids("[ENC]") == model.config.enc_token_id:
                tokenizer = candidate
        except (OSError, ValueError) as error:
            logger.warning("BLIP tokenizer not usable (%s); saving the default TESTA tokenizer.", error)
    processor = TestaProcessor(video_processor=video_processor, tokenizer=tokenizer)
    ids = (processor.dec_token_id, processor.enc_token_id)
    if ids != (model.config.dec_token_id, model.config.enc_token_id):
        logger.warning(
            "The saved tokenizer's [DEC]/[ENC] ids %s differ from the model's %s; pass a matching tokenizer.",
            ids, (model.config.dec_token_id, model.config.enc_token_id),
        )
    processor.save_pretrained(output_dir)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blip", required=True, help="BLIP checkpoint: local folder or Hub id")
    parser.add_argument("--num-frames", type=int, required=True)
    parser.add_argument("--image-size", type=int, default=None, help="input resolution (default: BLIP's)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--temporal-reduction", type=int, default=None, help="R_T per block (default: config's 1)")
    parser.add_argument("--spatial-reduction", type=int, default=None, help="R_S per block (default: config's 12)")
    args = parser.parse_args(argv)
    overrides = {
        k: v
        for k, v in (("temporal_reduction", args.temporal_reduction), ("spatial_reduction", args.spatial_reduction))
        if v is not None
    }
    try:
        model = convert_blip_to_testa(args.blip, args.num_frames, args.image_size, **overrides)
    except (OSError, ValueError) as error:  # a bad input: one line naming it, as `train.index` prints
        raise SystemExit(f"error: {' '.join(str(error).split())}") from None
    model.save_pretrained(args.output_dir)
    save_processor(args.output_dir, model, args.blip)
    print(f"Saved {type(model).__name__} to {args.output_dir}; report: {model.conversion_report}")


if __name__ == "__main__":
    main()
