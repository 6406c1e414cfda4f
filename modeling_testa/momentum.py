"""Momentum contrast (ALBEF/BLIP) as a component the contrastive heads hold: frozen EMA copies of the online video
encoder, text encoder and projections, and the feature queues of the contrastive loss.

The heads (`TestaForVideoTextRetrieval`, `TestaForPreTraining`) keep it as ``model.momentum``. It is training state:
it is in the state dict (so `accelerate.save_state` resumes it) but not in `save_pretrained` checkpoints. A fresh or
loaded model holds it in a fixed state (copies equal to the online weights, empty queues), so that `from_pretrained`
is deterministic; `start` (called by the training loop, else by the first training forward) fills the queues with
random unit vectors, as the released code does at construction (TESTA `models/testa_retrieval.py` L93-L99).

Everything in it stays in fp32 whatever the model is cast to: an EMA with momentum 0.995 adds 0.5% of the difference
per step, below bf16's resolution (the weights would barely move in bf16, and drift the wrong way in fp16).

When the EMA and the enqueue happen:

- by default (the released behaviour, TESTA `models/testa_retrieval.py` L131 and L157), every training forward with a loss first updates the EMA, then enqueues its
  batch's momentum features;
- after `defer_updates()` (what `train/loop.py` does), forwards only collect their momentum features, and the owner
  calls `step(online)` once per optimiser step, after ``optimizer.step()``. With gradient accumulation, the EMA then
  runs once per optimiser step (not ``m ** accumulation``), and the features of all micro-batches of a step are
  enqueued together after it, in order, as one larger batch would be.
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.models.blip.modeling_blip_text import BlipTextModel

from .configuration_testa import TestaConfig
from .modeling_testa_vision import TestaVisionModel, pool_video_tokens


MOMENTUM_MODULES = ("vision_model", "vision_proj", "text_encoder", "text_proj")
"""The online modules of a head that have a momentum copy, by attribute name (the same name in both)."""


def online_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The `MOMENTUM_MODULES` of a contrastive head, by name: what `MomentumContrast` copies and follows."""
    return {name: getattr(model, name) for name in MOMENTUM_MODULES}

QUEUE_BUFFERS = ("video_queue", "text_queue", "idx_queue", "queue_ptr", "initialized")

LEGACY_KEYS = {
    "vision_model_m.": "momentum.vision_model.",
    "vision_proj_m.": "momentum.vision_proj.",
    "text_encoder_m.": "momentum.text_encoder.",
    "text_proj_m.": "momentum.text_proj.",
    "video_queue": "momentum.video_queue",
    "text_queue": "momentum.text_queue",
    "idx_queue": "momentum.idx_queue",
    "queue_ptr": "momentum.queue_ptr",
    "momentum_initialized": "momentum.initialized",
}
"""State-dict keys of version 0.1 heads (the momentum state lived on the head) -> their keys now."""


def legacy_key(key: str) -> str:
    """The current name of a version-0.1 momentum key (``vision_model_m.*``, ``video_queue``, ...); other keys are
    returned unchanged."""
    for old, new in LEGACY_KEYS.items():
        if key == old or (old.endswith(".") and key.startswith(old)):
            return new + key[len(old):]
    return key


def rename_legacy_keys(state_dict: dict, prefix: str = "") -> None:
    """Renames, in place, version-0.1 momentum keys found under ``prefix`` to their ``momentum.*`` names, so that
    `accelerate.save_state` checkpoints of 0.1 still load (a load-state-dict pre-hook of the contrastive heads)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        renamed = prefix + legacy_key(key[len(prefix):])
        if renamed != key:
            state_dict[renamed] = state_dict.pop(key)


class MomentumContrast(nn.Module):
    """EMA copies of a head's `MOMENTUM_MODULES` and the contrastive queues.

    Attributes:
        vision_model, vision_proj, text_encoder, text_proj: the frozen momentum copies.
        video_queue, text_queue (`(projection_dim, queue_size)`): momentum features of earlier batches.
        idx_queue (`(queue_size,)`): their video ids (-100: none). queue_ptr: the next slot to write.
        initialized: whether the copies have been synchronised with the online weights.
    """

    def __init__(self, config: TestaConfig):
        super().__init__()
        self.config = config
        vision_width, text_width = config.vision_config.hidden_size, config.text_config.hidden_size
        self.vision_model = TestaVisionModel(config.vision_config)
        self.vision_proj = nn.Linear(vision_width, config.projection_dim)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.text_proj = nn.Linear(text_width, config.projection_dim)
        self.register_buffer("video_queue", torch.zeros(config.projection_dim, config.queue_size))
        self.register_buffer("text_queue", torch.zeros(config.projection_dim, config.queue_size))
        self.register_buffer("idx_queue", torch.full((config.queue_size,), -100, dtype=torch.long))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.deferred = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.requires_grad_(False)
        # Training state: in the state dict (for `accelerate.save_state`) but not in `save_pretrained` folders, so
        # that checkpoints keep BLIP's size and layout (the head's `post_init` collects these keys, prefixed).
        self._keys_to_ignore_on_save = set(self.state_dict())

    # -------------------------------------------------------------------------------------------------- state

    @torch.no_grad()
    def reset(self) -> None:
        """The state of a fresh or loaded model, the same every time: empty queues (zeros, no ids), not started.
        Called by the head's `_init_weights`; `start` fills the queues when training begins."""
        init.zeros_(self.video_queue)
        init.zeros_(self.text_queue)
        init.constant_(self.idx_queue, -100)
        init.zeros_(self.queue_ptr)
        init.zeros_(self.initialized)
        self.requires_grad_(False)

    @torch.no_grad()
    def copy_weights_from(self, online: Mapping[str, nn.Module]) -> None:
        """Sets the momentum copies to the weights of the ``online`` modules (`online_modules` of a head); the
        training state is unchanged."""
        for name in MOMENTUM_MODULES:
            for p, p_m in zip(online[name].parameters(), getattr(self, name).parameters()):
                p_m.data.copy_(p.data.to(p_m.dtype))

    def _fp32_slots(self) -> list[tuple[nn.Module, str, str]]:
        """``(owner module, "_parameters" | "_buffers", name)`` of every floating tensor kept in fp32."""
        slots = []
        for module in self.modules():
            slots += [(module, "_parameters", n) for n, t in module._parameters.items() if t is not None]
            slots += [(module, "_buffers", n) for n, t in module._buffers.items() if t is not None]
        return slots

    def _apply(self, fn, recurse=True):
        """Casts (`.to(torch.bfloat16)`, `.half()`, a launcher's module cast) leave every fp32 tensor of the
        component in fp32 (see the module docstring); device moves apply."""
        kept = [(owner, kind, name, getattr(owner, kind)[name]) for owner, kind, name in self._fp32_slots()]
        kept = [(owner, kind, name, tensor.data) for owner, kind, name, tensor in kept if tensor.dtype == torch.float32]
        result = super()._apply(fn, recurse)
        for owner, kind, name, original in kept:
            tensor = getattr(owner, kind)[name]
            if tensor.dtype in (torch.float16, torch.bfloat16):
                if kind == "_parameters":
                    tensor.data = original.to(device=tensor.device)
                else:
                    owner._buffers[name] = original.to(device=tensor.device)
        return result

    @torch.no_grad()
    def to_fp32(self) -> None:
        """Tensors created in half precision (e.g. by `from_pretrained(dtype=torch.bfloat16)`) become fp32."""
        for owner, kind, name in self._fp32_slots():
            tensor = getattr(owner, kind)[name]
            if tensor.dtype in (torch.float16, torch.bfloat16):
                if kind == "_parameters":
                    tensor.data = tensor.data.float()
                else:
                    owner._buffers[name] = tensor.float()

    # ---------------------------------------------------------------------------------------------- EMA + queue

    @torch.no_grad()
    def start(self, online: Mapping[str, nn.Module]) -> None:
        """Starts training (once; a no-op when started): the momentum copies take the weights of the ``online``
        modules and the queues random unit vectors, as the released code does at construction (their ids stay -100:
        never positives). Adapted from TESTA `models/testa_retrieval.py` L86-L99 (`copy_params` and the queues)."""
        if bool(self.initialized):
            return
        self.to_fp32()
        self.copy_weights_from(online)
        queue_shape = (self.config.projection_dim, self.config.queue_size)
        self.video_queue.copy_(F.normalize(torch.randn(queue_shape), dim=0))
        self.text_queue.copy_(F.normalize(torch.randn(queue_shape), dim=0))
        self.initialized.fill_(True)
        self.requires_grad_(False)

    @torch.no_grad()
    def update(self, online: Mapping[str, nn.Module]) -> None:
        """EMA of the ``online`` modules' weights into the (fp32) momentum copies; before `start`, starts instead.
        Adapted from TESTA `models/testa_retrieval.py` L268-L272 (`_momentum_update`)."""
        if not bool(self.initialized):
            self.start(online)
            return
        m = self.config.momentum
        for name in MOMENTUM_MODULES:
            for p, p_m in zip(online[name].parameters(), getattr(self, name).parameters()):
                p_m.data.mul_(m).add_(p.data.to(p_m.dtype), alpha=1.0 - m)

    def defer_updates(self, enabled: bool = True) -> None:
        """Chooses when the EMA and the enqueue happen during training (see the module docstring)."""
        self.deferred = bool(enabled)
        self.pending = []

    @torch.no_grad()
    def step(self, online: Mapping[str, nn.Module]) -> None:
        """Deferred mode: call once after every optimiser step. Enqueues the momentum features collected since the
        previous step, then moves the momentum copies towards the updated weights of the ``online`` modules."""
        pending, self.pending = self.pending, []
        if pending:
            self.enqueue(*(torch.cat(parts) for parts in zip(*pending)))
        self.update(online)

    @torch.no_grad()
    def before_loss(self, online: Mapping[str, nn.Module], training: bool) -> None:
        """Called before the momentum features of a batch are computed (`contrastive.contrastive_losses`): the EMA
        update of the default mode in training, and `start` otherwise (when not started)."""
        if training and not self.deferred:
            self.update(online)
        else:
            self.start(online)

    @torch.no_grad()
    def features(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The momentum model's normalised ``(video, text)`` contrastive features of a batch of pairs, pooled and
        projected as the online head does (``config.video_pooling``, the first text token)."""
        video = self.vision_model(pixel_values.to(self.vision_proj.weight.dtype))
        pooled = pool_video_tokens(video.last_hidden_state, video.token_sizes, self.config.video_pooling)
        video_feat = F.normalize(self.vision_proj(pooled), dim=-1)
        text_states = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        text_feat = F.normalize(self.text_proj(text_states[:, 0]), dim=-1)
        return video_feat, text_feat

    @torch.no_grad()
    def after_loss(self, video_feat: torch.Tensor, text_feat: torch.Tensor, ids: torch.Tensor) -> None:
        """Called in training with the global batch's momentum features: enqueued now, or collected
        until `step` in deferred mode."""
        if self.deferred:
            self.pending.append((video_feat, text_feat, ids))
        else:
            self.enqueue(video_feat, text_feat, ids)

    @torch.no_grad()
    def enqueue(self, video_feat: torch.Tensor, text_feat: torch.Tensor, ids: torch.Tensor) -> None:
        """Writes a global batch into the ring-buffer queues (identical on every process). Any batch size works; a
        batch larger than the queue keeps its last ``queue_size`` entries (the released `_dequeue_and_enqueue`, TESTA
        `models/testa_retrieval.py` L274-L291, asserts that the queue size is a multiple of the batch)."""
        size = self.config.queue_size
        if size == 0:
            return
        video_feat, text_feat, ids = video_feat[-size:], text_feat[-size:], ids[-size:]
        slots = (int(self.queue_ptr) + torch.arange(ids.shape[0], device=ids.device)) % size
        self.video_queue[:, slots] = video_feat.T.to(self.video_queue.dtype)
        self.text_queue[:, slots] = text_feat.T.to(self.text_queue.dtype)
        self.idx_queue[slots] = ids
        self.queue_ptr.fill_((int(self.queue_ptr) + ids.shape[0]) % size)

    def targets(self, video_feat_m: torch.Tensor, text_feat_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the rows are contrasted with: the global batch's momentum features, then the queue (fp32 queues;
        the result takes the features' dtype)."""
        video = torch.cat([video_feat_m, self.video_queue.T.to(video_feat_m.dtype)], dim=0)
        text = torch.cat([text_feat_m, self.text_queue.T.to(text_feat_m.dtype)], dim=0)
        return video, text


__all__ = [
    "LEGACY_KEYS",
    "MOMENTUM_MODULES",
    "QUEUE_BUFFERS",
    "MomentumContrast",
    "legacy_key",
    "online_modules",
    "rename_legacy_keys",
]
