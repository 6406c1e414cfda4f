"""Memory that does not grow with a video's length: `encode_videos(window=)` on generated long videos, in a fresh
process each, with the peak resident memory of the whole process tree (the process, its decoder helper) sampled
while it indexes (`benchmarks.process_memory`).

The videos are long but small to decode (640x360 at 1 frame per second, so the suite stays fast); the realistic sizes
(1 h at 360p, 30 min at 720p, 2 h at 1080p, 30 fps) are in `benchmarks/long_video_memory.py`. Holding every window's
frames at the source resolution, as indexing did before, would take 359 windows x 4 frames x 691 KB = 993 MB for the
hour; streamed, the frames kept are the open windows' at the model's input size."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.requirements import require
from helpers.videos import write_long_video


require("faiss")

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20

SCRIPT = textwrap.dedent("""
    import json, sys
    from helpers.pipelines import build_retrieval, tiny_processor
    from modeling_testa import VideoTextRetrievalPipeline
    from benchmarks.process_memory import TreeMemory, high_water

    warm_up, video = sys.argv[1], sys.argv[2]
    pipe = VideoTextRetrievalPipeline(model=build_retrieval(), processor=tiny_processor(), device="cpu")
    pipe.encode_videos([warm_up], window=20, stride=10, progress_bar=False)  # imports, the decoder helper, buffers
    with TreeMemory(interval=0.02) as memory:
        index = pipe.encode_videos([video], window=20, stride=10, batch_size=8, progress_bar=False)
    print(json.dumps({"rows": len(index), "failures": len(index.failures), "start": memory.start,
                      "peak": memory.peak, "high_water": high_water()}))
""")


def index_in_a_fresh_process(warm_up: Path, video: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(warm_up), str(video)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    return {name: write_long_video(folder / f"{name}.mp4", frames, fps=1, width=640, height=360)
            for name, frames in (("warm_up", 30), ("short", 150), ("hour", 3600))}


def test_indexing_an_hour_holds_its_open_windows_not_the_hour_and_does_not_grow_with_length(videos):
    short = index_in_a_fresh_process(videos["warm_up"], videos["short"])  # 2.5 minutes: 14 windows
    hour = index_in_a_fresh_process(videos["warm_up"], videos["hour"])  # 1 hour: 359 windows
    print({name: {k: round(v / MIB, 1) if k in ("start", "peak", "high_water") else v for k, v in result.items()}
           for name, result in (("short", short), ("hour", hour))})
    assert (short["rows"], short["failures"]) == (14, 0) and (hour["rows"], hour["failures"]) == (359, 0)
    # the bound: what indexing adds to the tree (decoder helper already running) stays under 96 MiB for the hour
    # (holding its windows' frames would add 993 MB)
    assert hour["peak"] - hour["start"] < 96 * MIB
    # and it does not grow with the video's length: the hour peaks within 32 MiB of 2.5 minutes
    assert hour["peak"] - short["peak"] < 32 * MIB
    assert hour["high_water"] - short["high_water"] < 32 * MIB  # no short spike escaped the sampling either
