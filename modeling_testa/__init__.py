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

# --- models: Auto* registration, Hub remote code (auto_map, custom_pipelines, model card) and pipelines ---------------
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
)

from .hub_testa import MODEL_CARD_MARKER, PIPELINE_TASKS, custom_pipelines_for, model_card, write_model_card  # noqa: E402
from .pipeline_testa import (  # noqa: E402
    VideoIndex,
    VideoQuestionAnsweringPipeline,
    VideoTextRetrievalPipeline,
    ZeroShotVideoClassificationPipeline,
    register_testa_pipelines,
)


AutoConfig.register(TestaConfig.model_type, TestaConfig, exist_ok=True)
AutoConfig.register(TestaVisionConfig.model_type, TestaVisionConfig, exist_ok=True)
AutoModel.register(TestaConfig, TestaForVideoTextRetrieval, exist_ok=True)
AutoModel.register(TestaVisionConfig, TestaVisionModel, exist_ok=True)
AutoModelForVisualQuestionAnswering.register(TestaConfig, TestaForVideoQA, exist_ok=True)
AutoModelForPreTraining.register(TestaConfig, TestaForPreTraining, exist_ok=True)

# `save_pretrained` copies the code files and writes `auto_map`, so saved folders load with `trust_remote_code=True`.
TestaConfig.register_for_auto_class("AutoConfig")
TestaVisionConfig.register_for_auto_class("AutoConfig")
TestaVisionModel.register_for_auto_class("AutoModel")
TestaForVideoTextRetrieval.register_for_auto_class("AutoModel")
TestaForVideoQA.register_for_auto_class("AutoModelForVisualQuestionAnswering")
TestaForPreTraining.register_for_auto_class("AutoModelForPreTraining")
register_testa_pipelines()

__all__ += [
    "MODEL_CARD_MARKER",
    "PIPELINE_TASKS",
    "VideoIndex",
    "VideoQuestionAnsweringPipeline",
    "VideoTextRetrievalPipeline",
    "ZeroShotVideoClassificationPipeline",
    "custom_pipelines_for",
    "model_card",
    "register_testa_pipelines",
    "write_model_card",
]
