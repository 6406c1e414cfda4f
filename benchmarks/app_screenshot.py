"""The README's screenshot of the app (`app/app.py`): the demo's model (b) over the demo's test videos, a paragraph
searched and the best result's merge picture shown, taken by Playwright on the system Chromium.

    make demo                                    # once
    python -m benchmarks.app_screenshot [--output docs/app_screenshot.png]
"""

import argparse
import importlib.util
import os
import shutil
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

APP = Path(__file__).resolve().parents[1] / "app" / "app.py"
QUERY = "first the screen is orange. a purple square flashes. then the screen is white. finally the screen is green."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/demo/runs/b/final")
    parser.add_argument("--videos", default="outputs/demo/data/videos")
    parser.add_argument("--output", type=Path, default=Path("docs/app_screenshot.png"))
    parser.add_argument("--query", default=QUERY)
    args = parser.parse_args()
    executable = shutil.which("chromium") or shutil.which("chromium-headless-shell")
    if executable is None:
        raise SystemExit("No system Chromium: apt-get install chromium.")
    for path in (args.model, args.videos):
        if not Path(path).exists():
            raise SystemExit(f"{path} does not exist: run `make demo` first.")
    from playwright.sync_api import expect, sync_playwright

    spec = importlib.util.spec_from_file_location("testa_app", APP)
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    state = app.load_state(args.model, args.videos, None)
    state.rerank = False  # as `make app`: the demo model ranks by cosine
    print(app.index_videos(state, args.videos, None))
    demo = app.build_app(state)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, theme=app.THEME,
                            allowed_paths=[str(Path(args.videos).resolve())])
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url)
            page.get_by_label("Paragraph").fill(args.query)
            page.get_by_role("button", name="Search", exact=True).click()
            expect(page.get_by_role("row").filter(has_text=".mp4")).to_have_count(5, timeout=120_000)
            page.get_by_role("button", name="What did TESTA merge?").click()
            image = page.locator("img[src*='merges_']")
            expect(image).to_have_count(1, timeout=120_000)
            image.scroll_into_view_if_needed()
            page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=image.element_handle())
            page.screenshot(path=str(args.output), full_page=True)
            browser.close()
    finally:
        demo.close()
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
