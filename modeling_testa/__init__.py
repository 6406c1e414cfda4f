"""TESTA: Temporal-Spatial Token Aggregation for long-form video-language understanding, for Hugging Face."""

from .aggregation import Matching, geometry_matching, importance_matching, merge_tokens
from .configuration_testa import TestaConfig, TestaVisionConfig
from .modeling_testa import TestaPreTrainedModel, TestaVisionModel, TestaVisionModelOutput, token_schedule

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
]
