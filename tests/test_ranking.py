"""The one two-stage ranking (`modeling_testa.ranking`): the order and its tie rule on hand-worked rows, and the
chunked ranking of the evaluation equal to the all-at-once ranking of `rank_videos`."""

import torch
from helpers.models import randomize, text_ids, tiny_config, videos

from modeling_testa import TestaForVideoTextRetrieval
from modeling_testa.ranking import RankingOptions, ranked_order, two_stage_scores


INF = float("-inf")


def test_order_and_tie_rule_hand_worked():
    scores = torch.tensor([0.2, 0.8, 0.8, 0.3])
    # re-ranked items best first; equal scores by index, unless a positive is given: it goes after its ties
    assert ranked_order(scores, scores) == [1, 2, 3, 0]
    assert ranked_order(scores, scores, 4, {1}) == [2, 1, 3, 0]
    assert ranked_order(scores, scores, 4, {2}) == [1, 2, 3, 0]
    assert ranked_order(scores, scores, 3, {1}) == [2, 1, 3]
    # then the other items by cosine (-inf: never ranked), truncated; the same tie rule
    two_stage, cosine = torch.tensor([0.3, INF, 0.7, INF, INF]), torch.tensor([0.9, 0.5, 0.1, INF, 0.5])
    assert ranked_order(two_stage, cosine) == [2, 0, 1, 4]
    assert ranked_order(two_stage, cosine, 5, {1}) == [2, 0, 4, 1]
    assert ranked_order(two_stage, cosine, 5, {4}) == [2, 0, 1, 4]
    assert ranked_order(two_stage, cosine, 3, {1}) == [2, 0, 4]
    assert ranked_order(torch.full((3,), INF), torch.full((3,), INF)) == []


def test_chunked_queries_equal_rank_videos_and_a_brute_force_score():
    torch.manual_seed(0)
    model = randomize(TestaForVideoTextRetrieval(tiny_config())).eval()
    ids, clips = text_ids(5, 7), videos(4, seed=1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = model.get_video_tokens(clips)
        text_features = model.get_text_features(ids, mask).pooler_output
        video_features = model.get_video_features(video_tokens=out.last_hidden_state).pooler_output
        whole = model.rank_videos(ids, out.last_hidden_state, mask, k=2)
        chunked = two_stage_scores(model, queries_are_texts=True, input_ids=ids, attention_mask=mask,
                                   text_features=text_features, video_features=video_features,
                                   read_tokens=out.last_hidden_state.__getitem__,
                                   options=RankingOptions(k=2, batch_size=2), queries=torch.arange(5))
        # brute force: every pair through the matching head, plus the cosine, for the top-2 by cosine
        cosine = text_features @ video_features.T
        for t in range(5):
            top = cosine[t].topk(2).indices
            logits, _ = model.itm_logits(ids[t : t + 1].expand(2, -1), mask[t : t + 1].expand(2, -1),
                                         out.last_hidden_state[top])
            torch.testing.assert_close(whole.scores[t, top], logits[:, 1] + cosine[t, top])
    for name in ("scores", "similarity", "topk_indices", "topk_scores"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), msg=name)
