"""Size and render time of the HTML report of `advisor recommend --model llama3-70b --cluster h100x64`.
Targets: under 5 MB, renders in under 2 s in headless Chromium (Debian's chromium + chromedriver).

1. The file, as the CLI writes it: `python -m advisor recommend ... --html FILE` (one cold process;
   its wall time includes ranking and the report).
2. In one running headless Chromium, --repeat fresh loads of the file (a new tab, so nothing is
   cached in the page): the browser's own navigation timing, start of navigation to the end of the
   load event (HTML parsed, every inline SVG laid out), and to the first contentful paint; and the
   wall time of selenium's get(), which returns after the load event.
3. --cold times: `chromium --headless --screenshot` of the file from a fresh browser process to
   the PNG on disk (browser start-up included), min and median.

    python bench/html_report.py [--repeat 10] [--cold 3]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
CMD = ["recommend", "--model", "llama3-70b", "--cluster", "h100x64"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--cold", type=int, default=3)
    a = ap.parse_args()
    from test_html_browser import CHROMIUM, FLAGS, start_browser  # the test's browser, same flags

    if not CHROMIUM:
        sys.exit("no chromium on PATH: apt-get install chromium chromium-driver")
    tmp = Path(tempfile.mkdtemp(prefix="advisor-html-bench-"))
    out = tmp / "llama3-70b-h100x64.html"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "advisor", *CMD, "--html", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    made = time.perf_counter() - t0
    size = out.stat().st_size
    svgs = out.read_text().count("<svg")
    print(f"advisor {' '.join(CMD)} --html: {size / 1e6:.3f} MB ({size:,} bytes, {svgs} inline SVG plots); "
          f"cold process incl. ranking {made:.2f} s")

    d = start_browser(tmp / "profile")
    load, fcp, wall = [], [], []
    try:
        for _ in range(a.repeat):
            d.switch_to.new_window("tab")
            t0 = time.perf_counter()
            d.get(out.as_uri())
            wall.append(time.perf_counter() - t0)
            nav = d.execute_script("var n = performance.getEntriesByType('navigation')[0];"
                                   "var p = performance.getEntriesByName('first-contentful-paint')[0];"
                                   "return [n.loadEventEnd - n.startTime, p ? p.startTime : null];")
            load.append(nav[0] / 1000)
            if nav[1] is not None:
                fcp.append(nav[1] / 1000)
            d.close()
            d.switch_to.window(d.window_handles[0])
        version = d.capabilities.get("browserVersion")
    finally:
        d.quit()

    def line(name: str, xs: list[float]) -> str:
        return f"  {name:44s} min {min(xs):.3f} s  median {statistics.median(xs):.3f} s  max {max(xs):.3f} s  (n={len(xs)})"

    print(f"headless Chromium {version}, {a.repeat} fresh loads in one browser:")
    print(line("navigation start -> load event end", load))
    if fcp:
        print(line("navigation start -> first contentful paint", fcp))
    print(line("selenium get() wall time", wall))
    cold = []
    for i in range(a.cold):
        png = tmp / f"shot{i}.png"
        t0 = time.perf_counter()
        subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / f'cold{i}'}", f"--screenshot={png}",
                        out.as_uri()], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cold.append(time.perf_counter() - t0)
        assert png.stat().st_size > 10_000
    if cold:
        print("chromium --headless --screenshot, fresh browser process each:")
        print(line("start -> PNG written (browser start-up incl.)", cold))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
