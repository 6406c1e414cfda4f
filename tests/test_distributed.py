"""Distributed correctness of the VTC and VTM losses: 2 CPU processes (gloo) against one process on the same global
batch.

Why the values must agree:

* VTC: each process scores its own rows against the momentum features of the *gathered* global batch plus the
  queue, so the global loss is the mean of the per-process losses, and (no gradient flows through the gathered
  momentum features) the average of the per-process gradients, which is what DDP computes, is the gradient of the
  single-process loss.
* VTM: the sampling weights of a process's rows are its rows of the single-process weights (the candidate set is the
  global batch), so a deterministic sampler draws the same negatives; the negative video tokens are gathered with
  gradient (all-reduced in backward), so the averaged gradients again equal the single-process ones.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.models import randomize, text_ids, tiny_config, videos

from modeling_testa import TestaForVideoTextRetrieval


WORLD, PER_RANK = 2, 2
VIDEO_IDS = torch.tensor([0, 1, 2, 1])  # id 1 appears on both processes: a positive across processes


def _model(negative_all_rank: bool = True) -> TestaForVideoTextRetrieval:
    torch.manual_seed(0)
    model = TestaForVideoTextRetrieval(tiny_config(queue_size=8, negative_all_rank=negative_all_rank, alpha=0.4))
    model = randomize(model).train()
    model.sample_hard_negatives = lambda weights: weights.argmax(dim=1)  # deterministic, seed-free sampler
    return model


def _inputs():
    ids = text_ids(WORLD * PER_RANK, 6, seed=21, pad_to=8)
    mask = ids.ne(0).long()
    mask[1, 5:] = 0
    return ids, mask, videos(WORLD * PER_RANK, seed=22)


def _step(model, ids, mask, clips, video_ids) -> dict:
    """One training forward; the VTC and VTM gradients are taken separately; plus the VTM sampling weights."""
    out = model(ids, clips, attention_mask=mask, return_loss=True, video_ids=video_ids)
    result = {"loss_vtc": out.loss_vtc.detach(), "loss_vtm": out.loss_vtm.detach(),
              "negative_videos": out.negative_video_indices, "negative_texts": out.negative_text_indices}
    for name in ("loss_vtc", "loss_vtm"):
        model.zero_grad()
        getattr(out, name).backward(retain_graph=name == "loss_vtc")
        result[f"grads_{name}"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        video_feat = model.get_video_features(clips).pooler_output
        text_feat = model.get_text_features(ids, mask).pooler_output
        result["weights"] = model.hard_negative_weights(video_feat, text_feat, video_ids)
    result["queue"] = (model.momentum.video_queue.clone(), model.momentum.text_queue.clone(), model.momentum.idx_queue.clone())
    return result


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        ids, mask, clips = _inputs()
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        result = _step(_model(), ids[local], mask[local], clips[local], VIDEO_IDS[local])
        for key in ("loss_vtc", "loss_vtm"):
            dist.all_reduce(result[key])
            result[key] /= WORLD
            for grad in result[f"grads_{key}"].values():  # what DDP does to the gradients
                dist.all_reduce(grad)
                grad /= WORLD
        # With negative_all_rank=False the candidates are the local batch only.
        local_model = _model(negative_all_rank=False)
        local_out = local_model(ids[local], clips[local], attention_mask=mask[local], return_loss=True,
                                video_ids=VIDEO_IDS[local])
        with torch.no_grad():
            video_feat = local_model.get_video_features(clips[local]).pooler_output
            text_feat = local_model.get_text_features(ids[local], mask[local]).pooler_output
            result["local_weights"] = local_model.hard_negative_weights(video_feat, text_feat, VIDEO_IDS[local])
        result["local_negative_videos"] = local_out.negative_video_indices
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    ids, mask, clips = _inputs()
    single = _step(_model(), ids, mask, clips, VIDEO_IDS)
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return single, ranks


def test_vtc_loss_and_gradients_equal_single_process(runs):
    single, ranks = runs
    for result in ranks:
        torch.testing.assert_close(result["loss_vtc"], single["loss_vtc"], atol=1e-5, rtol=0)
        assert result["grads_loss_vtc"].keys() == single["grads_loss_vtc"].keys()
        for name, grad in single["grads_loss_vtc"].items():
            torch.testing.assert_close(result["grads_loss_vtc"][name], grad, atol=1e-5, rtol=0, msg=name)
    assert any(g.abs().max() > 1e-3 for g in single["grads_loss_vtc"].values())  # the gradients are not trivial


def test_queue_holds_the_global_batch_on_every_process(runs):
    single, ranks = runs
    for result in ranks:
        for ours, theirs in zip(result["queue"], single["queue"]):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    torch.testing.assert_close(single["queue"][2][:4], VIDEO_IDS)


def test_hard_negatives_are_drawn_from_the_global_batch(runs):
    single, ranks = runs
    for rank, result in enumerate(ranks):
        rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for ours, theirs in zip(result["weights"], single["weights"]):
            assert ours.shape == (PER_RANK, WORLD * PER_RANK)  # candidates: every process's samples
            torch.testing.assert_close(ours, theirs[rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(result["negative_videos"], single["negative_videos"][rows])
        torch.testing.assert_close(result["negative_texts"], single["negative_texts"][rows])
        # Same-id pairs are never candidates, also across processes (id 1 lives on both).
        same = VIDEO_IDS[rows, None] == VIDEO_IDS[None]
        assert result["weights"][0][same].eq(0).all()
    drawn = torch.cat([r["negative_videos"] for r in ranks])
    owners = drawn // PER_RANK
    assert (owners != torch.arange(WORLD).repeat_interleave(PER_RANK)).any()  # some negatives come from the other process
    for result in ranks:
        assert result["local_weights"][0].shape == (PER_RANK, PER_RANK)
        assert (result["local_negative_videos"] < PER_RANK).all()


def test_vtm_loss_and_gradients_through_gathered_video_tokens_equal_single_process(runs):
    single, ranks = runs
    for result in ranks:
        torch.testing.assert_close(result["loss_vtm"], single["loss_vtm"], atol=1e-5, rtol=0)
        assert result["grads_loss_vtm"].keys() == single["grads_loss_vtm"].keys()
        for name, grad in single["grads_loss_vtm"].items():
            torch.testing.assert_close(result["grads_loss_vtm"][name], grad, atol=1e-5, rtol=0, msg=name)
    assert any(n.startswith("vision_model.") for n in single["grads_loss_vtm"])


def _failing_worker(rank: int, store: str, out_dir: str) -> None:
    """Rank 0's local batch has one video id only, so (without `negative_all_rank`) it has no hard negative and
    raises; rank 1's batch is fine. Afterwards both enter a collective, as DDP's backward would."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        ids, mask, clips = _inputs()
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        video_ids = torch.tensor([7, 7]) if rank == 0 else torch.tensor([1, 2])
        try:
            _model(negative_all_rank=False)(ids[local], clips[local], attention_mask=mask[local], return_loss=True,
                                            video_ids=video_ids)
            outcome = "no error"
        except Exception as error:  # noqa: BLE001 - the test records what each process raised
            outcome = f"{type(error).__name__}: {error}"
        dist.barrier()
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(outcome)
    finally:
        dist.destroy_process_group()


def test_loss_error_on_one_process_is_raised_on_every_process(tmp_path):
    import time

    context = mp.start_processes(_failing_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("a process hung after the loss raised on another process")
    outcomes = [(tmp_path / f"error{rank}.txt").read_text() for rank in range(WORLD)]
    assert outcomes[0].startswith("ValueError: Cannot draw a hard negative"), outcomes
    assert outcomes[1].startswith("PeerError: another process raised"), outcomes
    assert "Cannot draw a hard negative" in outcomes[1] and "0:" in outcomes[1]
