"""PyTorch TESTA heads: video-text retrieval (VTC + VTM, two-stage ranking), video question answering and
pre-training (VTC + VTM + captioning), on the TESTA video encoder (`modeling_testa_vision`) and transformers' BLIP
text modules. Contrastive training is a component: its orchestration is `contrastive`, momentum contrast a module the
contrastive heads hold (`momentum.MomentumContrast`), the losses plain functions (`losses`); two-stage ranking lives
in `ranking`.

"TESTA `path` Lx-Ly" names a file and lines of the released implementation, github.com/RenShuhuai-Andy/TESTA at
commit 41b9486, that a function follows."""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.models.blip.modeling_blip_text import (
    BlipTextEmbeddings,
    BlipTextLMHeadModel,
    BlipTextLMPredictionHead,
    BlipTextModel,
)
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils import ModelOutput, can_return_tuple

from .configuration_testa import TestaConfig, token_schedule
from .contrastive import contrastive_losses, hard_negative_sampling_weights
from .losses import sample_hard_negatives, sequence_log_likelihood, sequence_nll
from .modeling_testa_vision import TestaPreTrainedModel, TestaVisionModel, TestaVisionModelOutput, pool_video_tokens
from .momentum import MomentumContrast, online_modules, rename_legacy_keys
from .ranking import RankingOptions, TestaRankingOutput, two_stage_scores


def _with_first_token(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """A copy of ``input_ids`` whose first token is ``token_id`` ([ENC] or [DEC]), as the released code writes them
    (TESTA `models/testa_retrieval.py` L160-L161, `models/testa_vqa.py` L66 and L74)."""
    input_ids = input_ids.clone()
    input_ids[:, 0] = token_id
    return input_ids


def check_input_ids(input_ids: torch.Tensor, name: str = "input_ids") -> None:
    """Raises a `ValueError` naming ``name`` unless it is a non-empty ``(batch, sequence_length)`` tensor."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)
        raise ValueError(f"`{name}` must be a (batch, sequence_length) tensor of token ids, got {shape}.")


# ----------------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class TestaVideoTextRetrievalOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoTextRetrieval`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): with `return_loss=True`, `loss_vtc + loss_vtm`.
        loss_vtc (`torch.FloatTensor` of shape `()`, *optional*): video-text contrastive loss (momentum distillation,
            queue, positives by `video_ids`).
        loss_vtm (`torch.FloatTensor` of shape `()`, *optional*): video-text matching loss with hard negatives.
        itm_score (`torch.FloatTensor`): with `use_itm_head=True`, the `(batch, 2)` matching logits (index 1 = match)
            of each `(input_ids[i], pixel_values[i])` pair; otherwise the `(num_videos, num_texts)` cosine similarity.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
        video_token_sizes (`torch.FloatTensor` of shape `(batch, tokens)`): input patches per video token.
        question_embeds (`torch.FloatTensor` of shape `(batch, sequence_length, hidden_size)`): the text encoder
            output (video-grounded with the ITM head, unimodal otherwise), as in BLIP.
        negative_video_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): with a loss, the hard negative
            video drawn for every text, as an index into the batch gathered over all processes.
        negative_text_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): the same for the texts.
        vision_hidden_states (`tuple(torch.FloatTensor)`, *optional*): the video encoder's hidden states.
        vision_attentions (`tuple(torch.FloatTensor)`, *optional*): with `output_attentions`, the video encoder's
            attention per block, as [`TestaVisionModelOutput.attentions`] (sizes shrink as tokens merge).
        vision_temporal_attentions (`tuple(torch.FloatTensor)`, *optional*): with `output_attentions` and divided
            blocks, the temporal attention per block, as [`TestaVisionModelOutput.temporal_attentions`].
    """

    loss: torch.FloatTensor | None = None
    loss_vtc: torch.FloatTensor | None = None
    loss_vtm: torch.FloatTensor | None = None
    itm_score: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None
    video_token_sizes: torch.FloatTensor | None = None
    question_embeds: torch.FloatTensor | None = None
    negative_video_indices: torch.LongTensor | None = None
    negative_text_indices: torch.LongTensor | None = None
    vision_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    vision_attentions: tuple[torch.FloatTensor, ...] | None = None
    vision_temporal_attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class TestaVideoQAOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoQA`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): with `labels`, `sum(answer_weights * answer_loss) /
            num_questions`, the released objective (TESTA `models/testa_vqa.py` L101-L102).
        answer_loss (`torch.FloatTensor` of shape `(num_answers,)`, *optional*): label-smoothed LM loss of every
            answer, summed over its tokens.
        logits (`torch.FloatTensor` of shape `(num_answers, answer_length, vocab_size)`): decoder logits.
        question_embeds (`torch.FloatTensor` of shape `(batch, question_length, hidden_size)`): the video-grounded
            question states the decoder attends to.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
    """

    loss: torch.FloatTensor | None = None
    answer_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    question_embeds: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None


@dataclass
class TestaAnswerRankingOutput(ModelOutput):
    r"""
    Output of [`TestaForVideoQA.rank_answers`].

    Args:
        answer_indices (`torch.LongTensor` of shape `(batch,)`): the chosen answer (an index into the candidate list).
        topk_indices (`torch.LongTensor` of shape `(batch, k)`): the `k` candidates with the most probable first token.
        topk_log_likelihoods (`torch.FloatTensor` of shape `(batch, k)`): their teacher-forced log-likelihoods (minus
            the label-smoothed loss when `label_smoothing > 0`, as the released decoder's loss is, TESTA
            `models/med.py` L910).
        first_token_probs (`torch.FloatTensor` of shape `(batch, k)`): the first-token probabilities used to pick them.
    """

    answer_indices: torch.LongTensor | None = None
    topk_indices: torch.LongTensor | None = None
    topk_log_likelihoods: torch.FloatTensor | None = None
    first_token_probs: torch.FloatTensor | None = None


@dataclass
class TestaPreTrainingOutput(ModelOutput):
    r"""
    Output of [`TestaForPreTraining`].

    Args:
        loss (`torch.FloatTensor` of shape `()`, *optional*): `loss_vtc + loss_vtm + loss_cap`.
        loss_vtc, loss_vtm (`torch.FloatTensor` of shape `()`, *optional*): as in [`TestaVideoTextRetrievalOutput`].
        loss_cap (`torch.FloatTensor` of shape `()`, *optional*): label-smoothed captioning loss, mean over tokens.
        caption_logits (`torch.FloatTensor` of shape `(batch, sequence_length, vocab_size)`): decoder logits.
        itm_score (`torch.FloatTensor` of shape `(batch, 2)`): matching logits of the positive pairs.
        video_embeds (`torch.FloatTensor` of shape `(batch, tokens, hidden_size)`): the aggregated video tokens.
        negative_video_indices, negative_text_indices (`torch.LongTensor` of shape `(batch,)`, *optional*): as in
            [`TestaVideoTextRetrievalOutput`].
    """

    loss: torch.FloatTensor | None = None
    loss_vtc: torch.FloatTensor | None = None
    loss_vtm: torch.FloatTensor | None = None
    loss_cap: torch.FloatTensor | None = None
    caption_logits: torch.FloatTensor | None = None
    itm_score: torch.FloatTensor | None = None
    video_embeds: torch.FloatTensor | None = None
    negative_video_indices: torch.LongTensor | None = None
    negative_text_indices: torch.LongTensor | None = None


class TestaGenerationConfig(GenerationConfig):
    """`GenerationConfig` of the generative TESTA heads. `TestaConfig.temperature` is the contrastive temperature, not a
    sampling one, so it is not copied into the generation config (which would make sampled answers far too greedy)."""

    @classmethod
    def from_model_config(cls, model_config) -> GenerationConfig:
        config_dict = model_config.to_dict() if not isinstance(model_config, dict) else dict(model_config)
        config_dict.pop("temperature", None)
        return super().from_model_config(config_dict)


def generate_after_dec(
    model: "TestaForVideoQA | TestaForPreTraining",
    input_ids: torch.LongTensor,
    decoder_inputs: dict,
    generate_kwargs: dict,
) -> torch.LongTensor:
    """The one [DEC] generation of the heads with a text decoder (`TestaForVideoQA`, `TestaForPreTraining`):
    ``model.text_decoder`` continues ``input_ids`` ([DEC] first) cross-attending to ``decoder_inputs``, with the
    settings of ``model.generation_config`` (or of a ``generation_config`` in ``generate_kwargs``) and the other
    ``generate_kwargs`` on top. It stops at [SEP] and pads with [PAD] (`text_config`) unless the call says otherwise,
    as transformers' `BlipForQuestionAnswering.generate` does."""
    generate_kwargs = dict(generate_kwargs)
    generation_config = copy.deepcopy(generate_kwargs.pop("generation_config", None) or model.generation_config)
    text_config = model.config.text_config
    settings = {"eos_token_id": text_config.sep_token_id, "pad_token_id": text_config.pad_token_id}
    model_kwargs = generation_config.update(**{**settings, **generate_kwargs})
    return model.text_decoder.generate(
        input_ids=input_ids, generation_config=generation_config, **decoder_inputs, **model_kwargs
    )


# ----------------------------------------------------------------------------------------------------------------------
# Shared bases of the heads
# ----------------------------------------------------------------------------------------------------------------------


class _TestaMultimodalPreTrainedModel(TestaPreTrainedModel):
    """Base of the heads with BLIP text modules: video input handling and the extra initialisation they need."""

    config: TestaConfig
    main_input_name = "input_ids"  # `forward` takes the text first, as transformers' BLIP heads do
    _no_split_modules = ["TestaVisionLayer", "BlipTextLayer", "BlipTextEmbeddings"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, BlipTextEmbeddings):
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1]).expand((1, -1)))
        if isinstance(module, BlipTextLMPredictionHead):
            init.zeros_(module.bias)  # a bare parameter (tied to `decoder.bias`), which no module init covers
        if isinstance(module, MomentumContrast):
            # Deterministic, so that `from_pretrained` (which never loads training state) returns the same model
            # every time: empty queues, and momentum copies equal to the online weights (visited before them).
            module.reset()
            module.copy_weights_from(online_modules(self))
        if isinstance(module, _TestaContrastiveModel):
            init.constant_(module.temp, self.config.temperature)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, *args, **kwargs) -> nn.Embedding:
        """`PreTrainedModel.resize_token_embeddings`, refused when the new vocabulary would drop [ENC] or [DEC]
        (`config.enc_token_id`, `config.dec_token_id`): the video-grounded encoder and the decoder write them into
        their inputs, so the forward pass would index outside the embedding table."""
        special = max(self.config.enc_token_id, self.config.dec_token_id)
        if new_num_tokens is not None and new_num_tokens <= special:
            raise ValueError(
                f"resize_token_embeddings({new_num_tokens}) would drop the special tokens the model writes into its "
                f"inputs: [ENC] = {self.config.enc_token_id} and [DEC] = {self.config.dec_token_id} "
                f"(config.enc_token_id, config.dec_token_id). Keep at least {special + 1} tokens, or set those ids to "
                "tokens inside the new vocabulary first."
            )
        return super().resize_token_embeddings(new_num_tokens, *args, **kwargs)

    def _pad_token_id(self) -> int:
        return self.config.text_config.pad_token_id or 0

    def _video_inputs(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Accepts videos ``(B, T, C, H, W)``, or images ``(B, C, H, W)`` that become static videos of
        ``vision_config.num_frames`` repeated frames (how image-text pairs become videos for pre-training)."""
        if isinstance(pixel_values, torch.Tensor) and pixel_values.ndim == 4:
            frames = self.config.vision_config.num_frames
            pixel_values = pixel_values.unsqueeze(1).expand(-1, frames, -1, -1, -1)
        return pixel_values

    def set_aggregation(self, **settings) -> None:
        """Changes the aggregation settings (`TestaVisionModel.set_aggregation`) of the video encoder **and** of its
        momentum copy when the head has one, so that distillation targets and queue features come from the same
        token schedule as the online encoder. Validates first and leaves the model unchanged on error."""
        self.vision_model.set_aggregation(**settings)
        momentum = self._modules.get("momentum")
        if momentum is not None:
            momentum.vision_model.set_aggregation(**settings)
        for name, value in settings.items():
            setattr(self.config.vision_config, name, value)

    def get_input_embeddings(self) -> nn.Module:
        return self.text_encoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.text_encoder.set_input_embeddings(value)


TEMPERATURE_RANGE = (0.001, 0.5)
"""The range the learned contrastive temperature is kept in (`logit_scale`), as in the released training step."""


class _TestaContrastiveModel(_TestaMultimodalPreTrainedModel):
    """The inference API that retrieval and pre-training share: contrastive features, the matching (ITM) logits, the
    learned temperature (`logit_scale`) and two-stage ranking, plus the training entry points of their momentum
    contrast. Each head builds its encoders in its `__init__`, then the contrastive modules with
    `_add_contrastive_modules`, and computes its VTC and VTM losses with `contrastive.contrastive_losses`.
    """

    # Training state, never saved (`MomentumContrast` lists its keys as not to save; the released code drops the
    # queues on load as well); rebuilt deterministically on load. The position ids of the momentum text encoder are a
    # non-persistent buffer, not a key to ignore.
    _keys_to_ignore_on_load_missing = [r"^momentum\.(?!text_encoder\.embeddings\.position_ids$)"]

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        # accelerate `save_state` checkpoints of version 0.1 kept the momentum state on the head
        self.register_load_state_dict_pre_hook(
            lambda module, state_dict, prefix, *args: rename_legacy_keys(state_dict, prefix)
        )

    def _add_contrastive_modules(self, config: TestaConfig) -> None:
        """Builds the contrastive modules, after the head's encoders: `vision_proj`, `text_proj`, `itm_head`, `temp`
        and `momentum`, the same names (the state-dict keys) in the same order (the initialisation order) in every
        contrastive head."""
        vision_width, text_width = config.vision_config.hidden_size, config.text_config.hidden_size
        self.vision_proj = nn.Linear(vision_width, config.projection_dim)
        self.text_proj = nn.Linear(text_width, config.projection_dim)
        self.itm_head = nn.Linear(text_width, 2)
        self.temp = nn.Parameter(torch.tensor(config.temperature))
        # frozen EMA copies that produce the distillation targets and the queue features (training state)
        self.momentum = MomentumContrast(config)

    # ------------------------------------------------------------------------------------------ training entry points

    def start_momentum(self) -> None:
        """Starts momentum contrast (`MomentumContrast.start`): the momentum copies take the online weights and the
        queues random unit vectors, as the released code does at construction. The training loop calls it before the
        first step; otherwise the first training forward does."""
        self.momentum.start(online_modules(self))

    def defer_momentum_updates(self, enabled: bool = True) -> None:
        """Training forwards only collect their momentum features; `momentum_step` (once per optimiser step) does
        the EMA and the enqueue. See `MomentumContrast.defer_updates`."""
        self.momentum.defer_updates(enabled)

    def momentum_step(self) -> None:
        """Enqueues the momentum features collected since the last optimiser step, then moves the momentum copies
        towards the updated weights (deferred mode, see `defer_momentum_updates`)."""
        self.momentum.step(online_modules(self))

    # ---------------------------------------------------------------------------------------------------- features

    def logit_scale(self) -> torch.Tensor:
        """The contrastive temperature: the learned `temp` clamped to `TEMPERATURE_RANGE`. Cosine similarities are
        divided by it in the contrastive loss, in hard-negative sampling and in zero-shot classification."""
        return self.temp.clamp(*TEMPERATURE_RANGE)

    @can_return_tuple
    def get_text_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        r"""
        Text embeddings for the contrastive (first) stage of retrieval, as transformers' CLIP and BLIP return them.

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised texts; keep the tokenizer's [CLS]
                first ([ENC] is only for the video-grounded encoder).
            attention_mask (`torch.LongTensor`, *optional*): their attention mask.
            output_hidden_states (`bool`, *optional*): also return the text encoder's hidden states.
            output_attentions (`bool`, *optional*): also return the text encoder's attention weights.
            return_dict (`bool`, *optional*): a tuple instead of the output when `False`.

        Returns:
            `BaseModelOutputWithPooling`: `pooler_output` `(batch, projection_dim)` holds the **L2-normalised**
            embeddings (`text_proj` of the first token; cosine similarity is their dot product);
            `last_hidden_state` the unimodal text encoder's states.
        """
        check_input_ids(input_ids)
        # only explicit flags are passed: BlipTextModel takes `None` as "off", not as "use the config"
        flags = {name: value for name, value in (("output_hidden_states", output_hidden_states),
                                                 ("output_attentions", output_attentions)) if value is not None}
        outputs = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **flags)
        embeds = F.normalize(self.text_proj(outputs.last_hidden_state[:, 0]), dim=-1)
        return BaseModelOutputWithPooling(
            last_hidden_state=outputs.last_hidden_state, pooler_output=embeds, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def get_video_tokens(self, pixel_values: torch.Tensor, **kwargs) -> TestaVisionModelOutput:
        """Runs the video encoder once; cache ``last_hidden_state`` and ``token_sizes`` for `get_video_features` and
        the two-stage `rank_videos`/`rank_texts` (the merged tokens are what the ITM head cross-attends to)."""
        return self.vision_model(self._video_inputs(pixel_values), **kwargs)

    @can_return_tuple
    def get_video_features(
        self,
        pixel_values: torch.Tensor | None = None,
        video_tokens: torch.Tensor | None = None,
        video_token_sizes: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        r"""
        Video embeddings for the contrastive (first) stage of retrieval, as transformers' CLIP and BLIP return image
        features.

        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`, *optional*): the
                videos (images `(batch, channels, height, width)` count as static videos).
            video_tokens (`torch.FloatTensor` of shape `(batch, tokens, hidden)`, *optional*): cached encoder output
                (`get_video_tokens(...).last_hidden_state`) instead of `pixel_values`.
            video_token_sizes (`torch.FloatTensor` of shape `(batch, tokens)`, *optional*): with `video_tokens`, their
                sizes (needed for `video_pooling="weighted_mean"`).
            output_hidden_states (`bool`, *optional*): with `pixel_values`, also return the encoder's hidden states.
            output_attentions (`bool`, *optional*): with `pixel_values`, also return the encoder's attention per block
                (spatial attention for divided blocks; see [`TestaVisionModelOutput`] for the shapes).
            return_dict (`bool`, *optional*): a tuple instead of the output when `False`.

        Returns:
            `BaseModelOutputWithPooling`: `pooler_output` `(batch, projection_dim)` holds the **L2-normalised**
            embeddings (`vision_proj` of the pooled tokens, ``config.video_pooling``; the released checkpoints use the
            plain mean over all output tokens, TESTA `models/testa_retrieval.py` L113); `last_hidden_state` the aggregated video tokens.
        """
        if (pixel_values is None) == (video_tokens is None):
            raise ValueError("Pass exactly one of `pixel_values` and `video_tokens` to `get_video_features`.")
        hidden_states = attentions = None
        if pixel_values is not None:
            out = self.get_video_tokens(
                pixel_values, output_hidden_states=output_hidden_states, output_attentions=output_attentions
            )
            video_tokens, video_token_sizes = out.last_hidden_state, out.token_sizes
            hidden_states, attentions = out.hidden_states, out.attentions
        video_tokens = video_tokens.to(self.vision_proj.weight.dtype)
        pooled = pool_video_tokens(video_tokens, video_token_sizes, self.config.video_pooling)
        embeds = F.normalize(self.vision_proj(pooled), dim=-1)
        return BaseModelOutputWithPooling(last_hidden_state=video_tokens, pooler_output=embeds,
                                          hidden_states=hidden_states, attentions=attentions)

    def itm_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, video_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Matching logits ``(batch, 2)`` (index 1 = match) of paired texts and videos, and the video-grounded text
        states. The first text token becomes [ENC] here; every video token is attended to (all-ones mask).

        Adapted from TESTA `models/testa_retrieval.py` L159-L170 (the positive pairs of `TESTA_Retrieval.forward`)."""
        states = self.text_encoder(
            input_ids=_with_first_token(input_ids, self.config.enc_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).last_hidden_state
        return self.itm_head(states[:, 0]), states

    # ------------------------------------------------------------------------------------------------------ losses

    @staticmethod
    def sample_hard_negatives(weights: torch.Tensor) -> torch.Tensor:
        """Draws one negative per row of the ``(rows, candidates)`` sampling weights (``torch.multinomial``, as in the
        released code). Override it for another sampler, e.g. a seeded or deterministic one."""
        return sample_hard_negatives(weights)

    @torch.no_grad()
    def hard_negative_weights(
        self, video_feat: torch.Tensor, text_feat: torch.Tensor, video_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The VTM sampling weights of the local rows over the candidate set: ``softmax(sim / temp)`` with every pair
        sharing a video id (or the pair itself) set to 0. With ``negative_all_rank`` the candidates are the batch
        gathered over all processes, otherwise the local batch. Returns ``(video->text, text->video)`` weights (see
        `contrastive.hard_negative_sampling_weights`)."""
        return hard_negative_sampling_weights(video_feat, text_feat, video_ids, self.temp, self.config.negative_all_rank)

    # ------------------------------------------------------------------------------------------- two-stage ranking

    @torch.no_grad()
    def _rank(
        self,
        queries_are_texts: bool,
        input_ids: torch.Tensor,
        video_tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        video_token_sizes: torch.Tensor | None = None,
        text_features: torch.Tensor | None = None,
        video_features: torch.Tensor | None = None,
        k: int | None = None,
        itm_score: str = "logit",
        add_cosine: bool = True,
        batch_size: int = 128,
    ) -> TestaRankingOutput:
        """Checks the inputs of `rank_videos`/`rank_texts`, embeds what was not given, and ranks with
        `ranking.two_stage_scores`."""
        check_input_ids(input_ids)
        if not isinstance(video_tokens, torch.Tensor) or video_tokens.ndim != 3:
            raise ValueError("`video_tokens` must be the cached (num_videos, tokens, hidden) encoder output.")
        options = RankingOptions(k=self.config.k_test if k is None else k, itm_score=itm_score,
                                 add_cosine=add_cosine, batch_size=batch_size)
        num_texts, num_videos = input_ids.shape[0], video_tokens.shape[0]
        for name, value, rows, unit in (("attention_mask", attention_mask, num_texts, "text"),
                                        ("text_features", text_features, num_texts, "text"),
                                        ("video_features", video_features, num_videos, "video"),
                                        ("video_token_sizes", video_token_sizes, num_videos, "video")):
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape[0] != rows):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"`{name}` must have one row per {unit} ({rows}), got {shape}.")
        num_queries, num_candidates = (num_texts, num_videos) if queries_are_texts else (num_videos, num_texts)
        if num_candidates == 0:
            empty = "video_tokens` holds no video" if queries_are_texts else "input_ids` holds no text"
            raise ValueError(f"Nothing to rank against: `{empty}.")
        device, dtype = self.device, self.dtype
        if num_queries == 0:
            # This process's share of the queries is empty (fewer queries than processes, e.g. with accelerate's
            # `split_between_processes`): empty outputs of the right widths, so that gathering them just works.
            k = min(options.k, num_candidates)
            empty = torch.empty(0, num_candidates, device=device, dtype=dtype)
            return TestaRankingOutput(
                scores=empty,
                similarity=empty.clone(),
                topk_indices=torch.empty(0, k, device=device, dtype=torch.long),
                topk_scores=torch.empty(0, k, device=device, dtype=dtype),
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if text_features is None:
            text_features = torch.cat(
                [
                    self.get_text_features(input_ids[i : i + batch_size], attention_mask[i : i + batch_size]).pooler_output
                    for i in range(0, input_ids.shape[0], batch_size)
                ]
            )
        if video_features is None:
            chunks = []
            for i in range(0, video_tokens.shape[0], batch_size):
                sizes = None if video_token_sizes is None else video_token_sizes[i : i + batch_size].to(device)
                tokens = video_tokens[i : i + batch_size].to(device)
                chunks.append(self.get_video_features(video_tokens=tokens, video_token_sizes=sizes).pooler_output)
            video_features = torch.cat(chunks)
        return two_stage_scores(
            self, queries_are_texts=queries_are_texts, input_ids=input_ids, attention_mask=attention_mask,
            text_features=text_features, video_features=video_features, read_tokens=video_tokens.__getitem__,
            options=options,
        )

    def rank_videos(
        self, input_ids: torch.Tensor, video_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, **options
    ) -> TestaRankingOutput:
        r"""
        Text-to-video retrieval in two stages, as the released evaluation ranks (see `ranking.py`): the cosine
        similarity of the VTC embeddings picks the top-``k`` videos of every text (``k`` defaults to
        ``config.k_test``), then the ITM head re-scores those pairs. The final score is the ITM match logit plus the
        cosine (original); ``itm_score="softmax"`` uses the match probability instead, and ``add_cosine=False`` drops
        the cosine.

        Memory is bounded by ``batch_size`` pairs: only their video tokens are gathered (and moved to the model's
        device) at a time, so ``video_tokens`` can stay on the CPU (e.g. in fp16).

        No query (e.g. a process's empty share when there are fewer queries than processes) gives empty outputs of
        the right widths (``(0, num_videos)`` scores), so that the shares can be gathered; no candidate raises.

        Args:
            input_ids (`torch.LongTensor` of shape `(num_texts, length)`): tokenised queries, [CLS] first.
            video_tokens (`torch.FloatTensor` of shape `(num_videos, tokens, hidden)`): cached `get_video_tokens`
                outputs (``last_hidden_state``).
            attention_mask (`torch.LongTensor`, *optional*): the texts' attention mask.
            video_token_sizes (`torch.FloatTensor` of shape `(num_videos, tokens)`, *optional*): needed for
                ``video_pooling="weighted_mean"``.
            text_features, video_features (`torch.FloatTensor`, *optional*): precomputed normalised embeddings.
            k (`int`, *optional*): candidates re-ranked per query (defaults to ``config.k_test``).
            itm_score (`str`, defaults to `"logit"`), add_cosine (`bool`, defaults to `True`): how a re-ranked pair
                is scored.
            batch_size (`int`, defaults to 128): (text, video) pairs per matching-head forward.
        """
        return self._rank(True, input_ids, video_tokens, attention_mask, **options)

    def rank_texts(
        self, input_ids: torch.Tensor, video_tokens: torch.Tensor, attention_mask: torch.Tensor | None = None, **options
    ) -> TestaRankingOutput:
        """Video-to-text retrieval in two stages; the arguments are those of `rank_videos`, and the outputs are
        ``(num_videos, num_texts)``."""
        return self._rank(False, input_ids, video_tokens, attention_mask, **options)


# ----------------------------------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------------------------------


class TestaForVideoTextRetrieval(_TestaContrastiveModel):
    r"""
    TESTA for video-text retrieval: the TESTA video encoder, BLIP's BERT text encoder (with cross-attention), the
    `vision_proj`/`text_proj` contrastive projections and the `itm_head` matching head. Parameter names equal
    transformers' [`BlipForImageTextRetrieval`] for the text side and the heads, so BLIP weights map one to one (see
    `convert_blip_to_testa`).

    The video embedding is `vision_proj` of the **unweighted mean over all output tokens** (CLS included), which is
    what the released TESTA checkpoints were trained with (`config.video_pooling="mean"`, TESTA
    `models/testa_retrieval.py` L113); `"weighted_mean"` weights
    every token by the number of patches it stands for, `"cls"` takes the CLS token like image BLIP.

    The momentum encoder and queues (`self.momentum`, a `MomentumContrast`) and the `temp` clamp are training state:
    they are in the state dict (so `accelerate.save_state` resumes them) but not in `save_pretrained` checkpoints,
    and the momentum encoder is re-synchronised from the online weights at the first training step after loading.
    """

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self._add_contrastive_modules(config)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        use_itm_head: bool = True,
        return_loss: bool = False,
        video_ids: torch.LongTensor | None = None,
        alpha: float | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
    ) -> TestaVideoTextRetrievalOutput:
        r"""
        Mirrors [`BlipForImageTextRetrieval.forward`].

        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised texts with the tokenizer's [CLS]
                first. For the ITM head the model replaces it by [ENC] (`config.enc_token_id`), as the released code
                does (TESTA `models/testa_retrieval.py` L161); transformers' BLIP leaves that to the caller (transformers issue #22732).
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the videos; images
                `(batch, channels, height, width)` are taken as static videos of `vision_config.num_frames` frames.
            attention_mask (`torch.LongTensor`, *optional*): the texts' attention mask.
            use_itm_head (`bool`, defaults to `True`): return the ITM logits of the pairs; otherwise the cosine
                similarity of every video with every text.
            return_loss (`bool`, defaults to `False`): compute the fine-tuning loss VTC + VTM on the batch of pairs.
            video_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): with a loss, the video id of every pair;
                all pairs (and queue entries) with the same id are positives. Without it, only the pair itself is.
            alpha (`float`, *optional*): distillation weight for this step (defaults to `config.alpha`; the released
                training ramps it up linearly during the first epoch, TESTA `train_video_retrieval.py` L129-L132).
            output_hidden_states (`bool`, *optional*): return the video encoder's hidden states.
            output_attentions (`bool`, *optional*): return the video encoder's attention per block.
        """
        check_input_ids(input_ids)
        pixel_values = self._video_inputs(pixel_values)
        vision = self.vision_model(
            pixel_values, output_hidden_states=output_hidden_states, output_attentions=output_attentions
        )
        video_embeds, token_sizes = vision.last_hidden_state, vision.token_sizes
        loss = loss_vtc = loss_vtm = neg_videos = neg_texts = None
        if return_loss:
            loss_vtc, loss_vtm, itm_score, neg_videos, neg_texts = contrastive_losses(
                self, input_ids, attention_mask, pixel_values, video_embeds, token_sizes, video_ids, alpha
            )
            loss = loss_vtc + loss_vtm
            question_embeds = None
        elif use_itm_head:
            if video_embeds.shape[0] != input_ids.shape[0]:
                raise ValueError(
                    f"The ITM head scores (text, video) pairs: got {input_ids.shape[0]} texts and "
                    f"{video_embeds.shape[0]} videos. Use `use_itm_head=False` or `rank_videos` for all pairs."
                )
            itm_score, question_embeds = self.itm_logits(input_ids, attention_mask, video_embeds)
        else:
            question_embeds = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            text_feat = F.normalize(self.text_proj(question_embeds[:, 0]), dim=-1)
            pooled = pool_video_tokens(video_embeds, token_sizes, self.config.video_pooling)
            video_feat = F.normalize(self.vision_proj(pooled), dim=-1)
            itm_score = video_feat @ text_feat.T
        return TestaVideoTextRetrievalOutput(
            loss=loss,
            loss_vtc=loss_vtc,
            loss_vtm=loss_vtm,
            itm_score=itm_score,
            video_embeds=video_embeds,
            video_token_sizes=token_sizes,
            question_embeds=question_embeds,
            negative_video_indices=neg_videos,
            negative_text_indices=neg_texts,
            vision_hidden_states=vision.hidden_states,
            vision_attentions=vision.attentions,
            vision_temporal_attentions=vision.temporal_attentions,
        )


class TestaForVideoQA(_TestaMultimodalPreTrainedModel, GenerationMixin):
    r"""
    TESTA for open-ended video question answering: the question, with [ENC] as its first token, is encoded by
    `text_encoder` with cross-attention to the video tokens; the answer decoder `text_decoder` (a
    [`BlipTextLMHeadModel`]) cross-attends to the question states. Parameter names equal transformers'
    [`BlipForQuestionAnswering`].

    Answers are produced either by `generate()` or by ranking a candidate list with `rank_answers()` (the released
    `inference: rank`: top-k candidates by first-token probability, then the full log-likelihood).
    """

    generation_config_class = TestaGenerationConfig
    _tied_weights_keys = {
        "text_decoder.cls.predictions.decoder.bias": "text_decoder.cls.predictions.bias",
        "text_decoder.cls.predictions.decoder.weight": "text_decoder.bert.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_decoder = BlipTextLMHeadModel(config.text_config)
        self.post_init()

    def encode_question(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(question_states, question_attention_mask, video_tokens)``; [ENC] replaces the first token."""
        check_input_ids(input_ids)
        video_embeds = self.vision_model(self._video_inputs(pixel_values)).last_hidden_state
        if video_embeds.shape[0] != input_ids.shape[0]:
            raise ValueError(f"Got {input_ids.shape[0]} questions but {video_embeds.shape[0]} videos.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        states = self.text_encoder(
            input_ids=_with_first_token(input_ids, self.config.enc_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).last_hidden_state
        return states, attention_mask, video_embeds

    def answer_logits(
        self,
        answer_ids: torch.Tensor,
        answer_mask: torch.Tensor | None,
        question_states: torch.Tensor,
        question_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Teacher-forced decoder logits ``(num_answers, length, vocab)`` of answers given the video-grounded question
        states (`encode_question`); the first answer token becomes [DEC]."""
        return self.text_decoder(
            input_ids=_with_first_token(answer_ids, self.config.dec_token_id),
            attention_mask=answer_mask,
            encoder_hidden_states=question_states,
            encoder_attention_mask=question_mask,
        ).logits

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.LongTensor | None = None,
        answer_weights: torch.FloatTensor | None = None,
        num_answers: torch.LongTensor | list[int] | None = None,
    ) -> TestaVideoQAOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised questions ([CLS] first; the model
                puts [ENC] there).
            pixel_values (`torch.FloatTensor` of shape `(batch, frames, channels, height, width)`): the videos.
            attention_mask (`torch.LongTensor`, *optional*): the questions' attention mask.
            labels (`torch.LongTensor` of shape `(num_answers, answer_length)`, *optional*): tokenised answers
                ([CLS] ... [SEP]; the model puts [DEC] first). Padding (where `decoder_attention_mask` is 0, or
                `pad_token_id`/-100 without a mask) is ignored. Gives the loss.
            decoder_input_ids (`torch.LongTensor`, *optional*): decoder inputs without a loss (defaults to `labels`).
            decoder_attention_mask (`torch.LongTensor`, *optional*): the answers' attention mask.
            answer_weights (`torch.FloatTensor` of shape `(num_answers,)`, *optional*): weight of every answer
                (defaults to 1). The loss is `sum(weight * answer_loss) / batch`.
            num_answers (`torch.LongTensor` or `list[int]` of length `batch`, *optional*): how many consecutive
                answers belong to each question (defaults to one each).

        Adapted from TESTA `models/testa_vqa.py` L68-L103 (`TESTA_VQA.forward`, training).
        """
        if labels is None and decoder_input_ids is None:
            raise ValueError(
                "TestaForVideoQA.forward needs `labels` (training) or `decoder_input_ids`; use `generate()` or "
                "`rank_answers()` for inference."
            )
        answer_ids = decoder_input_ids if decoder_input_ids is not None else labels
        check_input_ids(answer_ids, "labels" if decoder_input_ids is None else "decoder_input_ids")
        answer_ids = answer_ids.masked_fill(answer_ids == -100, self._pad_token_id())
        question_states, question_mask, video_embeds = self.encode_question(input_ids, pixel_values, attention_mask)
        batch = input_ids.shape[0]
        counts = torch.ones(batch, dtype=torch.long) if num_answers is None else torch.as_tensor(num_answers).view(-1)
        if counts.shape[0] != batch or int(counts.sum()) != answer_ids.shape[0] or (counts < 1).any():
            raise ValueError(
                f"`num_answers` must give >= 1 answer for each of the {batch} questions and sum to the "
                f"{answer_ids.shape[0]} answers in `labels`; got {counts.tolist()}."
            )
        counts = counts.to(question_states.device)
        states = question_states.repeat_interleave(counts, dim=0)
        mask = question_mask.repeat_interleave(counts, dim=0)
        logits = self.answer_logits(answer_ids, decoder_attention_mask, states, mask)
        loss = answer_loss = None
        if labels is not None:
            answer_mask = decoder_attention_mask
            if answer_mask is None:
                answer_mask = labels.ne(-100) & labels.ne(self._pad_token_id())
            answer_loss = sequence_nll(
                logits, answer_ids, answer_mask, self._pad_token_id(), self.config.label_smoothing
            )
            if answer_weights is None:
                answer_weights = torch.ones_like(answer_loss)
            answer_weights = torch.as_tensor(answer_weights, device=answer_loss.device, dtype=answer_loss.dtype)
            answer_weights = answer_weights.view(-1)
            if answer_weights.shape != answer_loss.shape:
                raise ValueError(
                    f"`answer_weights` must hold one weight per answer ({answer_loss.shape[0]}), got "
                    f"{tuple(answer_weights.shape)}."
                )
            loss = (answer_weights * answer_loss).sum() / batch
        return TestaVideoQAOutput(
            loss=loss,
            answer_loss=answer_loss,
            logits=logits,
            question_embeds=question_states,
            video_embeds=video_embeds,
        )

    @torch.no_grad()
    def rank_answers(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        answer_ids: torch.LongTensor,
        attention_mask: torch.LongTensor | None = None,
        answer_attention_mask: torch.LongTensor | None = None,
        k: int | None = None,
        label_smoothing: float | None = None,
        batch_size: int = 512,
    ) -> TestaAnswerRankingOutput:
        r"""
        Picks an answer from a candidate list: the decoder's first-step distribution
        after [DEC] selects the ``k`` candidates whose first token is most probable (``k`` defaults to
        ``config.k_test``), then each is scored by its teacher-forced log-likelihood and the best one wins.

        Args:
            answer_ids (`torch.LongTensor` of shape `(num_candidates, length)`): the tokenised candidate answers.
            answer_attention_mask (`torch.LongTensor`, *optional*): their attention mask (defaults to non-pad).
            label_smoothing (`float`, *optional*): smoothing of the likelihood score; defaults to
                `config.label_smoothing`, which the released code used here too. Use 0.0 for the exact log-likelihood.
            batch_size (`int`, defaults to 512): candidate sequences decoded at a time.

        Adapted from TESTA `models/testa_vqa.py` L138-L185 (`TESTA_VQA.rank_answer`).
        """
        check_input_ids(answer_ids, "answer_ids")
        if answer_ids.shape[1] < 2:
            raise ValueError("`answer_ids` need at least two tokens ([CLS]/[DEC] and the first answer token).")
        smoothing = self.config.label_smoothing if label_smoothing is None else label_smoothing
        pad = self._pad_token_id()
        if answer_attention_mask is None:
            answer_attention_mask = answer_ids.ne(pad).long()
            answer_attention_mask[:, 0] = 1
        states, mask, _ = self.encode_question(input_ids, pixel_values, attention_mask)
        batch, device = states.shape[0], states.device
        answer_ids, answer_attention_mask = answer_ids.to(device), answer_attention_mask.to(device)
        start = torch.full((batch, 1), self.config.dec_token_id, dtype=torch.long, device=device)
        first_logits = self.text_decoder(
            input_ids=start, encoder_hidden_states=states, encoder_attention_mask=mask
        ).logits[:, 0]
        first_probs = first_logits.float().softmax(dim=-1).index_select(1, answer_ids[:, 1])
        k = min(self.config.k_test if k is None else k, answer_ids.shape[0])
        topk_probs, topk_indices = first_probs.topk(k, dim=1)
        question_index = torch.arange(batch, device=device).repeat_interleave(k)
        candidates = topk_indices.flatten()
        scores = []
        for i in range(0, candidates.shape[0], batch_size):
            q, c = question_index[i : i + batch_size], candidates[i : i + batch_size]
            logits = self.answer_logits(answer_ids[c], answer_attention_mask[c], states[q], mask[q])
            scores.append(-sequence_nll(logits, answer_ids[c], answer_attention_mask[c], pad, smoothing))
        log_likelihoods = torch.cat(scores).view(batch, k)
        best = log_likelihoods.argmax(dim=1)
        return TestaAnswerRankingOutput(
            answer_indices=topk_indices.gather(1, best[:, None]).squeeze(1),
            topk_indices=topk_indices,
            topk_log_likelihoods=log_likelihoods,
            first_token_probs=topk_probs,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        **generate_kwargs,
    ) -> torch.LongTensor:
        r"""
        Generates answers: the decoder starts from [DEC] and stops at [SEP] (`text_config.sep_token_id`), with the
        settings of `self.generation_config` (greedy by default) and `generate_kwargs` on top. The released code
        generates with `num_beams=3, max_length=10` (TESTA `models/testa_vqa.py` L111-L124), the defaults of the
        question answering pipeline.

        Args:
            input_ids, pixel_values, attention_mask: as in `forward`.
            **generate_kwargs: passed to the decoder's `generate` (`max_new_tokens`, `num_beams`, a
                `generation_config`, ...).
        """
        states, mask, _ = self.encode_question(input_ids, pixel_values, attention_mask)
        return self.generate_from_question(states, mask, **generate_kwargs)

    @torch.no_grad()
    def generate_from_question(
        self, question_states: torch.Tensor, question_mask: torch.Tensor, **generate_kwargs
    ) -> torch.LongTensor:
        """`generate` from video-grounded question states (`encode_question`), so that a caller that also scores
        the answers (`answer_log_likelihoods`) encodes the question once."""
        start = torch.full(
            (question_states.shape[0], 1), self.config.dec_token_id, dtype=torch.long, device=question_states.device
        )
        return generate_after_dec(
            self, start, {"encoder_hidden_states": question_states, "encoder_attention_mask": question_mask},
            generate_kwargs,
        )

    @torch.no_grad()
    def start_decoder_from_text_encoder(self) -> list[str]:
        """Starts an answer decoder that the checkpoint lacked (a QA head loaded from a retrieval folder) from the text
        encoder's weights, as BLIP starts its decoder from the pre-trained text model: both are BERT layouts with
        cross-attention, so embeddings, self-attention, cross-attention and feed-forward carry over (the LM head's
        output layer is tied to the word embeddings; only its transform and bias stay freshly initialised). A random
        decoder learns one constant answer within a small training budget.

        Copies ``text_encoder.X`` into every missing ``text_decoder.bert.X`` of the same shape and returns the decoder
        names copied (which then leave ``weights_missing_at_load``); a head whose checkpoint held its decoder is left
        as it is.
        """
        missing = set(getattr(self, "weights_missing_at_load", ()))
        if not missing:
            return []
        encoder = self.text_encoder.state_dict()
        decoder = dict(self.text_decoder.bert.named_parameters())
        decoder.update(self.text_decoder.bert.named_buffers())
        copied = []
        for name, target in decoder.items():
            key = f"text_decoder.bert.{name}"
            if key in missing and name in encoder and encoder[name].shape == target.shape:
                target.copy_(encoder[name])
                copied.append(key)
        self.weights_missing_at_load = tuple(sorted(missing - set(copied)))
        return copied

    @torch.no_grad()
    def answer_log_likelihoods(
        self, answer_ids: torch.Tensor, question_states: torch.Tensor, question_mask: torch.Tensor
    ) -> torch.Tensor:
        """The log-likelihood ``(num_answers,)`` of answers (e.g. `generate`'s sequences, [DEC] first) given the
        question states of each answer's question (`encode_question`, one row per answer): the sum of the decoder's
        log-probabilities of the answer tokens up to and including the first [SEP]; what follows it is ignored."""
        sep = self.config.text_config.sep_token_id
        seps_so_far = (answer_ids == sep).long().cumsum(dim=1)
        mask = (seps_so_far == 0) | ((seps_so_far == 1) & (answer_ids == sep))
        mask[:, 0] = True
        logits = self.answer_logits(answer_ids, mask.long(), question_states, question_mask)
        return sequence_log_likelihood(logits, answer_ids, mask)


# Encoder/decoder sharing (everything but self-attention), as a pattern over parameter names after the model prefix.
_SHARED_TEXT_MODULES = (
    r"(embeddings\.(word_embeddings|position_embeddings|LayerNorm)"
    r"|encoder\.layer\.\d+\.(crossattention|intermediate|output))\."
)


class TestaForPreTraining(_TestaContrastiveModel, GenerationMixin):
    r"""
    TESTA pre-training (paper appendix, BLIP-style): VTC + VTM + CAP.

    - VTC and VTM as in [`TestaForVideoTextRetrieval`] (momentum distillation, queue, hard negatives).
    - CAP: captioning loss of `text_decoder` ([DEC] first) cross-attending to the video tokens, label-smoothed.
    - The text encoder and decoder share everything but self-attention (embeddings, cross-attention and feed-forward
      layers), as BLIP does; the decoder's output embedding is tied to the word embeddings.
    - Image-text pairs are accepted as static videos (`pixel_values` of shape `(batch, channels, height, width)`).

    `generate()` captions videos.
    """

    generation_config_class = TestaGenerationConfig
    _tied_weights_keys = {
        "text_decoder\\.bert\\." + _SHARED_TEXT_MODULES: "text_encoder\\." + _SHARED_TEXT_MODULES,
        "text_decoder.cls.predictions.decoder.bias": "text_decoder.cls.predictions.bias",
        "text_decoder.cls.predictions.decoder.weight": "text_decoder.bert.embeddings.word_embeddings.weight",
    }

    def __init__(self, config: TestaConfig):
        super().__init__(config)
        self.vision_model = TestaVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_decoder = BlipTextLMHeadModel(config.text_config)
        self._share_encoder_decoder()
        self._add_contrastive_modules(config)
        self.post_init()

    def _share_encoder_decoder(self) -> None:
        """BLIP's ``tie_encoder_decoder_weights(text_encoder, text_decoder.bert, '', '/attention')`` (TESTA
        `models/blip_pretrain.py` L96 and L568-L620): the decoder uses the encoder's modules for everything except
        self-attention."""
        decoder = self.text_decoder.bert
        decoder.embeddings = self.text_encoder.embeddings
        for encoder_layer, decoder_layer in zip(self.text_encoder.encoder.layer, decoder.encoder.layer):
            decoder_layer.crossattention = encoder_layer.crossattention
            decoder_layer.intermediate = encoder_layer.intermediate
            decoder_layer.output = encoder_layer.output

    def _caption_logits(self, input_ids, attention_mask, video_embeds) -> torch.Tensor:
        return self.text_decoder(
            input_ids=_with_first_token(input_ids, self.config.dec_token_id),
            attention_mask=attention_mask,
            encoder_hidden_states=video_embeds,
        ).logits

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.LongTensor | None = None,
        video_ids: torch.LongTensor | None = None,
        alpha: float | None = None,
        return_loss: bool = True,
    ) -> TestaPreTrainingOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch, length)`): tokenised captions ([CLS] first; the model
                uses [ENC] for VTM and [DEC] for captioning).
            pixel_values (`torch.FloatTensor`): videos `(batch, frames, channels, height, width)` or images
                `(batch, channels, height, width)` (static videos of `vision_config.num_frames` frames).
            attention_mask (`torch.LongTensor`, *optional*): the captions' attention mask.
            video_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): positives for VTC by id (pre-training
                uses one positive per pair: leave it out).
            alpha (`float`, *optional*): distillation weight for this step (defaults to `config.alpha`).
            return_loss (`bool`, defaults to `True`): compute VTC + VTM + CAP; otherwise only the caption logits and
                the ITM logits of the pairs.

        Adapted from TESTA `models/blip_pretrain.py` L98-L244 (`BLIP_Pretrain.forward`; the captioning loss is
        L230-L243); VTC and VTM as in `contrastive`.
        """
        check_input_ids(input_ids)
        pixel_values = self._video_inputs(pixel_values)
        vision = self.vision_model(pixel_values)
        video_embeds, token_sizes = vision.last_hidden_state, vision.token_sizes
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        caption_logits = self._caption_logits(input_ids, attention_mask, video_embeds)
        loss = loss_vtc = loss_vtm = loss_cap = neg_videos = neg_texts = None
        if return_loss:
            loss_vtc, loss_vtm, itm_score, neg_videos, neg_texts = contrastive_losses(
                self, input_ids, attention_mask, pixel_values, video_embeds, token_sizes, video_ids, alpha
            )
            pad = self._pad_token_id()
            nll = sequence_nll(caption_logits, input_ids, attention_mask, pad, self.config.label_smoothing)
            loss_cap = nll.sum() / attention_mask[:, 1:].sum().clamp(min=1)
            loss = loss_vtc + loss_vtm + loss_cap
        else:
            itm_score, _ = self.itm_logits(input_ids, attention_mask, video_embeds)
        return TestaPreTrainingOutput(
            loss=loss,
            loss_vtc=loss_vtc,
            loss_vtm=loss_vtm,
            loss_cap=loss_cap,
            caption_logits=caption_logits,
            itm_score=itm_score,
            video_embeds=video_embeds,
            negative_video_indices=neg_videos,
            negative_text_indices=neg_texts,
        )

    @torch.no_grad()
    def generate(
        self,
        pixel_values: torch.FloatTensor,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.LongTensor | None = None,
        **generate_kwargs,
    ) -> torch.LongTensor:
        r"""
        Captions videos with the decoder, which starts from [DEC] and stops at [SEP].

        Args:
            pixel_values (`torch.FloatTensor`): the videos (or images).
            input_ids (`torch.LongTensor`, *optional*): a tokenised prompt ([CLS] ... [SEP]); as in
                [`BlipForConditionalGeneration.generate`], its first token becomes [DEC] and its last token ([SEP])
                is dropped.
            attention_mask (`torch.LongTensor`, *optional*): the prompt's attention mask.
            **generate_kwargs: passed to the decoder's `generate`.
        """
        video_embeds = self.vision_model(self._video_inputs(pixel_values)).last_hidden_state
        batch = video_embeds.shape[0]
        if input_ids is None:
            input_ids = torch.full((batch, 1), self.config.dec_token_id, dtype=torch.long, device=video_embeds.device)
        else:
            check_input_ids(input_ids)
            input_ids = _with_first_token(input_ids, self.config.dec_token_id)[:, :-1]
            attention_mask = attention_mask[:, :-1] if attention_mask is not None else None
        return generate_after_dec(
            self, input_ids, {"attention_mask": attention_mask, "encoder_hidden_states": video_embeds}, generate_kwargs
        )


__all__ = [
    "TestaAnswerRankingOutput",
    "TestaForPreTraining",
    "TestaForVideoQA",
    "TestaForVideoTextRetrieval",
    "TestaPreTrainedModel",
    "TestaPreTrainingOutput",
    "TestaRankingOutput",
    "TestaVideoQAOutput",
    "TestaVideoTextRetrievalOutput",
    "TestaVisionModel",
    "TestaVisionModelOutput",
    "check_input_ids",
    "token_schedule",
]
