"""The system's Chromium under Selenium, for the viewer's tests, its load-time bench and screenshots.

    python -m scripts.viewer.browser trajectories.html -o docs/viewer.png [--row 3] [--compare]

Debian's `chromium` and `chromium-driver` (apt; `bash scripts/setup_env.sh test` installs them),
headless, with a fresh profile and every background fetch off; Selenium is told where both are,
so its manager never downloads a browser or a driver.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps")


def browser_missing() -> str | None:
    """Why the browser cannot run here (None when it can)."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return (f"{path} is missing: install Debian's {package} (apt-get install -y chromium chromium-driver; "
                    "bash scripts/setup_env.sh test does it where apt-get exists)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "the selenium package is missing: bash scripts/setup_env.sh test installs the test extra"
    return None


def chromium_driver(profile_dir: str, console_log: bool = True, size: tuple[int, int] = (1500, 1000)) -> Any:
    """A headless Chromium with a fresh profile in `profile_dir`; the page's console is kept
    (`driver.get_log("browser")`) when `console_log`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")   # Selenium Manager: no download, ever
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={size[0]},{size[1]}")
    options.add_argument(f"--user-data-dir={profile_dir}")
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def open_page(driver: Any, page: str | Path, timeout_s: float = 120.0) -> float:
    """Open the page from disk and wait until it has drawn; returns its load time in ms."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(Path(page).resolve().as_uri())
    WebDriverWait(driver, timeout_s).until(lambda d: d.execute_script(
        "return window.viewerReady !== undefined || document.querySelector('#detail .bad') !== null"))
    return float(driver.execute_script("return window.viewerReady ?? -1"))


def screenshot(page: str | Path, output: str | Path, row: int | None = None, compare: bool = False,
               size: tuple[int, int] = (1500, 1000)) -> Path:
    """A PNG of the page, with trajectory `row` of the list open (the first by default) and, with
    `compare`, the same prompt at its first other step beside it."""
    profile = tempfile.mkdtemp(prefix="viewer-chromium-")
    driver = chromium_driver(profile, console_log=False, size=size)
    try:
        open_page(driver, page)
        if row is not None:
            driver.execute_script(f"document.querySelectorAll('#list-body .row')[{int(row)}].click()")
        if compare:
            driver.execute_script("""const s = document.getElementById('compare');
                if (s && s.options.length > 1) { s.selectedIndex = 1; s.dispatchEvent(new Event('change')); }""")
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
        return out
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="A screenshot of a viewer page (headless Chromium)")
    parser.add_argument("page")
    parser.add_argument("-o", "--output", default="viewer.png")
    parser.add_argument("--row", type=int, default=None, help="open the list's row at this position")
    parser.add_argument("--compare", action="store_true", help="show the same prompt at another step beside it")
    parser.add_argument("--size", default="1500x1000", help="window size, WIDTHxHEIGHT")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        raise SystemExit(missing)
    width, height = (int(v) for v in args.size.split("x"))
    print(screenshot(args.page, args.output, args.row, args.compare, (width, height)))


if __name__ == "__main__":
    main()
