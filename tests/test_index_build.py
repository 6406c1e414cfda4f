"""One index build that loses nothing, in whatever order users run the documented commands (issue 44).

References: an index built at once over the same videos (rows and embeddings), the files of a refused store before
and after (bytes and modification times), exact search in torch over the same embeddings, and what pymilvus itself
was given. Each case failed before the build had one owner: the README's snippet run twice deleted the store's index,
a Milvus folder filter read ``_`` as a wildcard, and a Milvus collection took rows of any model.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.milvus_server import record_milvus_tokens
from helpers.pipelines import build_retrieval, save_folder, tiny_processor
from helpers.videos import write_long_video, write_noise_video

from modeling_testa import VideoTextRetrievalPipeline
from testa_search import VideoIndex
from testa_search.build import IndexBuild, build_settings
from testa_search.homes import IndexEntry, StoreHome
from testa_search.settings import SETTINGS_FILE, IndexSettingsError

ROOT = Path(__file__).resolve().parents[1]
QUERY = "first the screen is red. a blue square flashes."


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a folder: its modification time and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def readme_snippet() -> str:
    """The README's "Search a folder of videos" code, as a user copies it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Search a folder of videos"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_folder(build_retrieval(), tiny_processor(), tmp_path_factory.mktemp("model") / "final")


@pytest.fixture(scope="module")
def pipe(model_folder):
    return VideoTextRetrievalPipeline(model=type(build_retrieval()).from_pretrained(model_folder),
                                      processor=tiny_processor(), device="cpu")


def test_the_readmes_search_snippet_run_twice_and_after_new_videos_keeps_and_grows_the_index(
        model_folder, tmp_path, monkeypatch):
    """The snippet, verbatim, in a folder laid out as `make demo` leaves it: the second run finds everything there
    (nothing encoded, the index intact), a third run after new videos arrived adds only them, and the store equals
    one built at once."""
    code = readme_snippet()
    assert 'store_dir="demo_index"' in code and "outputs/demo/runs/b/final" in code
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs/demo/runs/b").mkdir(parents=True)
    os.symlink(model_folder, tmp_path / "outputs/demo/runs/b/final")
    videos = tmp_path / "outputs/demo/data/videos"
    for i in range(3):
        write_noise_video(videos / f"clip{i}.mp4", seed=i)
    first: dict = {}
    exec(code, first)  # noqa: S102 - the README's own code
    assert len(first["index"]) == 3 and first["index"].stats["videos"] == 3
    rows = VideoIndex.load("demo_index").row_keys()
    second: dict = {}
    exec(code, second)  # noqa: S102
    assert second["index"] is not None and second["index"].stats["videos"] == 0  # nothing encoded again
    assert VideoIndex.load("demo_index").row_keys() == rows
    for i in range(3, 5):
        write_noise_video(videos / f"clip{i}.mp4", seed=i)
    third: dict = {}
    exec(code, third)  # noqa: S102
    assert third["index"].stats["videos"] == 2
    grown = VideoIndex.load("demo_index")
    at_once = third["pipe"].encode_videos(sorted(str(p.relative_to(tmp_path)) for p in videos.glob("*.mp4")),
                                          store_dir="at_once")
    assert grown.names == at_once.names
    torch.testing.assert_close(grown.embeddings[:], at_once.embeddings[:], rtol=0, atol=1e-6)
    assert [r["video"] for r in third["pipe"].search(QUERY, grown, top_k=5, rerank=False)] == [
        r["video"] for r in third["pipe"].search(QUERY, at_once, top_k=5, rerank=False)]


def test_a_store_refuses_another_model_and_other_settings_and_nothing_in_it_changes(pipe, tmp_path):
    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(3)]
    store = tmp_path / "store"
    pipe.encode_videos(videos[:2], store_dir=store)
    before = snapshot(store)
    other = VideoTextRetrievalPipeline(model=build_retrieval(seed=5), processor=tiny_processor(), device="cpu")
    with pytest.raises(IndexSettingsError, match="model_weights_sha256: the index has"):
        other.encode_videos(videos, store_dir=store)
    with pytest.raises(IndexSettingsError, match="num_frames: the index has 4, this build 2"):
        pipe.encode_videos(videos, store_dir=store, num_frames=2)
    with pytest.raises(IndexSettingsError, match="token_dtype: the index has 'float16', this build 'float32'"):
        pipe.encode_videos(videos, store_dir=store, token_dtype=torch.float32)
    with pytest.raises(IndexSettingsError, match="window: the index has None, this build 20.0"):
        pipe.encode_videos(videos, store_dir=store, window=20)
    assert snapshot(store) == before
    # the same videos, and a subset: nothing is encoded and the index is as it was (only its report says so)
    for given in (videos[:2], videos[:1]):
        index = pipe.encode_videos(given, store_dir=store)
        assert index.stats["videos"] == 0 and len(index) == 2
        assert {k: v for k, v in snapshot(store).items() if k != "index_report.json"} == \
            {k: v for k, v in before.items() if k != "index_report.json"}


def test_a_folder_that_is_not_a_store_is_refused_and_an_index_is_never_saved_over_a_store(pipe, tmp_path):
    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(2)]
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(IndexSettingsError, match="holds files that are not a video store"):
        pipe.encode_videos(videos, store_dir=photos)
    assert [p.name for p in photos.iterdir()] == ["a.jpg"]
    store = tmp_path / "store"
    pipe.encode_videos(videos[:1], store_dir=store)
    before = snapshot(store)
    in_memory = pipe.encode_videos(videos)
    for as_store in (True, False):
        with pytest.raises(IndexSettingsError, match="holds a video store"):
            in_memory.save(store, as_store=as_store)
    assert snapshot(store) == before


def test_moments_go_into_a_store_through_the_pipeline_and_train_index_grows_it(pipe, model_folder, tmp_path):
    """`encode_videos(window=, store_dir=)` writes the moments `window=` builds in memory; run again it is a no-op,
    and `train.index --window` (the same build) grows it by a new video."""
    from testa_search.cli.index import main as index_main

    (tmp_path / "videos").mkdir()
    minute = str(write_long_video(tmp_path / "videos" / "minute.mp4", 120, fps=2))
    short = str(write_long_video(tmp_path / "videos" / "short.mp4", 20, fps=2))
    store = tmp_path / "store"
    stored = pipe.encode_videos([minute], window=25, stride=15, store_dir=store, token_dtype=torch.float32)
    in_memory = pipe.encode_videos([minute], window=25, stride=15)
    assert stored.row_keys() == in_memory.row_keys() == [(minute, 0, 25), (minute, 15, 40), (minute, 30, 55),
                                                         (minute, 35, 60)]
    torch.testing.assert_close(stored.embeddings[:], in_memory.embeddings, rtol=0, atol=1e-6)
    assert pipe.encode_videos([minute], window=25, stride=15, store_dir=store).stats["videos"] == 0
    listing = tmp_path / "videos.txt"
    listing.write_text(f"{minute}\n{short}\n")
    report = index_main(["--model", str(model_folder), "--videos", str(listing), "--store", str(store),
                         "--window", "25", "--stride", "15", "--num-workers", "0"])
    assert report["added_this_run"] == 1 and report["already_in_store"] == 4
    grown = VideoIndex.load(store)
    assert grown.row_keys() == pipe.encode_videos([minute, short], window=25, stride=15).row_keys()


def test_an_evaluation_scratch_store_is_not_grown(pipe, tmp_path):
    """The training evaluation rewrites its store every time: growing it would mix models, so it is refused."""
    from accelerate import Accelerator

    from testa_search.encoding import DecodeVideos
    from train.evaluation import encode_to_store

    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(2)]
    store, _ = encode_to_store(pipe.model, videos, DecodeVideos(pipe.video_processor, 4), Accelerator(cpu=True),
                               tmp_path / "eval", batch_size=2)
    store.close()
    with pytest.raises(IndexSettingsError, match="scratch store"):
        pipe.encode_videos(videos, store_dir=tmp_path / "eval")
    assert json.loads((tmp_path / "eval" / SETTINGS_FILE).read_text())["scratch"] is True


def test_a_build_checks_settings_before_it_decodes_anything(pipe, tmp_path):
    """A refused build never reaches its decoder."""
    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(2)]
    store = tmp_path / "store"
    pipe.encode_videos(videos[:1], store_dir=store)

    def decode(entries, positions):
        raise AssertionError("decoded before the settings were checked")

    settings = build_settings(pipe.model, num_frames=3)
    with pytest.raises(IndexSettingsError, match="num_frames"):
        IndexBuild(StoreHome(store), settings).run(pipe.model, [IndexEntry(v) for v in videos], decode)


# ---------------------------------------------------------------------------------------------------- Milvus


@pytest.fixture()
def milvus_modules():
    from helpers.requirements import require

    return require("pymilvus"), require("milvus_lite")


def train_index(model: Path, videos: Path, store: Path, *extra: str) -> dict:
    from testa_search.cli.index import main as index_main

    return index_main(["--model", str(model), "--videos", str(videos), "--store", str(store), "--num-workers", "0",
                       "--token-dtype", "float32", *extra])


def test_two_models_never_mix_in_one_milvus_collection(milvus_modules, model_folder, tmp_path):
    """The second model's `train.index` into the first one's collection is refused, naming the difference, before
    anything is encoded; the first store's Milvus search still equals its own store search."""
    from testa_search.milvus import MilvusHome
    from testa_search.cli.search import search

    folder = tmp_path / "videos"
    for i in range(6):
        write_noise_video(folder / ("cats" if i % 2 else "dogs") / f"clip{i}.mp4", seed=20 + i)
    db = str(tmp_path / "videos.db")
    train_index(model_folder, folder, tmp_path / "first", "--milvus", db)
    other = save_folder(build_retrieval(seed=9), tiny_processor(), tmp_path / "other_model")
    rows_before = sorted(row["key"] for row in MilvusHome(db).open().all_rows())
    with pytest.raises(SystemExit, match=r"collection 'videos'\) was built with other settings.*\n.*model_weights"):
        train_index(other, folder, tmp_path / "second", "--milvus", db)
    assert not (tmp_path / "second").exists()  # the refused mirror left the new store unwritten
    assert sorted(row["key"] for row in MilvusHome(db).open().all_rows()) == rows_before
    queries = ["a red square", "green blocks", "gray", "blue"]
    from_store = search(str(tmp_path / "first"), queries, top_k=3)
    from_milvus = search(str(tmp_path / "first"), queries, top_k=3, milvus=db)
    assert [[r["video"] for r in ranked] for ranked in from_milvus] == [[r["video"] for r in ranked]
                                                                        for ranked in from_store]
    # the other model gets a collection of its own
    train_index(other, folder, tmp_path / "second", "--milvus", db, "--collection", "other_model")
    assert len(MilvusHome(db, "other_model").open().all_rows()) == 6


def test_milvus_refuses_a_wrong_dimension_and_another_programs_collection_in_one_line(milvus_modules, tmp_path):
    pymilvus, _ = milvus_modules
    from testa_search.milvus import MilvusHome, MilvusHomeError

    db = str(tmp_path / "videos.db")
    MilvusHome(db).check_settings({"model_class": "A", "projection_dim": 8})
    with pytest.raises(MilvusHomeError) as wrong:
        MilvusHome(db).check_settings({"model_class": "A", "projection_dim": 16})
    assert str(wrong.value) == (f"Milvus {db} (collection 'videos') holds 8-d embeddings; this model's are 16-d: use "
                                "another collection.")
    client = pymilvus.MilvusClient(db)
    client.create_collection("theirs", dimension=8)  # pymilvus' quick setup: id, vector
    client.close()
    with pytest.raises(MilvusHomeError) as foreign:
        MilvusHome(db, "theirs").check_settings({"model_class": "A", "projection_dim": 8})
    assert "was made by another program" in str(foreign.value) and "\n" not in str(foreign.value)


def test_an_unreachable_milvus_server_stops_train_index_before_encoding_with_one_line(milvus_modules, model_folder,
                                                                                      tmp_path):
    from helpers.milvus_server import free_loopback_port

    folder = tmp_path / "videos"
    write_noise_video(folder / "clip0.mp4", seed=1)
    uri = f"http://127.0.0.1:{free_loopback_port()}"
    result = subprocess.run([sys.executable, "-m", "train.index", "--model", str(model_folder), "--videos",
                             str(folder), "--store", str(tmp_path / "store"), "--milvus", uri],
                            capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: Milvus {uri} (collection 'videos') cannot be "
                                                              "opened: Fail connecting to server")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "store").exists()


def test_a_milvus_lite_file_open_in_another_process_is_refused_with_the_reason(milvus_modules, tmp_path):
    from testa_search.milvus import MilvusHome, MilvusHomeError

    db = tmp_path / "videos.db"
    holder = subprocess.Popen([sys.executable, "-c", f"from pymilvus import MilvusClient; c = MilvusClient({str(db)!r})"
                               "; print('open', flush=True); import time; time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(MilvusHomeError, match="is open in another process"):
            MilvusHome(str(db)).check_settings({"projection_dim": 8})
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_milvus_search_asks_the_server_for_no_row_count_and_filters_folders_exactly(milvus_modules, tmp_path):
    """Top-k in folder ``a_1`` gives k rows of ``a_1`` (a `like` pattern read ``_`` as a wildcard and ``aX1`` rows
    took places that were then dropped), and searching never counts the collection's rows (O(rows) in Milvus)."""
    from testa_search.milvus import MilvusHome

    entries = [IndexEntry(f"/data/{folder}/clip{i}.mp4") for folder in ("a_1", "aX1", "a%1") for i in range(8)]
    vectors = torch.nn.functional.normalize(torch.randn(len(entries), 16, generator=torch.Generator().manual_seed(3)),
                                            dim=1)

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(vectors, requires_grad=False)

        def get_video_tokens(self, pixel_values):
            from types import SimpleNamespace

            return SimpleNamespace(last_hidden_state=self.table[pixel_values.long()].unsqueeze(1), token_sizes=None)

        def get_video_features(self, video_tokens, video_token_sizes=None):
            from types import SimpleNamespace

            return SimpleNamespace(pooler_output=video_tokens[:, 0])

    home = MilvusHome(str(tmp_path / "videos.db"))
    index = IndexBuild(home, {"model_class": "Lookup", "projection_dim": 16}).run(
        Lookup(), entries, lambda rows, positions: ([[p], torch.tensor([p]), []] for p in positions)).index
    counted = []
    original = index.home.client.get_collection_stats
    index.home.client.get_collection_stats = lambda *a, **k: counted.append(1) or original(*a, **k)
    query = vectors[:1]
    for k in (6, 8):
        _, rows = index.nearest(query, k, filters={"folder": "/data/a_1"})
        found = [index.entry(int(r))["video"] for r in rows[0]]
        exact = (vectors[:8].double() @ query[0].double()).topk(k).indices.tolist()
        assert found == [entries[i].video for i in exact]
    assert len(index) == len(entries) and counted == []


def test_the_milvus_token_reaches_pymilvus_from_the_option_and_the_environment(milvus_modules, model_folder, tmp_path,
                                                                               monkeypatch):
    pymilvus, _ = milvus_modules
    seen = record_milvus_tokens(monkeypatch, pymilvus)
    folder = tmp_path / "videos"
    write_noise_video(folder / "clip0.mp4", seed=1)
    db = str(tmp_path / "videos.db")
    train_index(model_folder, folder, tmp_path / "store", "--milvus", db, "--milvus-token", "user:secret")
    assert seen and set(seen) == {"user:secret"}
    seen.clear()
    monkeypatch.setenv("MILVUS_TOKEN", "from-the-environment")
    from testa_search.cli.search import main as search_main

    search_main(["--store", str(tmp_path / "store"), "--milvus", db, "--json", "a query"])
    assert seen and set(seen) == {"from-the-environment"}


def test_two_evaluations_into_one_store_dir_each_encode_their_own_model(pipe, tmp_path):
    """The evaluation's scratch store holds the model of the last evaluation, not the first one's shards (their
    closed markers once made the second evaluation publish the first one's embeddings); a folder holding a real store
    is refused, and left as it was."""
    from accelerate import Accelerator

    from testa_search.encoding import DecodeVideos
    from train.evaluation import encode_to_store

    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(3)]
    second = build_retrieval(seed=7)
    for model in (pipe.model, second):
        store, _ = encode_to_store(model, videos, DecodeVideos(pipe.video_processor, 4), Accelerator(cpu=True),
                                   tmp_path / "eval", batch_size=2, token_dtype=torch.float32)
        fresh = VideoTextRetrievalPipeline(model=model, processor=tiny_processor(), device="cpu").encode_videos(videos)
        torch.testing.assert_close(store.embeddings, fresh.embeddings, rtol=0, atol=1e-5)
        store.close()
    real = tmp_path / "real"
    pipe.encode_videos(videos, store_dir=real)
    before = snapshot(real)
    with pytest.raises(IndexSettingsError, match="holds a video store: an evaluation's scratch store rewrites"):
        encode_to_store(pipe.model, videos, DecodeVideos(pipe.video_processor, 4), Accelerator(cpu=True), real,
                        batch_size=2)
    assert snapshot(real) == before


def test_a_save_killed_halfway_is_finished_with_its_own_rows(pipe, tmp_path, monkeypatch):
    """`VideoIndex.save(as_store=True)` writes its rows' plan before its shard, so the next build into that folder
    resumes it with the save's rows in the save's order (a build in another order once took the journal's rows for
    other videos, and published one video under another's name)."""
    from testa_search.store.video_store import VideoStoreWriter

    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(4)]
    broken = tmp_path / "videos" / "broken.mp4"
    broken.write_text("not a video")
    index = pipe.encode_videos([videos[2], str(broken), videos[0], videos[3]], token_dtype=torch.float32)

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(VideoStoreWriter, "add_failure", killed)  # after the encoded rows, before the failed one
    with pytest.raises(KeyboardInterrupt):
        index.save(tmp_path / "saved", as_store=True)
    monkeypatch.undo()
    grown = pipe.encode_videos(sorted([*videos, str(broken)]), store_dir=tmp_path / "saved")
    fresh = pipe.encode_videos(videos, token_dtype=torch.float32)
    by_name = dict(zip(fresh.names, fresh.embeddings, strict=True))
    valid = grown.valid
    assert {grown.names[i] for i in range(len(grown)) if valid[i]} == set(videos)
    for i in range(len(grown)):
        if valid[i]:
            torch.testing.assert_close(grown.embeddings[i], by_name[grown.names[i]], rtol=0, atol=1e-5)
    assert [f.video for f in grown.failures] == [str(broken)]


def test_milvus_takes_stores_of_either_token_dtype_and_searches_collections_of_earlier_versions(
        milvus_modules, model_folder, tmp_path, caplog):
    """The tokens stay in the stores: two stores of one model with float16 and float32 tokens share a collection. A
    collection written before collections recorded their settings is searched (with a warning) but takes no rows."""
    pymilvus, _ = milvus_modules
    from testa_search.milvus import MilvusHome, MilvusHomeError
    from testa_search import open_index

    folder = tmp_path / "videos"
    for i in range(3):
        write_noise_video(folder / f"clip{i}.mp4", seed=i)
    db = str(tmp_path / "videos.db")
    train_index(model_folder, folder, tmp_path / "fp32", "--milvus", db)
    from testa_search.cli.index import main as index_main

    index_main(["--model", str(model_folder), "--videos", str(folder), "--store", str(tmp_path / "fp16"),
                "--num-workers", "0", "--token-dtype", "float16", "--milvus", db])
    assert len(MilvusHome(db).open().all_rows()) == 3
    home = MilvusHome(db)
    home.check_settings({**VideoIndex.load(tmp_path / "fp32").info, "projection_dim": 16})
    client = pymilvus.MilvusClient(db)
    client.drop_collection("old")
    client.close()
    earlier = MilvusHome(db, "old")
    earlier.create_collection(16, {})  # this module's fields ...
    earlier.call("cannot drop the property", "drop_collection_properties", "old",
                 property_keys=["testa.index_settings"])  # ... without the recorded settings, as before
    with pytest.raises(MilvusHomeError, match="written by an earlier version"):
        MilvusHome(db, "old").check_settings({"projection_dim": 16})
    with caplog.at_level("WARNING"):
        searched = open_index(str(tmp_path / "fp32"), db, "old")
    assert len(searched) == 0 and "records no settings" in caplog.text


@pytest.mark.parametrize("milvus", ["lite file", "server"])
def test_train_index_on_two_processes_mirrors_into_milvus(milvus_modules, model_folder, tmp_path, milvus):
    """A Lite file takes one process at a time: the main process upserts every shard into it (each process opening
    it made the second one die with "Open local milvus failed"). A server takes each process' own shards (the
    processes that did not check the collection once refused to write, after everything was encoded)."""
    import contextlib

    from helpers.milvus_server import milvus_lite_server
    from helpers.pipelines import INDEX_LAUNCH_2

    from testa_search.milvus import MilvusHome

    folder = tmp_path / "videos"
    for i in range(6):
        write_noise_video(folder / f"clip{i}.mp4", seed=50 + i)
    (tmp_path / "milvus").mkdir()
    served = milvus_lite_server(tmp_path / "milvus") if milvus == "server" else contextlib.nullcontext()
    with served as uri:
        uri = uri or str(tmp_path / "videos.db")
        result = subprocess.run([*INDEX_LAUNCH_2, "--model", str(model_folder), "--videos", str(folder), "--store",
                                 str(tmp_path / "store"), "--num-workers", "0", "--shard-size", "2", "--milvus", uri],
                                capture_output=True, text=True, cwd=ROOT, timeout=900,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        rows = MilvusHome(uri).open().all_rows()
    assert sorted(row["video"] for row in rows) == sorted(str(p) for p in folder.glob("*.mp4"))
    assert VideoIndex.load(tmp_path / "store").num_encoded == 6


def test_a_store_that_does_not_say_which_model_encoded_it_is_not_grown(pipe, tmp_path):
    """An earlier evaluation's store records only its frames; an index saved from memory records its weights' hash,
    so a model retrained into the same folder is refused (it once added its rows to the other model's)."""
    from testa_search.store.video_store import VideoStoreWriter, finalize_store

    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(3)]
    legacy = tmp_path / "legacy_eval"
    with VideoStoreWriter(legacy, 0, 0, 1, token_dtype=torch.float16) as writer:
        out = pipe.model.get_video_tokens(pipe.video_processor(videos=[videos[0]])["pixel_values"])
        features = pipe.model.get_video_features(video_tokens=out.last_hidden_state,
                                                 video_token_sizes=out.token_sizes).pooler_output
        writer.add_batch([0], out.last_hidden_state, out.token_sizes, features)
    finalize_store(legacy, videos[:1], 1, {"num_frames": 4})
    with pytest.raises(IndexSettingsError, match="does not record which model encoded it"):
        pipe.encode_videos(videos, store_dir=legacy)
    saved = tmp_path / "saved"
    pipe.encode_videos(videos[:2]).save(saved, as_store=True)
    retrained = VideoTextRetrievalPipeline(model=build_retrieval(seed=3), processor=tiny_processor(), device="cpu")
    with pytest.raises(IndexSettingsError, match="model_weights_sha256"):
        retrained.encode_videos(videos, store_dir=saved)
    assert pipe.encode_videos(videos, store_dir=saved).stats["videos"] == 1  # the same model grows it


def test_an_index_refuses_a_model_under_another_merge_rule(pipe, tmp_path):
    """The rule the merges were decided by (`score_grid`) is a setting of the index: growing or searching it with the
    same weights under another rule is refused, naming it, before anything is encoded."""
    videos = [str(write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)) for i in range(2)]
    index = pipe.encode_videos(videos[:1], store_dir=tmp_path / "store")
    assert index.info["score_grid"] == pipe.model.config.vision_config.score_grid == 2.0**-10
    raw = build_retrieval()
    raw.load_state_dict(pipe.model.state_dict())
    raw.set_aggregation(score_grid=0.0)
    other = VideoTextRetrievalPipeline(model=raw, processor=tiny_processor(), device="cpu")
    before = snapshot(tmp_path / "store")
    with pytest.raises(IndexSettingsError, match=r"score_grid: the index has 0.0009765625, this build 0.0"):
        other.encode_videos(videos, store_dir=tmp_path / "store")
    assert snapshot(tmp_path / "store") == before
    with pytest.raises(ValueError, match="score_grid = 0.0009765625, but this model has score_grid = 0.0"):
        other.search(QUERY, VideoIndex.load(tmp_path / "store"))


def test_an_optimized_model_is_named_by_the_weights_it_was_given(model_folder):
    """The weights' fingerprint an index records is the one of the weights `optimize_for_inference` was given: an int8
    model (its linears converted, the text model's too with ``include_text``) and the fp32 model it came from name the
    same weights, so a store built before the conversion is grown by the converted model (the precision, recorded
    beside, still tells them apart); weights changed after the conversion are not those any more. A hash computed
    here by hand is the reference."""
    import hashlib

    from safetensors.torch import load_file

    from modeling_testa import TestaForVideoTextRetrieval
    from testa_runtimes import optimize_for_inference
    from testa_search.settings import weights_fingerprint

    plain = TestaForVideoTextRetrieval.from_pretrained(model_folder)
    state = dict(plain.state_dict())  # the reference: the loaded weights, hashed by hand
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        tensor = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    assert weights_fingerprint(plain) == digest.hexdigest()
    assert set(load_file(model_folder / "model.safetensors")) <= set(state)
    for include_text in (False, True):
        with pytest.warns(FutureWarning):  # the legacy torch int8 says it is deprecated
            converted = optimize_for_inference(TestaForVideoTextRetrieval.from_pretrained(model_folder), "int8",
                                               include_text=include_text)
        assert converted.inference_settings["converted_linears"] > 0
        with torch.inference_mode():  # encoding leaves the weights as they were
            converted.get_video_features(pixel_values=torch.randn(1, 4, 3, 32, 32))
        assert build_settings(converted, 4)["model_weights_sha256"] == digest.hexdigest()
        assert build_settings(converted, 4)["precision"] != build_settings(plain, 4)["precision"]
    with torch.no_grad():  # weights changed after the conversion are other weights: hashed again, and refused
        next(p for p in converted.parameters() if p.is_floating_point()).add_(1.0)
    assert build_settings(converted, 4)["model_weights_sha256"] != digest.hexdigest()


def test_remove_also_removes_the_rows_from_the_milvus_mirror(milvus_modules, model_folder, tmp_path, capsys):
    """`train.index --remove PATH --milvus DB`: the removed video leaves the Milvus mirror as it leaves the store; the
    others remain, and their rows name the store positions of their tokens after the renumbering (a Milvus search
    re-ranked from the store equals the store's own search)."""
    from testa_search.cli.index import main as index_main
    from testa_search.cli.search import search
    from testa_search.milvus import MilvusHome

    folder = tmp_path / "videos"
    for i in range(5):
        write_noise_video(folder / f"clip{i}.mp4", seed=40 + i)
    db, store = str(tmp_path / "videos.db"), tmp_path / "store"
    train_index(model_folder, folder, store, "--milvus", db)
    videos = sorted(str(path) for path in folder.glob("*.mp4"))
    assert sorted(row["video"] for row in MilvusHome(db).open().all_rows()) == videos
    report = index_main(["--store", str(store), "--remove", videos[1], "--milvus", db])
    assert report["removed"] == [videos[1]] and report["milvus_rows_removed"] == 1
    assert "Removed 1 rows from Milvus" in capsys.readouterr().out
    rows = MilvusHome(db).open().all_rows()
    assert sorted(row["video"] for row in rows) == videos[:1] + videos[2:]
    queries = ["a red square", "green blocks", "gray"]
    from_store = search(str(store), queries, top_k=4)
    from_milvus = search(str(store), queries, top_k=4, milvus=db)
    assert all(videos[1] not in [r["video"] for r in ranked] for ranked in from_milvus)
    assert [[r["video"] for r in ranked] for ranked in from_milvus] == [[r["video"] for r in ranked]
                                                                        for ranked in from_store]
    # the store's rows after the removed one point at their new positions
    home = MilvusHome(db)
    stored = {row["video"]: row["row"] for row in home.client.query(home.collection, filter="", limit=100,
                                                                     output_fields=["video", "row"])}
    assert [stored[video] for video in videos[:1] + videos[2:]] == [0, 1, 2, 3]


def test_remove_with_a_missing_milvus_collection_leaves_the_store_untouched(milvus_modules, model_folder, tmp_path):
    from testa_search.cli.index import main as index_main

    folder = tmp_path / "videos"
    for i in range(3):
        write_noise_video(folder / f"clip{i}.mp4", seed=60 + i)
    store = tmp_path / "store"
    train_index(model_folder, folder, store)
    before = {path.name: path.read_bytes() for path in store.iterdir() if path.is_file()}
    with pytest.raises(SystemExit, match=r"^error: Milvus .*nowhere\.db \(collection 'videos'\) does not exist"):
        index_main(["--store", str(store), "--remove", str(folder / "clip0.mp4"), "--milvus",
                    str(tmp_path / "nowhere.db")])
    assert {path.name: path.read_bytes() for path in store.iterdir() if path.is_file()} == before
