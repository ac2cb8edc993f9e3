"""Fixtures every test file shares: the CPU facts `mixed_precision="auto"` reads.

No test depends on the host CPU's features: `auto` decides from
`keras_gpufix.compile.hardware` (the GPUs, and the CPU's bfloat16 flags read by
`_cpu_flags()`), so every test sees the CPU flags pinned here, none of the
bfloat16 ones unless `KERAS_GPUFIX_TEST_CPU_FLAGS` names some: run any file as
on a CPU with AMX-BF16 with

    KERAS_GPUFIX_TEST_CPU_FLAGS="amx_bf16 avx512_bf16" python -m pytest tests/test_compile.py

A test whose result depends on what `auto` picks takes `auto_hardware`, which
runs it under both outcomes.

Every test also leaves `TF_XLA_FLAGS` as it found it (`kg.from_config`
and `CompileCache.enable` set it when TensorFlow has not started yet).

The suite's time is kept (issue 50): a test outside `-m slow` should take at
most `TEST_BUDGET_S` seconds (setup, call and teardown together) on a quiet
2-core machine; the run's summary lists each test over it, to be made smaller
or marked `slow` with its reason. A list, not a failure: tests never assert on
wall time.
"""

import collections
import os

import pytest

TEST_BUDGET_S = 20.0
_seconds = collections.defaultdict(float)

CPU_FLAGS = frozenset(os.environ.get("KERAS_GPUFIX_TEST_CPU_FLAGS", "").split())

# `hardware.device_info()` of a machine with no GPU, where `auto` picks
# mixed_bfloat16 (AMX-BF16) and where it keeps float32 (AVX512-BF16 alone).
AUTO_HARDWARE = {
    "amx_bf16": {"gpus": [], "cpu_bf16": True, "cpu_bf16_flags": ["amx_bf16", "avx512_bf16"]},
    "no_amx": {"gpus": [], "cpu_bf16": False, "cpu_bf16_flags": ["avx512_bf16"]},
}


@pytest.fixture(autouse=True)
def _pinned_cpu_flags(monkeypatch):
    from keras_gpufix.compile import hardware

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: set(CPU_FLAGS))


@pytest.fixture(params=sorted(AUTO_HARDWARE))
def auto_hardware(request, monkeypatch):
    """The test runs twice: `hardware.device_info()` (the one function that reads
    the GPUs and CPU flags) faked as a CPU with AMX-BF16, then one without. Gives
    the policy `auto` picks there; `compile_model`'s once-per-process note about
    `auto` shows again."""
    from keras_gpufix.compile import hardware, precision

    info = AUTO_HARDWARE[request.param]
    monkeypatch.setattr(hardware, "device_info",
                        lambda: {**info, "cpu_bf16_flags": list(info["cpu_bf16_flags"])})
    monkeypatch.setattr(precision, "_noted", set())
    return hardware.auto_policy()[0]


@pytest.fixture(autouse=True)
def _compile_cache_flag_stays_in_its_test():
    """`kg.from_config` and `CompileCache.enable` set `TF_XLA_FLAGS` when
    TensorFlow has not started yet; it is restored after each test, so later
    tests' subprocesses do not inherit a compile cache folder."""
    before = os.environ.get("TF_XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("TF_XLA_FLAGS", None)
    else:
        os.environ["TF_XLA_FLAGS"] = before


def pytest_runtest_logreport(report):
    """Each test's seconds, setup to teardown (on xdist's controller too)."""
    _seconds[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter):
    over = sorted(((s, n) for n, s in _seconds.items() if s > TEST_BUDGET_S), reverse=True)
    if over:
        terminalreporter.section(f"tests over the {TEST_BUDGET_S:.0f} s budget (issue 50)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
