"""report.html of a real compare directory (3 algorithms x 2 seeds, digits, 2 rounds, --inline),
opened in a real browser: Debian's chromium, driven by Selenium through Debian's chromedriver.
Every figure must be rendered (decoded, with a size on the page) and the console free of errors;
the page's screenshot is kept in test-artifacts/report.png (with the page beside it)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import small_config

from raysim.cli.main import main

ROOT = Path(__file__).parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ALGORITHMS = ("fedavg", "ifca", "rdpcfl")
FIGURES = [  # no audit here
    "rounds", "privacy-utility", "clients", "assignments", "assignment-rounds", "epsilon",
]  # fmt: skip


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """A tiny real `raysim compare --inline` and its report: (compare dir, report.html)."""
    root = tmp_path_factory.mktemp("report")
    out = root / "cmp"
    sets = sum((["--set", s] for s in small_config()), [])
    argv = ["compare", "raysim/demo.yaml", "--algorithms", ",".join(ALGORITHMS)]
    assert main([*argv, "--seeds", "0,1", "--inline", "--out", str(out), *sets]) == 0
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert main(["report", str(out)]) == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing written
    return out, root / "cmp-report.html"


def test_report_of_a_compare_directory_has_every_figure_and_the_seeds_mean(compared):
    out, page_file = compared
    page = page_file.read_text()
    assert re.findall(r'<img id="fig-([a-z-]+)" src="data:image/png;base64,', page) == FIGURES
    for algorithm in ALGORITHMS:  # mean ± std over the two seeds, from their summary.json
        acc = [
            json.loads((out / algorithm / f"seed{s}" / "summary.json").read_text())["final"][
                "accuracy"
            ]
            for s in (0, 1)
        ]
        cell = f"{100 * np.mean(acc):.1f} ± {100 * np.std(acc):.1f}"
        assert f"<td>{algorithm}</td><td>2</td><td>2</td><td>{cell}</td>" in page


def _browser():
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip("chromium and chromium-driver not installed (apt-get install chromium ...)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver named, so Selenium Manager has nothing to look up or download
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


def test_report_renders_in_chromium_with_no_console_error(compared, monkeypatch):
    monkeypatch.setenv("SE_OFFLINE", "true")
    _, page_file = compared
    driver = _browser()
    try:
        driver.get(page_file.resolve().as_uri())
        assert driver.execute_script("return document.readyState") == "complete"
        shown = driver.execute_script(
            """return [...document.querySelectorAll('figure')].map(f => {
                 const img = f.querySelector('img'); const box = img.getBoundingClientRect();
                 return [img.id, img.complete, img.naturalWidth, img.naturalHeight,
                         box.width, box.height]; });"""
        )
        assert [s[0] for s in shown] == [f"fig-{name}" for name in FIGURES]
        for name, complete, nat_w, nat_h, w, h in shown:
            assert complete and nat_w > 100 and nat_h > 100 and w > 100 and h > 50, name
        rows = driver.execute_script("return document.querySelectorAll('#summary-table tbody tr')")
        assert len(rows) == len(ALGORITHMS)
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert severe == []
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, height + 40)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "report.png"
        assert driver.save_screenshot(str(shot))
        shutil.copyfile(page_file, ARTIFACTS / "report.html")
        print(f"screenshot: {shot}")
    finally:
        driver.quit()
    assert shot.stat().st_size > 10_000
