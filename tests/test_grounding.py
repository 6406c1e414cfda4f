"""Text grounding on aggregated regions: similarities against a separate computation, mapping back to patches."""

import pytest
import torch
from helpers.pipelines import FRAMES, SIZE, build_retrieval, tiny_processor

from modeling_testa.grounding import draw_grounding, ground_phrases


def test_grounding_equals_a_direct_computation_and_maps_back_to_patches():
    model, processor = build_retrieval(), tiny_processor()
    video = torch.rand(FRAMES, 3, SIZE, SIZE) * 4 - 2  # already-normalised pixel values
    phrases = ["a red circle", "a blue square moves left"]
    grounding = ground_phrases(model, processor, video, phrases)

    # Independent computation: encoder tokens -> vision_proj; phrases tokenised separately -> text features.
    with torch.no_grad():
        tokens = model.vision_model(video[None]).last_hidden_state[0, 1:]
        regions = torch.nn.functional.normalize(model.vision_proj(tokens), dim=-1)
        for i, phrase in enumerate(phrases):
            ids = processor.tokenizer([phrase], return_tensors="pt")
            text = model.get_text_features(ids["input_ids"], ids["attention_mask"]).pooler_output
            torch.testing.assert_close(grounding.similarity[i], (text @ regions.T)[0], atol=1e-5, rtol=1e-5)
    assert grounding.similarity.shape == (2, tokens.shape[0])

    per_patch = grounding.patch_similarity()
    assert per_patch.shape == (2, FRAMES, (SIZE // 8) ** 2)
    for t in range(FRAMES):
        for patch in range(per_patch.shape[-1]):
            region = grounding.source_map[t, patch].item()
            assert per_patch[0, t, patch] == grounding.similarity[0, region]
    # every region is covered by at least one input patch (merging, no pruning)
    assert set(grounding.source_map.flatten().tolist()) == set(range(tokens.shape[0]))

    image = draw_grounding(grounding)
    assert image.mode == "RGB" and image.size[1] > 2 * SIZE


@pytest.mark.parametrize("phrases", [[], "a phrase", [1, 2]])
def test_bad_phrases_raise(phrases):
    with pytest.raises(ValueError, match="phrases"):
        ground_phrases(build_retrieval(), tiny_processor(), torch.zeros(FRAMES, 3, SIZE, SIZE), phrases)
