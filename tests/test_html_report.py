"""The HTML report opened by a real browser: headless Chromium driven by Selenium, the
path docs/report_screenshot.py takes for README's picture (`.ci/run` installs Debian's
chromium and chromium-driver). A synthetic record: no training."""

import importlib.util
import json
import os

import numpy as np
import pytest

from keras_gpufix.analysis import StepRecord
from keras_gpufix.analysis.step_series import StepSeries
from keras_gpufix.run_record import RunRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _screenshot_module():
    spec = importlib.util.spec_from_file_location(
        "report_screenshot", os.path.join(ROOT, "docs", "report_screenshot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(tmp_path):
    """A run of 300 steps: 40% input wait, a compile at each of 3 shapes, a stall every
    50 steps, GPU utilisation sampled; two ranked fixes, the first with its lines."""
    rng = np.random.default_rng(0)
    series = StepSeries(warmup=5)
    for i in range(300):
        series.add(StepRecord(i, 1, 0.004 + (0.1 if i % 50 == 25 else 0.0),
                              0.006 * rng.uniform(0.9, 1.1), 0.0002, new_shape=i in (0, 1, 2),
                              epoch=i // 100, epoch_first=i % 100 == 0,
                              gpu_util=float(rng.uniform(0.2, 0.5))), jit=True)
    report = {"verdict": "input_bound", "fix": "the step waits for data: cache the features",
              "phase": "input_wait", "cost_share": 0.4, "changed": None,
              "because": ["input_bound from step 30 to step 299: input wait 40%"],
              "causes": [{"verdict": "input_bound", "share": 0.4, "phase": "input_wait",
                          "period": None},
                         {"verdict": "periodic_stall", "share": 0.12, "phase": "input_wait",
                          "period": 50}],
              "step_time": {"count": 280, "p50_ms": 10.2, "p95_ms": 11.0, "cv": 0.8},
              "phases": {"input_wait": 0.4, "step": 0.58, "between": 0.02}, "gpu_util": 0.35,
              "series": series.as_dict()}
    data = RunRecord.from_monitor(report, command=["python", "train.py"]).data
    data["fixes"][0]["where"] = ["train.py:17: librosa.feature.melspectrogram in the loader",
                                 "train.py:23: map without num_parallel_calls"]
    record = RunRecord(json.loads(json.dumps(data)))
    record.write(tmp_path)
    return record


def test_the_report_renders_in_headless_chromium_and_fetches_nothing(tmp_path):
    pytest.importorskip("selenium", reason="selenium is a test extra: pip install -e .[test]")
    shot = _screenshot_module()
    if shot.chromium_paths() is None:
        pytest.skip("Chromium is not installed here (.ci/run installs it: apt-get install "
                    "chromium chromium-driver)")
    from selenium.webdriver.common.by import By

    record = _record(tmp_path)
    page = record.write_html()
    url = "file://" + page
    with shot.headless() as driver:
        driver.get(url)
        assert driver.title == "keras-gpufix report: input_bound"
        assert driver.find_element(By.ID, "verdict").text == "input_bound"
        body = driver.find_element(By.TAG_NAME, "body").text
        for fix in record.data["fixes"]:
            assert fix["fix"] in body and fix["text"] in body
            for line in fix["where"]:
                assert line in body
        # the fixes come before the timeline
        assert body.index("Fixes, ranked") < body.index("Timeline") < body.index("Environment")
        marks = driver.find_elements(By.CSS_SELECTOR, "#timeline g.step")
        assert len(marks) == len(record.data["series"]["steps"]) == 300
        assert all(m.size["width"] > 0 for m in marks[:5])
        assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline .compile")) == 3
        assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline .stall")) == 6
        assert driver.find_elements(By.CSS_SELECTOR, "#gpu-util polyline")
        assert driver.find_elements(By.TAG_NAME, "script") == []
        # no request leaves the page: nothing but the file itself was loaded
        assert driver.execute_script(
            "return performance.getEntriesByType('resource').length") == 0
        events = [json.loads(entry["message"])["message"] for entry in
                  driver.get_log("performance")]
        requested = [e["params"]["request"]["url"] for e in events
                     if e["method"] == "Network.requestWillBeSent"
                     and e["params"].get("documentURL") == url]  # by our page
        assert requested == [url]
        assert driver.save_screenshot(str(tmp_path / "report.png"))
    assert (tmp_path / "report.png").stat().st_size > 10_000
