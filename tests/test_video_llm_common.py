"""transformers' own common model tests (`ModelTesterMixin`, from the sdist, unchanged) on video-LLM instances that
`apply_testa_to_video_llm` has patched, idle (R = 0): the patch must keep every behaviour the mixin checks.

transformers' model-specific test files (`tests/models/qwen2_5_vl/...`) are not in its source distribution, so the
testers here are ours: tiny configs and *video* inputs (the path the patch replaces; transformers' own testers feed
images). Each class under test is the stock class whose ``__init__`` ends with the instance patch, so that every model
the mixin builds (``model_class(config)``, ``from_pretrained``, copies) runs the patched tower.

Two lists of skipped tests, per family:
- ``STOCK_FAILS``: they fail on the *stock* classes with these testers too (no images in the inputs; the stand-in
  generation mixin; ...). A slow test runs the stock classes and checks that exactly these fail.
- ``KNOWN_GAPS``: they fail on patched instances only; each is a documented limit of the patched tower
  (docs/video_llms.md, "transformers' common tests").
"""

import unittest
import warnings

import pytest
import torch
import transformers

from helpers.transformers_common import common_tests_or_skip

from video_llms import apply_testa_to_video_llm

COMMON = common_tests_or_skip()
ModelTesterMixin = COMMON["test_modeling_common"].ModelTesterMixin
floats_tensor = COMMON["test_modeling_common"].floats_tensor
ids_tensor = COMMON["test_modeling_common"].ids_tensor

PAD, VISION_START, VISION_END, IMAGE, VIDEO = 0, 1, 2, 3, 4
VOCAB, TEXT_TOKENS, BATCH = 64, 5, 2


def patched(stock_class):
    """``stock_class`` whose instances are patched by `apply_testa_to_video_llm` (R = 0) as they are built."""

    def __init__(self, config, *args, **kwargs):
        stock_class.__init__(self, config, *args, **kwargs)
        apply_testa_to_video_llm(self)

    return type(stock_class.__name__, (stock_class,), {"__init__": __init__, "__module__": stock_class.__module__})


TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": PAD, "max_position_embeddings": 512}  # (a rope-scaling test runs 1.5x this many tokens)
IDS = {"vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END, "image_token_id": IMAGE,
       "video_token_id": VIDEO}


class QwenVideoTester:
    """Two videos of ``frames`` frames of ``grid x grid`` patches each (2x2 merge units), then text."""

    def __init__(self, parent, config_factory, patch: int, frames: int = 4, grid: int = 4,
                 group_per_tubelet: bool = False):
        self.parent, self.config_factory, self.patch = parent, config_factory, patch
        self.frames, self.grid, self.group_per_tubelet = frames, grid, group_per_tubelet
        self.batch_size, self.is_training = BATCH, True
        units = grid * grid // 4
        # one run of placeholders for the video (Qwen2.5-VL), or one per tubelet (Qwen3-VL's prompt)
        self.groups = [units] * (frames // 2) if group_per_tubelet else [units * (frames // 2)]
        self.seq_length = sum(2 + group for group in self.groups) + TEXT_TOKENS
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.vocab_size = VOCAB

    def get_config(self):
        return self.config_factory()

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        tubelets = self.frames // 2
        pixels = floats_tensor([BATCH * tubelets * self.grid * self.grid, 3 * 2 * self.patch * self.patch])
        text = ids_tensor([BATCH, TEXT_TOKENS], VOCAB - 5) + 5
        video = [torch.tensor([VISION_START] + [VIDEO] * group + [VISION_END]) for group in self.groups]
        input_ids = torch.cat([torch.cat(video).expand(BATCH, -1), text], 1)
        return config, {
            "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": (input_ids == VIDEO).long() * 2,
            "pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[tubelets, self.grid, self.grid]] * BATCH),
        }


def qwen2_5_vl_config():
    return transformers.Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 1, 1]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 32, "num_heads": 4, "out_hidden_size": 32,
                       "window_size": 56, "fullatt_block_indexes": [1], "tokens_per_second": 2},
        **IDS)


STOCK_FAILS = {
    "qwen2_5_vl": {
        "test_generation_tester_mixin_inheritance",  # GenerationTesterMixin is an empty stand-in here
        # the testers feed videos, not images
        "test_get_image_features_attentions", "test_get_image_features_hidden_states",
        "test_get_image_features_output_0", "test_get_image_features_output_1", "test_get_image_features_output_2",
        "test_get_image_features_pooler_output", "test_multimodal_outputs_are_returned",
    },
}
STOCK_FAILS["qwen3_vl"] = STOCK_FAILS["qwen2_5_vl"] | {
    # stock Qwen3-VL's tower returns no per-block hidden states or attention weights from get_video_features either
    "test_get_video_features_attentions", "test_get_video_features_hidden_states",
}
STOCK_FAILS["llava_onevision"] = STOCK_FAILS["qwen2_5_vl"] | {
    # stock's last_hidden_state is per frame, (videos x frames, patches, C): the mixin expects one row per video
    "test_get_video_features_output_0", "test_get_video_features_output_2",
    # stock's SigLIP tower runs its post-layernorm outside the checkpointed layers: the mixin finds grads it misses
    "test_training_gradient_checkpointing", "test_training_gradient_checkpointing_use_reentrant_false",
    "test_training_gradient_checkpointing_use_reentrant_true",
}
KNOWN_GAPS = {
    "qwen2_5_vl": {
        # the patched tower keeps no per-block hidden states or attention weights (None)
        "test_get_video_features_attentions", "test_get_video_features_hidden_states",
        # the patched tower runs its blocks' modules itself, so block-level activation checkpointing does not apply
        "test_training_gradient_checkpointing", "test_training_gradient_checkpointing_use_reentrant_false",
        "test_training_gradient_checkpointing_use_reentrant_true",
    },
}
KNOWN_GAPS["llava_onevision"] = {
    "test_get_video_features_attentions",  # the patched SigLIP tower refuses output_attentions=True (ValueError)
}
KNOWN_GAPS["qwen3_vl"] = {  # (the hidden states and attention weights are in STOCK_FAILS there)
    "test_training_gradient_checkpointing", "test_training_gradient_checkpointing_use_reentrant_false",
    "test_training_gradient_checkpointing_use_reentrant_true",
}


def common_tests(family: str, model_classes: tuple, tester, skip: frozenset[str] = frozenset()):
    """A ``ModelTesterMixin`` test case for ``model_classes`` with the inputs of ``tester(parent)``, the tests in
    ``skip`` skipped (each with the list it is in)."""

    def setUp(self):
        COMMON["test_modeling_common"].global_rng.seed(0)  # every test gets the same inputs, whatever ran before
        self.model_tester = tester(self)

    def skipped(name):
        reason = {name: "fails on the stock class with these inputs too (STOCK_FAILS)" for name in STOCK_FAILS[family]}
        reason.update({name: "a known limit of the patched tower (KNOWN_GAPS)" for name in KNOWN_GAPS[family]})
        return unittest.skip(reason[name])(lambda self: None)

    def test_bc_cache_name_forward(self):
        # it records a deprecation warning, which the suite's `filterwarnings` (setup.cfg) would otherwise ignore
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            ModelTesterMixin.test_bc_cache_name_forward(self)

    body = {"all_model_classes": model_classes, "test_resize_embeddings": True, "test_torch_exportable": False,
            "_is_composite": True, "setUp": setUp, "test_bc_cache_name_forward": test_bc_cache_name_forward,
            **{name: skipped(name) for name in skip}}
    return type(f"{family}_common", (ModelTesterMixin, unittest.TestCase), body)


def qwen3_vl_config():
    return transformers.Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 32, "num_heads": 4, "out_hidden_size": 32,
                       "num_position_embeddings": 16, "deepstack_visual_indexes": [1]},
        **IDS)


class LlavaVideoTester:
    """Two videos of ``frames`` frames of 30 x 30 px (5 x 5 patches of 6 px, pooled to 3 x 3 tokens a frame), one
    placeholder per pooled token and one for the newline, then text."""

    def __init__(self, parent, frames: int = 4):
        self.parent, self.frames = parent, frames
        self.batch_size, self.is_training = BATCH, True
        self.video_tokens = frames * 9 + 1
        self.seq_length = self.video_tokens + TEXT_TOKENS
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.vocab_size = VOCAB

    def get_config(self):
        return transformers.LlavaOnevisionConfig(
            vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 37,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 30, "patch_size": 6,
                           "vision_use_head": False},
            text_config={"model_type": "qwen2", **TEXT}, image_token_index=IMAGE, video_token_index=VIDEO,
            vision_feature_layer=-1, vision_feature_select_strategy="full")

    def prepare_config_and_inputs_for_common(self):
        text = ids_tensor([BATCH, TEXT_TOKENS], VOCAB - 5) + 5
        input_ids = torch.cat([torch.full((BATCH, self.video_tokens), VIDEO), text], 1)
        return self.get_config(), {
            "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values_videos": floats_tensor([BATCH, self.frames, 3, 30, 30]),
        }


CLASSES = {
    "qwen2_5_vl": (transformers.Qwen2_5_VLModel, transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (transformers.Qwen3VLModel, transformers.Qwen3VLForConditionalGeneration),
    "llava_onevision": (transformers.LlavaOnevisionModel, transformers.LlavaOnevisionForConditionalGeneration),
}
TESTERS = {
    "qwen2_5_vl": lambda parent: QwenVideoTester(parent, qwen2_5_vl_config, patch=14),
    "qwen3_vl": lambda parent: QwenVideoTester(parent, qwen3_vl_config, patch=16, group_per_tubelet=True),
    "llava_onevision": LlavaVideoTester,
}


def patched_common_tests(family: str):
    return common_tests(family, tuple(patched(c) for c in CLASSES[family]), TESTERS[family],
                        STOCK_FAILS[family] | KNOWN_GAPS[family])


class TestQwen2_5_VLPatchedCommon(patched_common_tests("qwen2_5_vl")):
    """The common tests on patched Qwen2.5-VL instances."""


class TestQwen3VLPatchedCommon(patched_common_tests("qwen3_vl")):
    """The common tests on patched Qwen3-VL instances (DeepStack included)."""


class TestLlavaOnevisionPatchedCommon(patched_common_tests("llava_onevision")):
    """The common tests on patched LLaVA-OneVision instances."""


def failed_tests(case: type) -> set[str]:
    """The names of the tests of ``case`` that fail or error (a failed subtest counts for its test)."""
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    return {getattr(test, "test_case", test)._testMethodName for test, _ in result.failures + result.errors}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(CLASSES))
def test_skipped_tests_fail_on_the_stock_classes_and_only_the_gaps_on_patched_ones(family):
    """The lists above are what they say: on the stock classes exactly ``STOCK_FAILS`` fail, and on patched
    instances exactly ``STOCK_FAILS`` and ``KNOWN_GAPS``."""
    assert failed_tests(common_tests(family, CLASSES[family], TESTERS[family])) == STOCK_FAILS[family]
    patched_classes = tuple(patched(c) for c in CLASSES[family])
    assert failed_tests(common_tests(family, patched_classes, TESTERS[family])) == (
        STOCK_FAILS[family] | KNOWN_GAPS[family])
