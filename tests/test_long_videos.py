"""processing/long_videos.py: events land at the times the rows say (checked on the decoded pixels), the rows are
the ActivityNet Captions builder's format, and bad settings are refused."""

import json

import numpy as np
import pytest

from modeling_testa.video_decoding import decode_video
from processing.long_videos import generate_long_videos_dataset, plan_long_videos
from processing.short_events import caption
from train.moment_evaluation import moment_queries


def test_events_are_where_the_timestamps_say(tmp_path):
    rows = generate_long_videos_dataset(str(tmp_path), num_videos=2, minutes=1.5, events_per_video=2, seed=3)
    assert [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()] == rows
    plans = plan_long_videos(2, 90, 2, seed=3)
    for row, plan in zip(rows, plans):
        assert row["duration"] == 90.0 and row["sentences"] == [caption(event) for event, _ in plan.events]
        frames, metadata = decode_video(tmp_path / row["video"], backend="pyav", isolate_decoder=False)
        assert len(frames) == 360 and metadata.fps == 4
        bright = frames.reshape(360, -1).mean(1) > 20  # every scene colour is bright; the background is black
        expected = np.zeros(360, dtype=bool)
        for start, end in row["timestamps"]:
            assert start < end and (end - start) * 4 == int((end - start) * 4)
            expected[int(start * 4):int(end * 4)] = True
        assert np.array_equal(bright, expected)
        starts = [start for start, _ in row["timestamps"]]
        assert starts == sorted(starts) and all(a[1] <= b[0] for a, b in zip(row["timestamps"], row["timestamps"][1:]))
    queries = moment_queries([dict(r, video=str(tmp_path / r["video"])) for r in rows]).queries
    assert len(queries) == 4 and queries[0].text == rows[0]["sentences"][0]


def test_events_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit in 30 s"):
        plan_long_videos(1, 30, 2)
