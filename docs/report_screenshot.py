"""Opens a `keras-gpufix report` HTML file in headless Chromium; makes README's picture.

The same path the test suite takes (tests/test_html_report.py): Debian's
`chromium` and `chromium-driver` (`apt-get install chromium chromium-driver`)
driven by Selenium (`pip install -e .[test]`), a fresh profile, no network
services (the flags in `FLAGS`).

    python docs/report_screenshot.py            # runs `keras-gpufix demo`, shoots
                                                # the naive way's report
    python docs/report_screenshot.py REPORT.html --out docs/img/report.png

Writes the screenshot (default docs/img/report.png) and prints its path.
"""

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

__all__ = ["FLAGS", "chromium_paths", "headless", "main"]

#: Chromium's flags: headless, no sandbox (root in CI), nothing that calls home.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")

HERE = os.path.dirname(os.path.abspath(__file__))


def chromium_paths():
    """`(browser, driver)` paths of the installed Chromium and its driver, or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextlib.contextmanager
def headless(width=1100, height=1400):
    """A Selenium Chrome driver on headless Chromium with `FLAGS` and a fresh
    `--user-data-dir`; its performance log records the page's network events.

    Raises:
        RuntimeError: Chromium or its driver is not installed (the apt-get line).
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("Chromium is not installed: apt-get install chromium chromium-driver")
    profile = tempfile.mkdtemp(prefix="keras_gpufix_chromium_")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _demo_report():
    """Runs `keras-gpufix demo` in a temp folder; the naive way's report.html."""
    work = tempfile.mkdtemp(prefix="keras_gpufix_screenshot_")
    subprocess.run([sys.executable, "-m", "keras_gpufix", "demo", "--dir", work], check=True)
    return os.path.join(work, "logs", "naive", "report.html")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", help="an HTML report (default: run the demo)")
    parser.add_argument("--out", default=os.path.join(HERE, "img", "report.png"))
    parser.add_argument("--height", type=int, default=1100, help="pixels of the page shot")
    args = parser.parse_args(argv)
    report = os.path.abspath(args.report or _demo_report())
    with headless(height=args.height) as driver:
        driver.get("file://" + report)
        driver.save_screenshot(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
