"""The report pages in a real browser (Debian's chromium, driven by Playwright): each loads
without an error, every image decodes, nothing is fetched, the per-class table and the gallery
are whole, and it fits a phone's screen. Skips, saying why, where there is no browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import CLASSES, run_main, write_image_folder
from imgtrainer.tools.evaluate import main as evaluate_main

pytestmark = pytest.mark.slow

# Playwright's own browser download is not reachable here: the system's chromium
# (.ci/install-chromium) is launched instead.
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
# Where to keep whole-page screenshots (for a person to look at); by default the first screen
# of each view, in the test's folder.
SCREENSHOTS_ENV = "IMGTRAINER_SCREENSHOTS"


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if path is None:
        pytest.skip(
            "no chromium on this machine: .ci/install-chromium installs Debian's (root, apt)"
        )
    return path


def sync_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed: pip install -r requirements-dev.txt")
    return sync_playwright()


PAGE_FACTS = """() => {
  const images = [...document.images];
  const gallery = [...document.querySelectorAll('#gallery figure')];
  return {
    images: images.length,
    undecoded: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    classRows: document.querySelectorAll('#per-class tbody tr').length,
    tiles: gallery.length,
    rows: document.querySelectorAll('.gallery.row figure img').length,
    tilesWithPicture: gallery.filter(f => { const i = f.querySelector('img');
                                             return i && i.naturalWidth > 0; }).length,
    captions: gallery.map(f => f.querySelector('figcaption').innerText),
    pageWidth: document.documentElement.scrollWidth,
    screenWidth: window.innerWidth,
    scripts: document.scripts.length,
  };
}"""


def open_pages(
    pages: dict[str, Path], shots: Path, full_page: bool
) -> tuple[dict, list[str], list[str]]:
    """Each page on a phone's screen, then a desktop's: what ``PAGE_FACTS`` finds on the
    phone, the console's errors and every URL the browser asked for; a screenshot of each view
    (of the whole page when ``full_page``: a second or so each)."""
    executable = chromium()
    facts, errors, requests = {}, [], []
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            for name, path in pages.items():
                page = browser.new_page(viewport=PHONE)
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("request", lambda r: requests.append(r.url))
                page.goto(path.as_uri(), wait_until="load")
                facts[name] = page.evaluate(PAGE_FACTS)
                page.screenshot(path=shots / f"{name}-phone.png", full_page=full_page)
                page.set_viewport_size(DESKTOP)  # the same page laid out again, not loaded again
                page.screenshot(path=shots / f"{name}-desktop.png", full_page=full_page)
                page.close()
        finally:
            browser.close()
    return facts, errors, requests


def test_the_report_pages_read_in_a_real_browser(trained_run, tmp_path: Path):
    chromium()  # skips here, before the evaluation, where there is none
    # The run's own page (its images tell the classes apart: every one right), and the page
    # of its checkpoint on pixels that tell no class apart (mistakes in every part).
    noise = write_image_folder(tmp_path / "noise", CLASSES, 7, seed=2, coloured=False)
    argv = ["--checkpoint", trained_run.best, "--data_dir", noise, "--output", tmp_path / "eval"]
    assert run_main(evaluate_main, [*argv, "--report", "--device", "cpu", "--num_workers", 0]) == 0
    pages = {
        "run": trained_run.root / "logs" / "report.html",
        "evaluation": tmp_path / "eval" / "report.html",
    }
    # Whole pages for a person to look at (IMGTRAINER_SCREENSHOTS=DIR); the first screen of
    # each view otherwise (a whole page costs about a second to take).
    shots = Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path)
    facts, errors, requests = open_pages(pages, shots, full_page=SCREENSHOTS_ENV in os.environ)
    print(f"screenshots in {shots}")
    assert errors == []
    local = {path.as_uri() for path in pages.values()}
    assert [url for url in requests if url not in local and not url.startswith("data:")] == []
    for name, images in (("run", 5), ("evaluation", 7)):
        page = facts[name]
        assert page["images"] > 2 and page["undecoded"] == [] and page["scripts"] == 0, name
        assert page["classRows"] == len(CLASSES), name
        assert page["tiles"] == page["tilesWithPicture"] == len(CLASSES) * images, name
        for caption in page["captions"]:
            true, verdict = caption.splitlines()[:2]
            assert true in CLASSES and verdict.split()[-2] in CLASSES, caption
            assert verdict.startswith(("right", "taken for")) and "%" in verdict, caption
        # Nothing wider than the phone's screen but the tables, which scroll in their own box.
        assert page["pageWidth"] <= page["screenWidth"], (name, page)
    assert facts["evaluation"]["rows"] > 0  # the worst classes' rows of mistakes
