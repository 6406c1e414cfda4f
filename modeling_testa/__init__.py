"""TESTA: Temporal-Spatial Token Aggregation for long-form video-language understanding, for Hugging Face.

Importing the package registers the TESTA classes with transformers' Auto classes (config, models, video processor,
processor) and pipelines, and marks them for export, so that `save_pretrained` writes folders that load elsewhere with
`trust_remote_code=True`.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForPreTraining,
    AutoModelForVisualQuestionAnswering,
    AutoProcessor,
    AutoVideoProcessor,
)
from transformers.utils import is_torchvision_available, is_vision_available

from .aggregation import Matching, geometry_matching, importance_matching, merge_tokens
from .configuration_testa import TestaConfig, TestaVisionConfig
from .flops import count_encoder_gmac, estimate_encoder_gmac, suggest_reduction
from .grounding import Grounding, draw_grounding, ground_phrases
from .hub import (
    MODEL_CARD_MARKER,
    PIPELINE_TASKS,
    custom_pipelines_for,
    model_card,
    save_for_hub,
    write_model_card,
)
from .modeling_testa import (
    TestaAnswerRankingOutput,
    TestaForPreTraining,
    TestaForVideoQA,
    TestaForVideoTextRetrieval,
    TestaPreTrainedModel,
    TestaPreTrainingOutput,
    TestaRankingOutput,
    TestaVideoQAOutput,
    TestaVideoTextRetrievalOutput,
    TestaVisionModel,
    TestaVisionModelOutput,
    token_schedule,
)
from .patching import apply_testa, remove_testa
from .pipeline_testa import (
    VideoQuestionAnsweringPipeline,
    VideoTextRetrievalPipeline,
    ZeroShotVideoClassificationPipeline,
    register_testa_pipelines,
)
from .processing_testa import TestaProcessor, build_testa_tokenizer, pre_caption
from .video_decoding import (
    VideoDecodingError,
    VideoDecodingTimeoutError,
    decode_video,
    format_time,
    sample_frame_indices,
)
from .video_inputs import VIDEO_SUFFIXES, find_video_files, is_video_file_name
from .video_processing_testa import TestaVideoProcessor
from .visualization import AggregationGroups, aggregation_groups, draw_aggregation, visualize_aggregation


__version__ = "0.1.0"

# In-process Auto* registration, and for Hub remote code: `save_pretrained` copies the code files and writes
# `auto_map` (the processor classes register themselves for export in their modules).
for config_class in (TestaConfig, TestaVisionConfig):
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    config_class.register_for_auto_class("AutoConfig")
for auto_class, config_class, model_class in (
    (AutoModel, TestaConfig, TestaForVideoTextRetrieval),
    (AutoModel, TestaVisionConfig, TestaVisionModel),
    (AutoModelForVisualQuestionAnswering, TestaConfig, TestaForVideoQA),
    (AutoModelForPreTraining, TestaConfig, TestaForPreTraining),
):
    auto_class.register(config_class, model_class, exist_ok=True)
    model_class.register_for_auto_class(auto_class.__name__)
del config_class, auto_class, model_class  # the loops' names are no attributes of the package
# The video processor needs Pillow and torchvision; the models run without them (e.g. torch + transformers on a GPU).
if is_vision_available() and is_torchvision_available():
    AutoVideoProcessor.register(TestaConfig, video_processor_class=TestaVideoProcessor, exist_ok=True)
AutoProcessor.register(TestaConfig, TestaProcessor, exist_ok=True)
register_testa_pipelines()

__all__ = [
    "MODEL_CARD_MARKER",
    "PIPELINE_TASKS",
    "VIDEO_SUFFIXES",
    "AggregationGroups",
    "Grounding",
    "Matching",
    "TestaAnswerRankingOutput",
    "TestaConfig",
    "TestaForPreTraining",
    "TestaForVideoQA",
    "TestaForVideoTextRetrieval",
    "TestaPreTrainedModel",
    "TestaPreTrainingOutput",
    "TestaProcessor",
    "TestaRankingOutput",
    "TestaVideoProcessor",
    "TestaVideoQAOutput",
    "TestaVideoTextRetrievalOutput",
    "TestaVisionConfig",
    "TestaVisionModel",
    "TestaVisionModelOutput",
    "VideoDecodingError",
    "VideoDecodingTimeoutError",
    "VideoQuestionAnsweringPipeline",
    "VideoTextRetrievalPipeline",
    "ZeroShotVideoClassificationPipeline",
    "aggregation_groups",
    "apply_testa",
    "build_testa_tokenizer",
    "count_encoder_gmac",
    "custom_pipelines_for",
    "decode_video",
    "draw_aggregation",
    "draw_grounding",
    "estimate_encoder_gmac",
    "find_video_files",
    "format_time",
    "geometry_matching",
    "ground_phrases",
    "importance_matching",
    "is_video_file_name",
    "merge_tokens",
    "model_card",
    "pre_caption",
    "register_testa_pipelines",
    "remove_testa",
    "sample_frame_indices",
    "save_for_hub",
    "suggest_reduction",
    "token_schedule",
    "visualize_aggregation",
    "write_model_card",
]
