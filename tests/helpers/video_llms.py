"""Tiny offline video-LLMs (random weights, a local WordLevel vocabulary) and their processors, for the tests of
`video_llms`: Qwen2.5-VL and Qwen3-VL at a size whose `generate` takes about a second on the CPU."""

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>", "<pad>", "<eos>"]
WORDS = ["describe", "the", "video", "what", "happens", "a", "cat", "dog", "runs", "<", ">", "seconds"]
WORDS += [f"{tenths / 10:.1f}" for tenths in range(0, 400)]


def tokenizer() -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer holding the Qwen vision tokens (split on whitespace and on the special tokens)."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS + ["<unk>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([  # "<1.5 seconds>" -> "<", "1.5", "seconds", ">"
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("[<>]"), behavior="isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[:4]})
    fast.video_token = "<|video_pad|>"
    fast.image_token = "<|image_pad|>"
    return fast


def token_ids(fast: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = {name: fast.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("video_token_id", "<|video_pad|>"), ("image_token_id", "<|image_pad|>"))}
    return ids


TEXT = {"vocab_size": len(SPECIAL_TOKENS) + len(WORDS) + 1, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def qwen2_5_vl(attn_implementation: str = "sdpa", seed: int = 0, depth: int = 4, frame_pixels: int = 56 * 56):
    """``(model, processor)``: a 4-block Qwen2.5-VL tower (window attention over 2x2 units, full attention at blocks 1
    and 3) on a 2-layer LLM, and a processor at ``frame_pixels`` per frame (56x56: 4x4 patches of 14 px, 2x2 units
    of the merger, one window; 112x84: 8x6 patches, 4x3 units, 4 windows of 4, 2, 4 and 2 units)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    fast = tokenizer()
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "bos_token_id": None, "eos_token_id": fast.eos_token_id, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1]}},
        vision_config={"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                       "out_hidden_size": 32, "window_size": 56, "fullatt_block_indexes": [1, 3],
                       "tokens_per_second": 2},
        **token_ids(fast),
    )
    config.text_config.pad_token_id = fast.pad_token_id
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.set_attn_implementation(attn_implementation)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = None  # greedy runs the full max_new_tokens: fixed-length outputs
    pixels = {"min_pixels": frame_pixels, "max_pixels": frame_pixels}
    fast.padding_side = "left"  # a decoder-only LLM generates from left-padded batches
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels), video_processor=Qwen2VLVideoProcessor(**pixels, cap_pixels_per_frame=False),
        tokenizer=fast,
    )
    return model, processor


def video(frames: int, seed: int, height: int = 56, width: int = 56) -> np.ndarray:
    """``(frames, height, width, 3)`` uint8 frames: a smooth random scene whose content drifts, so that frames are
    similar but not equal (the matchings then have clear winners)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(height, width, 3)).astype(np.float32)
    drift = rng.normal(0, 40, size=(frames, 1, 1, 3)).cumsum(0)
    noise = rng.normal(0, 20, size=(frames, height, width, 3))
    return np.clip(base + drift + noise, 0, 255).astype(np.uint8)


def prompt(processor, text: str = "describe the video") -> str:
    """A prompt with one video, as Qwen's chat template writes it: ``<|vision_start|><|video_pad|><|vision_end|>``."""
    return f"<|vision_start|> {processor.video_token} <|vision_end|> {text}"


def qwen3_vl(attn_implementation: str = "sdpa", seed: int = 0, depth: int = 4):
    """``(model, processor)``: a 4-block Qwen3-VL tower (DeepStack taps after blocks 1 and 2) on a 2-layer LLM, and
    a processor at 64x64 pixels per frame (4x4 patches of 16 px: 2x2 merge units), frames taken as given
    (``do_sample_frames=False``; pass ``video_metadata`` for the timestamps)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    fast = tokenizer()
    config = Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "bos_token_id": None, "eos_token_id": fast.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True}},
        vision_config={"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                       "out_hidden_size": 32, "num_position_embeddings": 16, "deepstack_visual_indexes": [1, 2]},
        **token_ids(fast),
    )
    config.text_config.pad_token_id = fast.pad_token_id
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.set_attn_implementation(attn_implementation)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = None
    fast.padding_side = "left"
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=64 * 64, patch_size=16),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64 * 16},
                                              do_sample_frames=False, cap_pixels_per_frame=False),
        tokenizer=fast,
    )
    return model, processor


def metadata(frames: int, fps: float = 4.0) -> dict:
    """The `video_metadata` of ``frames`` frames taken at ``fps`` (Qwen3-VL's timestamps read it)."""
    return {"fps": fps, "total_num_frames": frames, "frames_indices": list(range(frames)), "duration": frames / fps}
