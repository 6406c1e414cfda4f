"""TESTA: Temporal-Spatial Token Aggregation for long-form video-language understanding, for Hugging Face."""

from .aggregation import Matching, geometry_matching, importance_matching, merge_tokens
from .configuration_testa import TestaConfig, TestaVisionConfig
from .modeling_testa import TestaPreTrainedModel, TestaVisionModel, TestaVisionModelOutput, token_schedule
from .modeling_testa import (
    TestaAnswerRankingOutput,
    TestaForPreTraining,
    TestaForVideoQA,
    TestaForVideoTextRetrieval,
    TestaPreTrainingOutput,
    TestaRankingOutput,
    TestaVideoQAOutput,
    TestaVideoTextRetrievalOutput,
)

__version__ = "0.1.0"

__all__ = [
    "Matching",
    "TestaConfig",
    "TestaPreTrainedModel",
    "TestaVisionConfig",
    "TestaVisionModel",
    "TestaVisionModelOutput",
    "geometry_matching",
    "importance_matching",
    "merge_tokens",
    "token_schedule",
    "TestaAnswerRankingOutput",
    "TestaForPreTraining",
    "TestaForVideoQA",
    "TestaForVideoTextRetrieval",
    "TestaPreTrainingOutput",
    "TestaRankingOutput",
    "TestaVideoQAOutput",
    "TestaVideoTextRetrievalOutput",
]

# --- processing: video processor + processor, registered with AutoVideoProcessor / AutoProcessor -----------------------
from transformers import AutoProcessor, AutoVideoProcessor  # noqa: E402

from .processing_testa import TestaProcessor, build_testa_tokenizer, pre_caption  # noqa: E402
from .video_processing_testa import (  # noqa: E402
    TestaVideoProcessor,
    VideoDecodingError,
    VideoDecodingTimeoutError,
    decode_video,
    sample_frame_indices,
)


AutoVideoProcessor.register(TestaConfig, video_processor_class=TestaVideoProcessor, exist_ok=True)
AutoProcessor.register(TestaConfig, TestaProcessor, exist_ok=True)

__all__ += [
    "TestaProcessor",
    "TestaVideoProcessor",
    "VideoDecodingError",
    "VideoDecodingTimeoutError",
    "build_testa_tokenizer",
    "decode_video",
    "pre_caption",
    "sample_frame_indices",
]

# Compute budget and aggregation pictures.
from .flops import count_encoder_gmac, estimate_encoder_gmac, suggest_reduction  # noqa: E402
from .visualization import (  # noqa: E402
    AggregationGroups,
    aggregation_groups,
    draw_aggregation,
    visualize_aggregation,
)

__all__ += [
    "AggregationGroups",
    "aggregation_groups",
    "count_encoder_gmac",
    "draw_aggregation",
    "estimate_encoder_gmac",
    "suggest_reduction",
    "visualize_aggregation",
]
