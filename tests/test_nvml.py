"""NvmlSampler and nvml_status against a fake `pynvml` (no GPU needed)."""

import sys
import time
import types

import pytest

from keras_gpufix.nvml import INSTALL_HINT, NvmlSampler, nvml_status


def fake_pynvml(utilisation, fail_after=None):
    """A pynvml with one handle per entry of `utilisation` (percent)."""
    calls = {"n": 0, "shutdown": 0}

    def rates(handle):
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return types.SimpleNamespace(gpu=utilisation[handle])

    module = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(utilisation),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: f"Fake GPU {h}".encode(),
        nvmlDeviceGetUtilizationRates=rates,
    )
    return module, calls


def sample(sampler, seconds=0.3):
    t0 = time.time()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    return sampler.mean_between(t0, time.time())


def test_mean_of_the_visible_gpus(monkeypatch):
    module, _ = fake_pynvml([20, 60, 100])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert sample(NvmlSampler(interval=0.01)) == pytest.approx(0.4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert sample(NvmlSampler(interval=0.01)) == pytest.approx(1.0)
    assert nvml_status() == {"available": True, "reason": "", "gpus": ["Fake GPU 2"]}


def test_a_failing_call_stops_sampling_and_is_kept(monkeypatch):
    module, calls = fake_pynvml([50], fail_after=3)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sampler = NvmlSampler(interval=0.01)
    assert sample(sampler) == pytest.approx(0.5)  # the 3 samples before the failure
    assert "GPU_IS_LOST" in str(sampler.error) and calls["shutdown"] == 1


def test_without_bindings_the_pip_command_is_quoted(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    status = nvml_status()
    assert status["available"] is False and INSTALL_HINT in status["reason"]
    with pytest.raises(ImportError, match="pip install nvidia-ml-py"):
        NvmlSampler().start()


def test_no_visible_gpu(monkeypatch):
    module, _ = fake_pynvml([10])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvml_status()["reason"] == "NVML sees no GPU"
    with pytest.raises(RuntimeError, match="NVML sees no GPU"):
        NvmlSampler().start()


def test_interval_is_checked():
    with pytest.raises(ValueError, match="`interval` must be in"):
        NvmlSampler(interval=0.5)
