"""Every report kind in headless Chromium (Debian's chromium + chromedriver, driven by selenium):
each plot's element exists and its screenshot is not blank, the copy button copies, and the
llama3-70b on h100x64 report stays under 5 MB. Skips with the reason where no browser can be had
(.ci/run installs it with apt-get when it can).

ADVISOR_SCREENSHOTS=DIR also writes a screenshot of the top of each report to DIR/report-<kind>.png
(docs/img/ holds the committed ones: ADVISOR_SCREENSHOTS=docs/img python3 -m pytest tests/test_html_browser.py)."""
from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 5 * 1024 * 1024

pytest.importorskip("matplotlib", reason="the HTML report needs matplotlib (pip install 'advisor[report]')")
pytest.importorskip("selenium", reason="the browser test needs selenium (pip install -e '.[test]')")
PIL = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) reads the screenshots")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="no chromium/chromedriver on PATH (apt-get install chromium chromium-driver; "
                              ".ci/run does when apt is available)"),
]

# the flags this machine's closed network needs (no background fetches), and root's --no-sandbox
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1280,1000")


def start_browser(user_dir: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + (f"--user-data-dir={user_dir}",):
        opts.add_argument(f)
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        d = start_browser(tmp_path_factory.mktemp("chromium-profile"))
    except Exception as e:  # noqa: BLE001 - a browser that will not start is a skip, with why
        pytest.skip(f"chromium did not start under chromedriver: {type(e).__name__}: {str(e).splitlines()[0]}")
    yield d
    d.quit()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One report of each kind, built by the functions the CLI calls."""
    from advisor import html_report as hr
    from advisor.api import layout_from_flags, predict_layout, recommend, resolve
    from advisor.models import calibrate, dataset
    from advisor.placement import plan

    out = tmp_path_factory.mktemp("reports")
    pages = {}
    pages["recommend"] = hr.recommend_page(recommend("llama3-70b", "h100x64", calibration="default"))
    values = dict(tp=8, pp=4, vp=5, mbs=1)
    cfg, p = predict_layout("llama3-70b", "h100x64", values, calibration="default")
    pages["predict"] = hr.predict_page("llama3-70b", "h100x64", cfg, p)
    m, c = resolve("llama3-8b", "h200x4x2")
    cfg = layout_from_flags(m, c, dict(pp=4, gbs=32, seq=4096))
    pages["place"] = hr.place_page(plan(m, c, cfg, [str(ROOT / "data/placement/h200x4-profile.json")]), m.name, c)
    pages["study"] = hr.study_page(str(ROOT / "data/studies/llama3-8b-h200x4.journal"))
    pages["dataset"] = hr.dataset_page([str(ROOT / "data/measurements/h200x4-full-depth.jsonl")])
    ds = dataset.load([str(ROOT / "data/measurements/h200x4-full-depth.jsonl"),
                       str(ROOT / "data/measurements/h200x4-gqa.jsonl")])
    pages["fit"] = hr.fit_page(calibrate.fit(ds, folds=3, surrogates=False), ds)
    return {k: (hr.write(out / f"{k}.html", pg), pg.figures) for k, pg in pages.items()}


def not_blank(png: bytes) -> tuple[bool, str]:
    """A drawn plot: many non-background pixels in several colours."""
    import numpy as np

    px = np.asarray(PIL.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3).astype(int)
    ink = float((px.min(axis=1) < 200).mean())
    colours = len(np.unique(px // 32, axis=0))
    return ink > 0.01 and colours >= 4, f"{ink:.1%} ink, {colours} colour bins"


@pytest.mark.parametrize("kind", ["recommend", "study", "predict", "place", "dataset", "fit"])
def test_every_plot_draws(browser, reports, kind):
    from selenium.webdriver.common.by import By

    path, expected = reports[kind]
    browser.get(path.as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-report") == kind
    figures = browser.find_elements(By.CSS_SELECTOR, "figure.plot")
    assert len(figures) == expected >= 1
    for fig in figures:
        svg = fig.find_element(By.TAG_NAME, "svg")
        rect = svg.rect
        assert rect["width"] > 200 and rect["height"] > 100, (fig.get_attribute("id"), rect)
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", svg)
        ok, why = not_blank(svg.screenshot_as_png)
        assert ok, f"{kind} {fig.get_attribute('id')}: blank ({why})"
    shots = os.environ.get("ADVISOR_SCREENSHOTS")
    if shots:
        save_screenshot(browser, Path(shots) / f"report-{kind}.png")
    # a paste-ready block copies
    buttons = browser.find_elements(By.CSS_SELECTOR, "button.copy")
    if kind in ("recommend", "predict", "place"):
        assert buttons
        from selenium.webdriver.support.ui import WebDriverWait

        target = browser.find_element(By.ID, buttons[0].get_attribute("data-target"))
        assert target.get_attribute("textContent").startswith(("--", "h200x4"))  # Megatron args / environment
        buttons[0].click()  # the label changes once the text is on the clipboard (a promise)
        WebDriverWait(browser, 5).until(lambda d: buttons[0].text == "copied")


def save_screenshot(browser, dest: Path, max_height: int = 2000) -> None:
    """The page from its top (at most max_height CSS px), at 60% and palette-quantized so that the
    committed PNGs stay small."""
    height = min(max_height, browser.execute_script("return document.documentElement.scrollHeight"))
    browser.set_window_size(1280, height)
    try:
        browser.execute_script("window.scrollTo(0, 0)")
        im = PIL.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    finally:
        browser.set_window_size(1280, 1000)
    im = im.resize((im.width * 3 // 5, im.height * 3 // 5), resample=PIL.LANCZOS)
    dest.parent.mkdir(parents=True, exist_ok=True)
    im.quantize(colors=128, method=PIL.Quantize.FASTOCTREE).save(dest, optimize=True)


def test_a_blank_plot_fails_the_check(browser, tmp_path):
    """The check above can fail: a figure with nothing drawn in it is caught as blank."""
    from selenium.webdriver.common.by import By

    from advisor import html_report as hr

    page = hr.Page("blank", "test")
    fig, axes = hr.new_figure(6, 3)
    axes[0][0].set_axis_off()
    page.figure(fig, "blank", "nothing drawn")
    browser.get(hr.write(tmp_path / "blank.html", page).as_uri())
    svg = browser.find_element(By.CSS_SELECTOR, "figure.plot svg")
    assert svg.rect["width"] > 200
    assert not not_blank(svg.screenshot_as_png)[0]


def test_llama3_70b_h100x64_report_size(reports):
    path, _ = reports["recommend"]
    assert path.stat().st_size < MAX_BYTES
