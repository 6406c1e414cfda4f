"""Momentum contrast (`MomentumContrast`, held by the contrastive heads): set_aggregation reaches the copies, the EMA
and the enqueue happen once per optimiser step with gradient accumulation (or every call outside the loop), and the
copies and queues stay fp32 under half-precision casts (against a float64 re-computation)."""

import pytest
import torch


def _contrastive_model(**overrides):
    from helpers.models import randomize, tiny_config

    from modeling_testa import TestaForVideoTextRetrieval

    torch.manual_seed(0)
    return randomize(TestaForVideoTextRetrieval(tiny_config(**overrides))).train()


def test_head_set_aggregation_changes_online_and_momentum_encoders():
    from helpers.models import videos

    model = _contrastive_model().eval()
    clips = videos(2, seed=1)
    before = model.momentum.vision_model(clips).last_hidden_state.shape[1]
    model.set_aggregation(temporal_reduction=0, spatial_reduction=1)
    online = model.vision_model(clips).last_hidden_state.shape[1]
    momentum = model.momentum.vision_model(clips).last_hidden_state.shape[1]
    assert online == momentum != before, (online, momentum, before)
    assert model.config.vision_config.spatial_reduction == 1
    settings = model.momentum.vision_model.aggregation_settings()
    assert [settings.reductions(index) for index in range(2)] == [(0, 1)] * 2
    with pytest.raises(ValueError):
        model.set_aggregation(spatial_reduction=-1)


def _online_step(model, step: int, scale: float = 1e-2) -> None:
    """A fixed stand-in for an optimiser step: the same change of the online weights whatever the batch split."""
    generator = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_((scale * torch.randn(p.shape, generator=generator)).to(p.dtype))


def _momentum_after_steps(accumulation: int, deferred: bool, steps: int = 3, batch: int = 4):
    from helpers.models import text_ids, videos

    model = _contrastive_model(queue_size=16, momentum=0.9)
    model.defer_momentum_updates(deferred)
    ids, clips = text_ids(steps * batch, 6, seed=4), videos(steps * batch, seed=5)
    video_ids = torch.arange(steps * batch)
    micro = batch // accumulation
    for step in range(steps):
        for m in range(accumulation):
            rows = slice(step * batch + m * micro, step * batch + (m + 1) * micro)
            model(ids[rows], clips[rows], return_loss=True, video_ids=video_ids[rows])
        _online_step(model, step)
        if deferred:
            model.momentum_step()
    momentum = {n: t.clone() for n, t in model.state_dict().items() if n.startswith("momentum.vision_model.")
                or n.startswith("momentum.text_proj.")}
    queues = (model.momentum.video_queue.clone(), model.momentum.text_queue.clone(), model.momentum.idx_queue.clone(), int(model.momentum.queue_ptr))
    return momentum, queues


def test_momentum_and_queue_once_per_optimiser_step_with_accumulation():
    """accum=2 with micro-batch b gives the momentum weights and queue that accum=1 with batch 2b gives."""
    big_momentum, big_queues = _momentum_after_steps(accumulation=1, deferred=True)
    acc_momentum, acc_queues = _momentum_after_steps(accumulation=2, deferred=True)
    for name, value in big_momentum.items():
        torch.testing.assert_close(acc_momentum[name], value, atol=1e-6, rtol=0, msg=name)
    for ours, theirs in zip(acc_queues[:3], big_queues[:3]):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert acc_queues[3] == big_queues[3] == 12
    torch.testing.assert_close(big_queues[2][:12], torch.arange(12))
    # The per-call mode (plain forward() outside the loop) updates every call: m^2 per step with 2 micro-batches.
    per_call, _ = _momentum_after_steps(accumulation=2, deferred=False)
    assert any((per_call[n] - v).abs().max() > 1e-4 for n, v in big_momentum.items())


def test_plain_forward_updates_momentum_and_queue_every_call():
    from helpers.models import text_ids, videos

    model = _contrastive_model(queue_size=8, momentum=0.5)
    ids, clips = text_ids(2, 6, seed=4), videos(2, seed=5)
    model(ids, clips, return_loss=True, video_ids=torch.tensor([3, 4]))  # first call: copies the online weights
    online = model.vision_proj.weight.detach().clone()
    torch.testing.assert_close(model.momentum.vision_proj.weight, online)
    _online_step(model, 0)
    model(ids, clips, return_loss=True, video_ids=torch.tensor([5, 6]))
    torch.testing.assert_close(model.momentum.vision_proj.weight, 0.5 * online + 0.5 * model.vision_proj.weight.detach())
    assert model.momentum.idx_queue[:4].tolist() == [3, 4, 5, 6] and int(model.momentum.queue_ptr) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_momentum_ema_and_queues_stay_fp32_in_half_precision(dtype):
    """The model is cast to half precision; the EMA over 200 steps matches a float64 re-computation."""
    from helpers.models import text_ids, videos

    momentum = 0.995
    model = _contrastive_model(queue_size=8, momentum=momentum).to(dtype)
    assert model.vision_proj.weight.dtype == dtype
    momentum_parameters = [p for n, p in model.named_parameters() if n.startswith("momentum.")]
    assert momentum_parameters and all(p.dtype == torch.float32 for p in momentum_parameters)
    assert model.momentum.video_queue.dtype == model.momentum.text_queue.dtype == torch.float32
    model.defer_momentum_updates(True)
    if dtype == torch.bfloat16:  # a half-precision training forward works and enqueues fp32 features
        out = model(text_ids(2, 6, seed=4), videos(2, seed=5).to(dtype), return_loss=True,
                    video_ids=torch.tensor([1, 2]))
        assert torch.isfinite(out.loss)
    else:
        model.start_momentum()
    online = dict(model.vision_proj.named_parameters())
    reference = {n: p.detach().double() for n, p in online.items()}
    start = {n: r.clone() for n, r in reference.items()}
    for step in range(200):
        _online_step(model, step, scale=1e-2)
        model.momentum_step()
        for n, p in online.items():
            reference[n] = momentum * reference[n] + (1 - momentum) * p.detach().double()
    for n, p_m in model.momentum.vision_proj.named_parameters():
        assert p_m.dtype == torch.float32
        moved = (reference[n] - start[n]).abs().max()
        error = (p_m.double() - reference[n]).abs().max()
        assert moved > 1e-2 and error < 1e-4 * moved, (n, float(moved), float(error))
    if dtype == torch.bfloat16:
        assert model.momentum.video_queue.dtype == torch.float32 and model.momentum.idx_queue[:2].tolist() == [1, 2]
