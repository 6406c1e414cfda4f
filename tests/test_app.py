"""The Gradio app (`app/app.py`): every API name through `gradio_client`, bad inputs, concurrent searches, and a real
browser (Playwright on the system Chromium) typing a paragraph and reading the results.

References: the retrieval pipeline's own `search` on the same index, PNG headers, the labels given."""

import importlib.util
import os
import re
import shutil
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import torch
from helpers.pipelines import build_qa, build_retrieval, save_folder, tiny_processor, write_bad_files
from helpers.milvus_server import record_milvus_tokens
from helpers.requirements import require, skip_or_fail
from helpers.videos import write_bad_videos, write_noise_video, write_video

gr = require("gradio")  # the `app` extra, installed by `make test`
gradio_client = require("gradio_client")

APP = Path(__file__).resolve().parents[1] / "app" / "app.py"
QUERY = "first the screen is red. a blue square flashes. finally the screen is green."
A_PATH = re.compile(r"[\\/][^\s\\/]+[\\/]")  # a folder in a message: "/tmp/", "/gradio/"


def load_app_module():
    spec = importlib.util.spec_from_file_location("testa_app", APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(path: str) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


STALL = 120  # seconds: a bound on a stalled step (waits are on conditions), never a guess of how long one takes


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app as `app.py --videos VIDEOS --qa-model QA --allow-settings --allow-folders` starts it, its start-up
    index finished.
    The fixture's client is one visitor (one session) for the whole module."""
    os.environ.setdefault("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
    root = tmp_path_factory.mktemp("app")
    model = save_folder(build_retrieval(), tiny_processor(), root / "model")
    qa = save_folder(build_qa(), tiny_processor(), root / "qa")
    for i in range(6):
        write_noise_video(root / "videos" / f"clip{i}.mp4", seed=i)
    module = load_app_module()
    state = module.load_state(str(model), str(root / "videos"), str(qa))
    assert state.model_error is None and state.qa_error is None
    state.allow_settings = state.allow_folders = True
    job = module.startup_index(state, str(root / "videos"))
    assert job.wait(STALL), job.describe()
    demo = module.build_app(state)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, show_error=True,
                            theme=module.THEME)
    client = gradio_client.Client(url, verbose=False)
    yield module, state, client, root, url
    demo.close()


def test_every_api_name_answers(served):
    module, state, client, root, _ = served
    assert state.served.index_status.startswith("Indexed 6 videos: ") and "videos/s" in state.served.index_status
    status = client.predict(str(root / "videos"), None, api_name="/index")  # the served folder: nothing to encode
    assert status == "Indexed 6 videos (0 new, 6 already indexed): nothing new to encode."

    gallery, table, best = client.predict(QUERY, 4, True, api_name="/search")
    expected = state.retrieval.search(QUERY, state.served.index, top_k=4)
    assert [row[1] for row in table["data"]] == [Path(hit["video"]).name for hit in expected]
    assert [row[2] for row in table["data"]] == [round(hit["score"], 4) for hit in expected]
    _, cosine, _ = client.predict(QUERY, 4, False, api_name="/search")
    by_cosine = state.retrieval.search(QUERY, state.served.index, top_k=4, rerank=False)
    assert [row[1:] for row in cosine["data"]] == [[Path(h["video"]).name, round(h["score"], 4), False]
                                                   for h in by_cosine]
    # each tile is a picture of the video's middle frame (a thumbnail at once, not a player waiting for its video)
    assert len(gallery) == 4 and all(item["image"].endswith(".png") for item in gallery), gallery
    import av

    def frame_size(video: str) -> tuple[int, int]:
        with av.open(video) as container:
            return container.streams.video[0].width, container.streams.video[0].height

    assert [png_size(item["image"]) for item in gallery] == [frame_size(hit["video"]) for hit in expected]
    assert best == expected[0]["video"]

    merges, grounding, caption = client.predict(best, QUERY, api_name="/visualize")
    from modeling_testa import visualize_aggregation

    reference = visualize_aggregation(state.retrieval.model, state.retrieval.processor, best)
    assert png_size(merges) == reference.size
    assert png_size(grounding)[0] > 0 and Path(best).name in caption

    scores = client.predict(best, "red screen, green screen, blue square", api_name="/classify")
    assert sorted(c["label"] for c in scores["confidences"]) == ["blue square", "green screen", "red screen"]
    assert sum(c["confidence"] for c in scores["confidences"]) == pytest.approx(1.0, abs=1e-5)

    answer = client.predict(best, "what color is the screen?", api_name="/answer")
    expected_answer = state.qa(video=best, question="what color is the screen?")[0]["answer"]
    assert answer == expected_answer

    panel = client.predict(0, 0, api_name="/aggregation")  # the served collection (the visitor added nothing)
    assert "R_T [0, 0], R_S [0, 0]" in panel and panel.count("Re-indexed 6 videos") == 1 and "1.00x" in panel
    panel = client.predict(1, 3, api_name="/aggregation")  # back to the model's own settings
    assert "R_T [1, 1], R_S [3, 3]" in panel


def test_bad_inputs_get_a_message_and_the_app_keeps_serving(served, tmp_path):
    module, state, client, root, _ = served
    AppError = gradio_client.exceptions.AppError
    client.predict(str(root / "videos"), None, api_name="/index")
    with pytest.raises(AppError, match="Type a sentence"):
        client.predict("   ", 3, True, api_name="/search")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AppError, match="No video to index"):
        client.predict(str(empty), None, api_name="/index")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video")
    bad = write_bad_files(tmp_path / "bad", str(root / "videos" / "clip0.mp4"))
    uploads = [gradio_client.handle_file(str(notes)), gradio_client.handle_file(bad["truncated"]),
               gradio_client.handle_file(str(root / "videos" / "clip1.mp4"))]
    status = client.predict("", uploads, api_name="/index")
    assert status.startswith("Indexed 1 videos")
    assert "Not a video, skipped: notes.txt" in status and "Could not be decoded, skipped: truncated.mp4" in status
    # the file's name and a plain reason: no upload path (a temporary folder of gradio's), no errno number
    uploaded = {str(Path(os.environ["GRADIO_TEMP_DIR"]).resolve()), os.environ["GRADIO_TEMP_DIR"], "gradio"}
    assert not any(part in status for part in uploaded) and "Errno" not in status and not A_PATH.search(status)
    with pytest.raises(AppError) as refused:  # every upload unreadable: the reasons, as plainly
        client.predict("", [gradio_client.handle_file(bad["truncated"]), gradio_client.handle_file(bad["text"])],
                       api_name="/index")
    message = str(refused.value)
    assert "No video could be indexed: 2 of 2 videos" in message and "truncated.mp4: " in message
    assert "Errno" not in message and not A_PATH.search(message), message
    with pytest.raises(AppError, match="does not exist"):
        client.predict(str(tmp_path / "gone.mp4"), "x", api_name="/visualize")
    with pytest.raises(AppError, match="at least two labels"):
        client.predict(str(root / "videos" / "clip0.mp4"), "only one", api_name="/classify")
    with pytest.raises(AppError, match="greater than maximum value 2"):  # R_T up to half of the 4 frames
        client.predict(99, 0, api_name="/aggregation")
    # still serving, with the index from the last successful /index
    _, table, _ = client.predict(QUERY, 3, True, api_name="/search")
    assert len(table["data"]) == 1

    missing = module.load_state(str(tmp_path / "no_model"), None, None)
    assert "could not be loaded" in missing.model_error and str(tmp_path / "no_model") in missing.model_error
    demo = module.build_app(missing)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, show_error=True)
    try:
        other = gradio_client.Client(url, verbose=False)
        with pytest.raises(AppError, match="No retrieval model is loaded"):
            other.predict(QUERY, 3, True, api_name="/search")
        with pytest.raises(AppError, match="start the app with --qa-model"):
            other.predict(str(root / "videos" / "clip0.mp4"), "why?", api_name="/answer")
    finally:
        demo.close()


def test_without_allow_folders_a_visitor_names_only_the_served_collection_and_uploads(served, tmp_path):
    """A visitor of an app started without --allow-folders cannot have it index or decode a file of the server
    outside the served collection (the Folder box, and the Visualize, Classify and Ask boxes): the served folder (as
    any path to it), its videos and the visitor's uploads are what they may name; anything else is refused with the
    reason, naming the flag."""
    module, state, _, root, _ = served
    AppError = gradio_client.exceptions.AppError
    assert not module.parse_args([]).allow_folders and module.parse_args(["--allow-folders"]).allow_folders
    closed = module.load_state(str(root / "model"), str(root / "videos"), str(root / "qa"))  # no --allow-folders
    closed.served = state.served  # the same served collection, already indexed
    outside = write_noise_video(tmp_path / "elsewhere" / "private.mp4", seed=91)
    demo = module.build_app(closed)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, show_error=True)
    try:
        client = gradio_client.Client(url, verbose=False)
        for folder in (tmp_path / "elsewhere", root / "videos" / ".." / "qa"):  # another folder; `..` out of it
            with pytest.raises(AppError, match="only the served collection's folder .* --allow-folders"):
                client.predict(str(folder), None, api_name="/index")
        status = client.predict(str(root / "videos" / ".." / "videos"), None, api_name="/index")
        assert status == "Indexed 6 videos (0 new, 6 already indexed): nothing new to encode."
        served_video = str(root / "videos" / "clip0.mp4")
        for api, arguments in (("/visualize", ("a square",)), ("/classify", ("red screen, green screen",)),
                               ("/answer", ("what color is the screen?",))):
            with pytest.raises(AppError, match="'private.mp4' is not a video of this collection.*--allow-folders"):
                client.predict(str(outside), *arguments, api_name=api)
            assert client.predict(served_video, *arguments, api_name=api)  # a video of the served folder
        # an upload is the visitor's: indexed (a new index of the uploads alone), then theirs to inspect
        status = client.predict("", [gradio_client.handle_file(str(outside))], api_name="/index")
        assert status.startswith("Indexed 1 videos: ")
        _, table, best = client.predict(QUERY, 1, False, api_name="/search")
        assert [row[1] for row in table["data"]] == ["private.mp4"] and best != str(outside)  # gradio's copy
        scores = client.predict(best, "red screen, green screen", api_name="/classify")
        expected = closed.classifier(best, candidate_labels=["red screen", "green screen"])
        assert {c["label"]: c["confidence"] for c in scores["confidences"]} == pytest.approx(
            {item["label"]: item["score"] for item in expected}, abs=1e-6)
        with pytest.raises(AppError, match="'private.mp4' is not a video of this collection"):
            client.predict(str(outside), "red screen, green screen", api_name="/classify")  # the server's own file
    finally:
        demo.close()


def test_a_video_that_cannot_be_read_first_gets_its_failure_record(served, tmp_path):
    """`encode_first_video`: the first video of a new index, when it cannot be read, gives no index and the failure
    the library records for it (as when it is added to an index: the reference); a readable one gives its index."""
    module, state, _, root, _ = served
    bad = write_bad_files(tmp_path / "bad", str(root / "videos" / "clip0.mp4"))
    calls = []
    encode = state.retrieval.encode_videos

    def counted(videos, *args, **kwargs):
        calls.append(list(videos))
        return encode(videos, *args, **kwargs)

    options = {"batch_size": 8, "progress_bar": False}
    retrieval = type("Counted", (), {"encode_videos": staticmethod(counted)})()
    index, failure = module.encode_first_video(retrieval, bad["truncated"], options)
    reference = encode([bad["truncated"]], index=module.snapshot(state.served.index), **options).failures[-1]
    assert index is None and (failure["video"], failure["code"]) == (reference.video, reference.code), failure
    assert calls == [[bad["truncated"]]], calls  # decoded once: the failure comes with NoReadableVideoError
    index, failure = module.encode_first_video(state.retrieval, str(root / "videos" / "clip0.mp4"), options)
    assert failure is None and index.names == [str(root / "videos" / "clip0.mp4")]


def test_index_encodes_each_video_once_lists_the_bad_files_and_grows(served, tmp_path, monkeypatch):
    module, state, client, root, _ = served
    monkeypatch.setattr(module, "CHUNK_VIDEOS", 2)  # several steps, each published (one video until one is indexed)
    folder = tmp_path / "mixed"
    good = [write_noise_video(folder / f"good{i}.mp4", seed=40 + i) for i in range(5)]
    bad = write_bad_videos(folder, write_video(tmp_path / "source.mp4", 30, width=176, height=144), prefix="bad_")
    (folder / "readme.txt").write_text("not a video")
    encoded = []
    encode = state.retrieval.model.get_video_tokens
    monkeypatch.setattr(state.retrieval.model, "get_video_tokens",
                        lambda pixel_values, *a, **k: encoded.append(pixel_values.shape[0]) or encode(pixel_values, *a, **k))
    status = client.predict(str(folder), None, api_name="/index")
    assert sum(encoded) == len(good)  # one pass: every good video encoded once, the bad ones never
    lines = status.splitlines()
    assert lines[0].startswith("Indexed 5 videos: ") and "Not a video, skipped: readme.txt" in lines
    for code, path in bad.items():
        assert any(line.startswith(f"Could not be decoded, skipped: {path.name}: {code}: ") for line in lines), code
    _, table, _ = client.predict(QUERY, 20, True, api_name="/search")  # the visitor's own index: that folder's
    assert sorted(row[1] for row in table["data"]) == sorted(p.name for p in good)

    encoded.clear()  # the same folder again, with one video more: only that one is encoded
    write_noise_video(folder / "good_new.mp4", seed=60)
    status = client.predict(str(folder), None, api_name="/index")
    assert sum(encoded) == 1 and status.startswith("Indexed 6 videos (1 new, 5 already indexed): ")
    assert sum(line.startswith("Could not be decoded, skipped: ") for line in status.splitlines()) == len(bad)
    encoded.clear()
    status = client.predict(str(folder), None, api_name="/index")
    assert encoded == [] and status.startswith("Indexed 6 videos (0 new, 6 already indexed): nothing new")
    _, table, _ = client.predict(QUERY, 20, True, api_name="/search")
    assert sorted(row[1] for row in table["data"]) == sorted([p.name for p in good] + ["good_new.mp4"])
    # one more file, which cannot be read: nothing was encoded, so no speed is claimed
    (folder / "broken_new.mp4").write_text("not a video either")
    status = client.predict(str(folder), None, api_name="/index")
    assert encoded == [] and "videos/s" not in status, status
    assert status.splitlines()[0] == "Indexed 6 videos (0 new, 6 already indexed): nothing could be encoded."
    assert any(line.startswith("Could not be decoded, skipped: broken_new.mp4: ") for line in status.splitlines())


def test_eight_simultaneous_searches_get_the_ranking_of_one(served):
    _, _, _, _, url = served
    alone = gradio_client.Client(url, verbose=False).predict(QUERY, 5, True, api_name="/search")[1]["data"]

    def search(_):
        return gradio_client.Client(url, verbose=False).predict(QUERY, 5, True, api_name="/search")[1]["data"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(search, range(8)))
    assert results == [alone] * 8


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if found is None:
        skip_or_fail("no system Chromium", "apt-get install chromium  (.ci/run installs it)")
    return found


def launch_chromium(playwright, executable: str):
    """The system Chromium, headless, talking to nothing but the app (and playing videos without a gesture)."""
    return playwright.chromium.launch(executable_path=executable, args=[
        "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--autoplay-policy=no-user-gesture-required"])


def test_a_browser_searches_and_sees_results_and_the_merge_picture(served, tmp_path):
    _, state, _, _, url = served
    executable = chromium()
    sync_api = require("playwright.sync_api")
    expected = [Path(hit["video"]).name for hit in state.retrieval.search(QUERY, state.served.index, top_k=5)]
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, executable)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            hosts = set()
            page.on("request", lambda request: hosts.add(request.url.split("/")[2]))
            page.goto(url)
            page.get_by_label("Paragraph").fill(QUERY)
            page.get_by_role("button", name="Search", exact=True).click()
            rows = page.get_by_role("row").filter(has_text=".mp4")
            sync_api.expect(rows).to_have_count(5, timeout=60_000)
            names = [next(w for w in rows.nth(i).inner_text().split() if w.endswith(".mp4")) for i in range(5)]
            assert names == expected
            # every tile shows its thumbnail (a picture, loaded), none a player; no moment widget for whole videos
            for rank in range(1, 6):
                tile = page.get_by_role("button", name=f"Thumbnail {rank} of 5").locator("img")
                sync_api.expect(tile).to_have_count(1, timeout=30_000)
                page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=tile.element_handle())
            assert page.locator("video").count() == 0
            for widget in ("Show the moment", "Moment of result", "The moment", "Frames of the moment"):
                sync_api.expect(page.get_by_text(widget, exact=True).first).to_be_hidden()
            page.get_by_role("button", name="What did TESTA merge?").click()
            image = page.locator("img[src*='merges_']")  # the merge picture's file name
            sync_api.expect(image).to_have_count(1, timeout=60_000)
            image.scroll_into_view_if_needed()
            page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=image.element_handle())
            page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
            assert png_size(str(tmp_path / "app.png"))[0] == 1280
            assert hosts <= {url.split("/")[2]}, hosts  # nothing but the app's own address
        finally:
            browser.close()


def visitor(browser, url: str, sync_api):
    """A new visitor: a browser context of its own (its own cookies and session), on the app's page."""
    page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
    page.goto(url)
    sync_api.expect(page.get_by_label("Index", exact=True)).not_to_have_value("", timeout=30_000)
    return page


def searched_names(page, sync_api, count: int) -> list[str]:
    """Searches the query for `count` results and reads the ranking's video names."""
    page.get_by_label("Paragraph").fill(QUERY)
    page.get_by_role("slider", name="Results").fill(str(count))
    page.get_by_role("button", name="Search", exact=True).click()
    rows = page.get_by_role("grid", name="Ranking").get_by_role("row").filter(has_text=".mp4")  # not the uploads' list
    sync_api.expect(rows).to_have_count(count, timeout=60_000)
    return [next(w for w in rows.nth(i).inner_text().split() if w.endswith(".mp4")) for i in range(count)]


def test_two_visitors_are_apart(served, tmp_path):
    """One visitor's uploads, their index rows and their failed uploads are theirs: another visitor (a second
    browser context) searches the served collection without them, and sees the served collection's Index box. R_T/R_S
    are the operator's: on an app started without --allow-settings a visitor cannot change them, and every page shows
    the model's settings as they are when it loads."""
    module, state, _, root, _ = served
    executable = chromium()
    sync_api = require("playwright.sync_api")
    upload = write_noise_video(tmp_path / "uploaded_by_one.mp4", seed=77)
    broken = tmp_path / "broken_upload.mp4"
    broken.write_text("not a video")
    closed = module.load_state(str(root / "model"), str(root / "videos"), None)  # --allow-settings not given
    closed.served = state.served  # the same served collection, already indexed
    demo = module.build_app(closed)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, show_error=True)
    served_status = state.served.index_status
    try:
        with sync_api.sync_playwright() as playwright:
            browser = launch_chromium(playwright, executable)
            try:
                one, two = visitor(browser, url, sync_api), visitor(browser, url, sync_api)
                # visitor one adds an upload (and a broken one) to the served folder's videos
                one.locator("input[type=file][multiple]").set_input_files([str(upload), str(broken)])
                listed = one.get_by_role("cell", name="uploaded_by_one.mp4")  # uploaded
                sync_api.expect(listed).to_be_visible(timeout=30_000)
                one.get_by_role("button", name="Index", exact=True).click()
                box_one = one.get_by_label("Index", exact=True)
                sync_api.expect(box_one).to_have_value(re.compile(r"^Indexed 7 videos \(1 new, 6 already indexed\)"),
                                                       timeout=60_000)
                assert "Could not be decoded, skipped: broken_upload.mp4: " in box_one.input_value()
                assert "uploaded_by_one.mp4" in searched_names(one, sync_api, 7)
                # visitor two: the served collection only, and its own Index box
                assert sorted(searched_names(two, sync_api, 6)) == [f"clip{i}.mp4" for i in range(6)]
                assert two.get_by_label("Index", exact=True).input_value() == served_status
                # a page loaded now: still the served collection, without anything of visitor one's
                three = visitor(browser, url, sync_api)
                assert three.get_by_label("Index", exact=True).input_value() == served_status
                assert "uploaded_by_one.mp4" not in searched_names(three, sync_api, 6)

                # settings: not a visitor's to change here; both pages show the model's own settings
                for page in (one, two):
                    page.get_by_role("tab", name="Model").click()
                    sync_api.expect(page.get_by_text("R_T [1, 1], R_S [3, 3]")).to_be_visible(timeout=30_000)
                    sync_api.expect(page.get_by_role("button", name="Apply and re-index")).to_be_disabled()
                with pytest.raises(gradio_client.exceptions.AppError, match="Changing R_T/R_S is off"):
                    gradio_client.Client(url, verbose=False).predict(0, 0, api_name="/aggregation")
                assert closed.retrieval.model.config.vision_config.temporal_reduction_per_layer == [1, 1]
            finally:
                browser.close()
    finally:
        demo.close()
    assert state.served.index_status == served_status and len(state.served.index) == 6  # the served one untouched


def test_a_page_shows_the_settings_as_they_are_when_it_loads(served):
    """With --allow-settings a change is every visitor's: a page loaded after it shows the new R_T/R_S, tokens and
    sliders (the Model tab is filled when a page loads, not when the app starts)."""
    _, state, client, _, url = served
    executable = chromium()
    sync_api = require("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, executable)
        try:
            before = visitor(browser, url, sync_api)
            before.get_by_role("tab", name="Model").click()
            sync_api.expect(before.get_by_text("R_T [1, 1], R_S [3, 3]")).to_be_visible(timeout=30_000)
            client.predict(0, 0, api_name="/aggregation")
            try:
                after = visitor(browser, url, sync_api)
                after.get_by_role("tab", name="Model").click()
                sync_api.expect(after.get_by_text("R_T [0, 0], R_S [0, 0]")).to_be_visible(timeout=30_000)
                sync_api.expect(after.get_by_role("slider", name="R_T (frames merged per block)")).to_have_value("0")
                tokens = state.retrieval.model.config.vision_config
                assert tokens.temporal_reduction_per_layer == [0, 0]
            finally:
                client.predict(1, 3, api_name="/aggregation")  # back to the model's own settings
            again = visitor(browser, url, sync_api)
            again.get_by_role("tab", name="Model").click()
            sync_api.expect(again.get_by_text("R_T [1, 1], R_S [3, 3]")).to_be_visible(timeout=30_000)
            sync_api.expect(again.get_by_role("slider", name="R_T (frames merged per block)")).to_have_value("1")
        finally:
            browser.close()


def test_searches_wait_while_the_index_changes(served, monkeypatch):
    """/index, /search and /aggregation share one queue: a search never runs while the index grows or R_T/R_S
    change (each listener would otherwise have its own limit of one)."""
    module, state, client, root, _ = served
    client.predict(str(root / "videos"), None, api_name="/index")
    spans, guard = [], threading.Lock()

    def timed(function):
        def wrapper(*args, **kwargs):
            start = time.monotonic()
            time.sleep(0.4)  # long enough for the other request to arrive while this one runs
            try:
                return function(*args, **kwargs)
            finally:
                with guard:
                    spans.append((start, time.monotonic()))
        return wrapper

    monkeypatch.setattr(module, "index_videos", timed(module.index_videos))
    monkeypatch.setattr(module, "search_videos", timed(module.search_videos))
    jobs = [client.submit(str(root / "videos"), None, api_name="/index"),
            client.submit(QUERY, 3, False, api_name="/search"),
            client.submit(QUERY, 3, False, api_name="/search")]
    for job in jobs:
        job.result(timeout=120)
    spans.sort()
    assert len(spans) == 3
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:])), spans


def test_the_runtime_is_picked_by_name_and_an_engine_runs_isolated(served):
    module, _, _, root, _ = served
    state = module.load_state(str(root / "model"), None, None, "fp32", "openvino")
    assert state.model_error is None
    settings = state.retrieval.model.inference_settings
    assert (settings["runtime"], settings["precision"], settings["isolate"]) == ("openvino", "fp32", True)
    assert state.retrieval.model.vision_model.runtime.process.process is None  # the worker starts at the first call
    plain = module.load_state(str(root / "model"), None, None, "fp32", "torch")
    assert plain.retrieval.model.inference_settings["runtime"] == "torch-eager"
    bad = module.load_state(str(root / "model"), None, None, "fp32", "tensorrt")
    assert "backend='tensorrt' is not supported; allowed values are 'torch', 'openvino'" in bad.model_error
    assert module.parse_args(["--backend", "openvino", "--precision", "int8"]).backend == "openvino"


def test_a_milvus_token_from_the_environment_or_the_option_reaches_the_milvus_client(served, tmp_path, monkeypatch):
    """`--milvus-token` (default: env MILVUS_TOKEN, so that a secret need not be on the command line) is what the
    app's Milvus client logs in with; the index it opens searches as the store it was written with."""
    pymilvus = require("pymilvus")
    require("milvus_lite")
    from testa_search.cli.index import main as index_main

    module, state, _, root, _ = served
    store, milvus = tmp_path / "store", str(tmp_path / "videos.db")
    index_main(["--model", str(root / "model"), "--videos", str(root / "videos"), "--store", str(store),
                "--token-dtype", "float32", "--num-workers", "0", "--milvus", milvus])
    tokens = record_milvus_tokens(monkeypatch, pymilvus)
    monkeypatch.setenv("MILVUS_TOKEN", "reader:from-env")
    from_env = module.parse_args(["--index", str(store), "--milvus", milvus])
    given = module.parse_args(["--index", str(store), "--milvus", milvus, "--milvus-token", "reader:given"])
    assert (module.milvus_token(from_env), module.milvus_token(given)) == ("reader:from-env", "reader:given")
    index = module.open_index(str(store), milvus, "videos", module.milvus_token(from_env))  # as main opens --index
    assert tokens == ["reader:from-env"]
    from testa_search import VideoIndex

    got = state.retrieval.search(QUERY, index, top_k=3)
    want = state.retrieval.search(QUERY, VideoIndex.load(store), top_k=3)
    assert [hit["video"] for hit in got] == [hit["video"] for hit in want]
    assert [hit["score"] for hit in got] == pytest.approx([hit["score"] for hit in want], abs=1e-5)
    monkeypatch.delenv("MILVUS_TOKEN")
    assert module.milvus_token(from_env) is None
    with pytest.raises(SystemExit, match="--milvus-token needs --milvus"):
        module.main(["--milvus-token", "reader:given"])


# ------------------------------------------------------------------------------------------------ moments


FPS = {"long0.mp4": 4, "long1.mp4": 4, "ten_minutes.mp4": 1}
# windows of 20 s every 20 s (the library's default stride: the window): 60 s -> 3, 45 s -> 3 ((25, 45) last, moved
# back to end at the video's end), 600 s -> 30; bad.mp4 is planned as one row: 37 planned, 36 moments
WINDOWS = {"long0.mp4": 3, "long1.mp4": 3, "ten_minutes.mp4": 30}
MOMENTS = sum(WINDOWS.values())


@pytest.fixture(scope="module")
def moment_files(tmp_path_factory):
    """A model and a folder of videos whose frames carry their index (`read_long_index`): 60 s and 45 s at 4 fps,
    ten minutes at 1 fps (in a sub-folder), and a text file named .mp4."""
    from helpers.videos import write_long_video

    os.environ.setdefault("GRADIO_TEMP_DIR", str(tmp_path_factory.mktemp("gradio")))
    root = tmp_path_factory.mktemp("app_moments")
    model = save_folder(build_retrieval(), tiny_processor(), root / "model")
    videos = root / "videos"
    (videos / "long").mkdir(parents=True)
    write_long_video(videos / "long0.mp4", 60 * 4, fps=4, width=160, height=96)
    write_long_video(videos / "long1.mp4", 45 * 4, fps=4, width=160, height=96)
    write_long_video(videos / "long" / "ten_minutes.mp4", 600, fps=1, width=160, height=96)
    (videos / "bad.mp4").write_text("not a video")
    return load_app_module(), model, videos


def start_moments_app(module, model, videos, hold: threading.Event | None = None, held_video: str = "long1.mp4"):
    """The app as `app.py --window 20 --videos VIDEOS` starts it: the start-up indexing in the background, the page
    served at once. With `hold`, indexing waits before `held_video` (by default the last one) until `hold` is set."""
    state = module.load_state(str(model), str(videos), None)
    state.window, state.allow_settings = 20.0, True  # --window 20 --allow-settings
    if hold is not None:
        encode = state.retrieval.encode_videos

        def held(items, *args, **kwargs):
            if any(Path(str(item)).name == held_video for item in items):
                assert hold.wait(STALL), "the test never released the indexing"
            return encode(items, *args, **kwargs)

        state.retrieval.encode_videos = held
    job = module.startup_index(state, str(videos))
    demo = module.build_app(state)
    _, url, _ = module.launch_app(demo, str(videos), prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    return state, job, demo, url


@pytest.fixture(scope="module")
def served_moments(moment_files):
    """The app started with `--window 20`, its start-up index finished."""
    module, model, videos = moment_files
    state, job, demo, url = start_moments_app(module, model, videos)
    assert job.wait(STALL), job.describe()
    yield module, state, gradio_client.Client(url, verbose=False), videos, url
    demo.close()
    gr.set_static_paths([])  # a process-wide setting of gradio's


@pytest.fixture
def indexing_held(moment_files):
    """The app started with `--window 20`, its start-up indexing held before its last video until the test sets the
    event it gets (always set at the end)."""
    module, model, videos = moment_files
    hold = threading.Event()
    state, job, demo, url = start_moments_app(module, model, videos, hold)
    try:
        yield module, state, job, hold, videos, url
    finally:
        hold.set()
        job.wait(STALL)
        demo.close()
        gr.set_static_paths([])


def test_start_up_indexing_runs_in_the_background_and_searches_what_is_there(indexing_held):
    module, state, job, hold, videos, url = indexing_held
    client = gradio_client.Client(url, verbose=False)  # the page answers while indexing is held
    # sorted: bad.mp4 (fails before any index exists), long/ten_minutes.mp4, long0.mp4 are done; long1.mp4 waits
    assert job.wait_for(lambda progress: progress.videos_done == 3, timeout=STALL), job.describe()
    progress = job.progress()
    done = 1 + WINDOWS["ten_minutes.mp4"] + WINDOWS["long0.mp4"]
    assert not progress.finished and job.running
    assert (progress.videos_total, progress.rows_done, progress.rows_total) == (4, done, done + WINDOWS["long1.mp4"])
    assert [(Path(failure.video).name, failure.code) for failure in progress.failures] == [("bad.mp4", "not_a_video")]
    assert module.index_box(state).startswith(
        f"Indexing {videos}: 3 of 4 videos ({done} of {done + WINDOWS['long1.mp4']} moments) done, 1 failed so far "
        "(last: bad.mp4: "
        "not_a_video: ")
    partial = state.served.index
    assert sorted({Path(name).name for name in partial.names}) == ["long0.mp4", "ten_minutes.mp4"]
    assert len(partial) == done - 1
    _, table, _ = client.predict(QUERY, 20, True, api_name="/search")  # searches what is indexed so far
    expected = state.retrieval.search(QUERY, partial, top_k=20)
    assert [row[1] for row in table["data"]] == [Path(hit["video"]).name for hit in expected]
    assert [row[4:] for row in table["data"]] == [[module.format_time(h["start"]), module.format_time(h["end"])]
                                                   for h in expected]
    with pytest.raises(gradio_client.exceptions.AppError, match="Index again when it has finished"):
        client.predict(str(videos), None, api_name="/index")
    with pytest.raises(gradio_client.exceptions.AppError, match="Change R_T/R_S when it has finished"):
        client.predict(0, 0, api_name="/aggregation")

    hold.set()
    assert job.wait(STALL), job.describe()
    # what a search got stays as it was (the job grew its own copy), and the whole index is one built in one call
    assert len(partial) == done - 1 and state.retrieval.search(QUERY, partial, top_k=20) == expected
    lines = state.served.index_status.splitlines()
    assert module.index_box(state) == state.served.index_status
    assert job.progress().rows_done == done + WINDOWS["long1.mp4"]
    assert lines[0].startswith(f"Indexed 3 videos as {MOMENTS} moments (windows of 20 s every 20 s): ")
    assert "moments/s" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("Could not be decoded, skipped: bad.mp4: not_a_video: ")
    paths = sorted(str(path) for path in videos.rglob("*.mp4"))
    reference = state.retrieval.encode_videos(paths, window=20, progress_bar=False)  # the default stride
    assert state.served.index.row_keys() == reference.row_keys() and len(state.served.index) == MOMENTS
    assert torch.allclose(state.served.index.embeddings, reference.embeddings, atol=1e-5)
    assert [(f.video, f.code) for f in state.served.index.failures] == [(f.video, f.code) for f in reference.failures]


def test_a_search_before_the_first_video_is_indexed_is_refused_with_the_progress(moment_files):
    module, model, videos = moment_files
    hold = threading.Event()
    state, job, demo, url = start_moments_app(module, model, videos, hold, held_video="bad.mp4")  # the first one
    try:
        planned = MOMENTS + 1  # bad.mp4: one row
        assert job.wait_for(lambda progress: progress.rows_total == planned, timeout=STALL), job.describe()
        client = gradio_client.Client(url, verbose=False)
        with pytest.raises(gradio_client.exceptions.AppError,
                           match=rf"Indexing .*: 0 of 4 videos \(0 of {MOMENTS + 1} moments\) done.* Nothing is "
                           "indexed yet"):
            client.predict(QUERY, 5, True, api_name="/search")
        assert state.served.index is None and job.running
    finally:
        hold.set()
        assert job.wait(STALL), job.describe()
        demo.close()
        gr.set_static_paths([])
    assert state.served.index_status.startswith(f"Indexed 3 videos as {MOMENTS} moments")


def test_a_browser_sees_the_indexing_progress_searches_meanwhile_and_then_the_whole_index(indexing_held):
    _, state, job, hold, _, url = indexing_held
    executable = chromium()
    sync_api = require("playwright.sync_api")
    assert job.wait_for(lambda progress: progress.videos_done == 3, timeout=STALL), job.describe()
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, executable)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(url)  # the page answers while the indexing is held
            box = page.get_by_label("Index", exact=True)
            sync_api.expect(box).to_have_value(
                re.compile(r"^Indexing .*: 3 of 4 videos \(34 of 37 moments\) done, 1 failed so far \(last: bad\.mp4"),
                timeout=30_000)
            page.get_by_label("Paragraph").fill(QUERY)
            page.get_by_role("button", name="Search", exact=True).click()
            rows = page.get_by_role("row").filter(has_text=".mp4")
            sync_api.expect(rows).to_have_count(5, timeout=60_000)
            names = {next(w for w in rows.nth(i).inner_text().split() if w.endswith(".mp4")) for i in range(5)}
            assert names <= {"long0.mp4", "ten_minutes.mp4"}
            warning = page.get_by_text("Indexing is still running: searched the 33 rows indexed so far")
            sync_api.expect(warning.first).to_be_visible(timeout=30_000)
            hold.set()
            assert job.wait(STALL), job.describe()
            # the open page's Index box follows the job to its end, with no reload
            sync_api.expect(box).to_have_value(state.served.index_status, timeout=30_000)
        finally:
            browser.close()


def test_moments_through_the_api(served_moments):
    module, state, client, _, _ = served_moments
    assert state.served.index_status.startswith(f"Indexed 3 videos as {MOMENTS} moments (windows of 20 s every 20 s)")
    _, table, _ = client.predict(QUERY, 4, True, api_name="/search")
    expected = state.retrieval.search(QUERY, state.served.index, top_k=4)
    assert table["headers"] == ["rank", "video", "score", "re-ranked", "start", "end"]
    assert [row[4:] for row in table["data"]] == [[module.format_time(h["start"]), module.format_time(h["end"])]
                                                   for h in expected]
    strip, video, start, caption = client.predict(2, api_name="/moment")
    assert start == expected[1]["start"] and Path(video).name == Path(expected[1]["video"]).name
    assert f"from {module.format_time(expected[1]['start'])} to {module.format_time(expected[1]['end'])}" in caption
    width, height = png_size(strip)
    assert height == 96 and width == 6 * (160 + 4)  # six frames of the moment, 160x96 each
    with pytest.raises(gradio_client.exceptions.AppError, match="Rank 9 is not among the 4 results"):
        client.predict(9, api_name="/moment")
    # new R_T/R_S rebuild the index as moments again, each video once
    keys = state.served.index.row_keys()
    panel = client.predict(0, 0, api_name="/aggregation")
    assert "Re-indexed 3 videos with these settings" in panel and "moments/s" in panel
    assert state.served.index.row_keys() == keys
    client.predict(1, 3, api_name="/aggregation")  # back to the model's own settings


def test_a_moments_thumbnail_is_a_frame_from_its_middle(served_moments):
    from helpers.videos import read_long_index
    from PIL import Image

    module, state, client, _, _ = served_moments
    gallery, _, _ = client.predict(QUERY, 20, True, api_name="/search")
    expected = state.retrieval.search(QUERY, state.served.index, top_k=20)
    assert len(gallery) == len(expected) == 20
    for item, hit in zip(gallery, expected, strict=True):
        name = Path(hit["video"]).name
        assert item["caption"].startswith(name) and item["image"].endswith(".png"), item
        seconds = read_long_index(np.asarray(Image.open(item["image"]).convert("RGB"))) / FPS[name]
        # uniform segment midpoints: one frame of [start, end) is the frame at its middle
        assert hit["start"] <= seconds < hit["end"], (hit, seconds)
        assert abs(seconds - (hit["start"] + hit["end"]) / 2) <= 1, (hit, seconds)
    whole = module.moment_thumbnail(state, {"video": expected[0]["video"], "start": None, "end": None})
    frames = {"long0.mp4": 240, "long1.mp4": 180, "ten_minutes.mp4": 600}[Path(expected[0]["video"]).name]
    frame = read_long_index(np.asarray(Image.open(whole).convert("RGB")))  # a whole video: its middle frame
    assert whole.endswith(".png") and abs(frame - frames / 2) <= 1, (whole, frame)
    broken = module.moment_thumbnail(state, {"video": str(Path(state.output_dir) / "gone.mp4"), "start": 1.0,
                                             "end": 2.0})
    assert broken.endswith("gone.mp4")  # a frame that cannot be decoded: the video (the strip says why)


# the pixels of a gallery tile's picture, read back as `read_long_index` reads a frame
READ_TILE_INDEX = """img => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const context = canvas.getContext('2d');
  context.drawImage(img, 0, 0);
  let index = 0;
  for (let bit = 0; bit < 14; bit++) {
    const [r, g, b] = context.getImageData(bit * 8 + 4, 4, 1, 1).data;
    if ((r + g + b) / 3 > 127) index |= 1 << bit;
  }
  return index;
}"""


def player_at(page, start: float) -> None:
    """Waits until the moment's player holds its video, seeked to `start` (within half a second)."""
    page.wait_for_function(
        "([s]) => { const v = document.querySelector('#moment-video video'); return v && v.readyState >= 1 "
        "&& v.dataset.momentStart == String(s) && Math.abs(v.currentTime - s) < 0.5; }", arg=[start], timeout=30_000)


def test_a_browser_sees_moments_their_thumbnails_and_plays_them_from_their_start(served_moments, tmp_path):
    _, state, _, videos, url = served_moments
    executable = chromium()
    sync_api = require("playwright.sync_api")
    from modeling_testa import format_time

    expected = state.retrieval.search(QUERY, state.served.index, top_k=5)
    with sync_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright, executable)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(url)
            # the Index box says what the start-up indexing did
            sync_api.expect(page.get_by_label("Index", exact=True)).to_have_value(state.served.index_status,
                                                                                   timeout=30_000)
            page.get_by_label("Paragraph").fill(QUERY)
            page.get_by_role("button", name="Search", exact=True).click()
            rows = page.get_by_role("row").filter(has_text=".mp4")
            sync_api.expect(rows).to_have_count(5, timeout=60_000)
            first = rows.nth(0).inner_text()
            assert Path(expected[0]["video"]).name in first
            assert format_time(expected[0]["start"]) in first and format_time(expected[0]["end"]) in first
            strip = page.locator("img[src*='moment_1_']")  # the strip of the best moment
            sync_api.expect(strip).to_have_count(1, timeout=60_000)
            page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=strip.element_handle())
            sync_api.expect(page.locator("#moment-video video")).to_have_count(1, timeout=60_000)
            player_at(page, expected[0]["start"])  # seeked once the video's metadata is loaded
            # clicking the second result shows its moment and plays it from its start
            page.get_by_role("button", name="Thumbnail 2 of 5").click()
            sync_api.expect(page.locator("img[src*='moment_2_']")).to_have_count(1, timeout=60_000)
            sync_api.expect(page.get_by_text("(rank 2)")).to_have_count(1, timeout=30_000)
            player_at(page, expected[1]["start"])

            # the ten-minute video alone: its latest moment among 20 results, deep into the file
            page.get_by_label("Only videos under this folder").fill(str(videos / "long"))
            page.get_by_label("Only videos under this folder").press("Enter")
            page.get_by_role("slider", name="Results").fill("20")
            page.get_by_role("button", name="Search", exact=True).click()
            rows = page.get_by_role("row").filter(has_text="ten_minutes.mp4")
            sync_api.expect(rows).to_have_count(20, timeout=60_000)
            hits = state.retrieval.search(QUERY, state.served.index, top_k=20, filters={"folder": str(videos / "long")})
            assert {Path(hit["video"]).name for hit in hits} == {"ten_minutes.mp4"}
            rank = max(range(1, 21), key=lambda r: hits[r - 1]["start"])
            late = hits[rank - 1]
            assert late["start"] >= 300, late  # 20 of 30 windows: 15 start before 300 s, so one starts after
            tile = page.get_by_test_id(f"thumbnail {rank}")  # the tile's picture (the gallery is in preview mode)
            tile.scroll_into_view_if_needed()
            page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=tile.element_handle())
            seconds = tile.evaluate(READ_TILE_INDEX) / FPS["ten_minutes.mp4"]
            assert late["start"] <= seconds < late["end"], (late, seconds)  # the tile shows the moment, not frame 0
            tile.click()
            sync_api.expect(page.get_by_text(f"(rank {rank})")).to_have_count(1, timeout=30_000)
            player_at(page, late["start"])
            source = page.evaluate("() => document.querySelector('#moment-video video').currentSrc")
            assert unquote(source).endswith(f"file={videos / 'long' / 'ten_minutes.mp4'}")  # served in place, no copy
            page.screenshot(path=str(tmp_path / "moment.png"), full_page=True)
            if os.environ.get("TESTA_KEEP_SCREENSHOT"):
                shutil.copy(tmp_path / "moment.png", os.environ["TESTA_KEEP_SCREENSHOT"])
        finally:
            browser.close()


def test_closing_the_app_stops_its_indexing_in_order(moment_files):
    """Ctrl-C (the server closed) during the start-up indexing: `stop_indexing` asks the job to stop after its
    current step and waits for it, so the interpreter never shuts down under a running encoder (which aborted the
    process: "terminate called without an active exception")."""
    module, model, videos = moment_files
    hold = threading.Event()
    state, job, demo, _ = start_moments_app(module, model, videos, hold, held_video="long0.mp4")
    try:
        assert job.wait_for(lambda progress: progress.videos_done == 2, timeout=STALL), job.describe()
        stopped = []
        closing = threading.Thread(target=lambda: stopped.append(module.stop_indexing(state, timeout=STALL)))
        closing.start()
        assert job.stopping.wait(STALL) and job.running  # asked, while its step (long0.mp4) is held
        hold.set()
        closing.join(STALL)
        assert stopped == [True] and not job.running and not job.thread.is_alive()
        # long0.mp4's step ended, long1.mp4's never began; what was indexed stays searchable
        assert state.served.index_status == (f"The start-up index of {videos} failed: Indexing stopped after 3 of 4 "
                                             "videos: the app is closing.")
        assert sorted({Path(name).name for name in state.served.index.names}) == ["long0.mp4", "ten_minutes.mp4"]
    finally:
        hold.set()
        demo.close()
        gr.set_static_paths([])


def test_ctrl_c_ends_the_app_cleanly(tmp_path):
    """The app's process group gets SIGINT, as a terminal's Ctrl-C sends it (the decoding helpers too), once the app
    serves: it exits with status 0, without an abort. Waits are bounded (hang-guards)."""
    import queue
    import signal
    import subprocess

    model = save_folder(build_retrieval(), tiny_processor(), tmp_path / "model")
    for i in range(24):
        write_noise_video(tmp_path / "videos" / f"clip{i}.mp4", seed=i)
    import socket

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    app = subprocess.Popen([sys.executable, str(APP), "--model", str(model), "--videos", str(tmp_path / "videos"),
                            "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in app.stdout], daemon=True)
    reader.start()
    output = []
    try:
        while not any(line.startswith("Serving; Ctrl-C stops the app.") for line in output):  # launched
            output.append(lines.get(timeout=STALL))
        os.killpg(app.pid, signal.SIGINT)
        app.wait(timeout=STALL)
        reader.join(STALL)
    finally:
        if app.poll() is None:
            os.killpg(app.pid, signal.SIGKILL)
            app.wait()
    while not lines.empty():
        output.append(lines.get())
    output = "".join(output)
    assert app.returncode == 0, output[-3000:]
    assert "terminate called" not in output and "Aborted" not in output and "Traceback" not in output, output[-3000:]
    assert "Closing: the server, then the indexing." in output
