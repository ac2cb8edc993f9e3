"""keras_gpufix.profiling: traces with step markers and their XProf analysis."""

import os

import keras
import pytest
import tensorflow as tf

from keras_gpufix import profiling
from planted import FEATURES, planted_dataset, tiny_model


def compute_bound_model():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1024),
                              keras.layers.Dense(1024), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    return model


def traced_loop(log_dir, model, dataset, fetch_inside_step, steps=12, tag="loop"):
    """Runs `steps` train steps under our markers; returns the run folder."""
    iterator = iter(dataset)
    model.train_on_batch(*next(iterator))  # compile outside the trace
    profiling.start_trace(log_dir, tag=tag)
    for step in range(steps):
        batch = None if fetch_inside_step else next(iterator)
        with profiling.step_marker(step):
            x, y = next(iterator) if fetch_inside_step else batch
            model.train_on_batch(x, y)
    return profiling.stop_trace()


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Two traces of one loop: waiting for a slow input inside the step, or not."""
    log_dir = str(tmp_path_factory.mktemp("profiling"))
    slow = traced_loop(log_dir, tiny_model(), planted_dataset("slow", batches=20, sleep=0.02),
                       True, tag="input-bound")
    healthy = traced_loop(log_dir, compute_bound_model(),
                          planted_dataset("healthy", batches=20, batch_size=64), False,
                          tag="healthy")
    return log_dir, slow, healthy


def test_marked_steps_give_step_times_and_the_input_bound_verdict(traces):
    log_dir, slow, healthy = traces
    assert os.path.dirname(slow) == os.path.join(log_dir, "plugins", "profile")
    assert slow.endswith("_input-bound") and healthy.endswith("_healthy")
    bound = profiling.analyze_trace(slow)
    assert bound["steps"] >= 6
    assert bound["step_time_ms"] > 0 and bound["step_time_ms_max"] >= bound["step_time_ms"]
    assert bound["classification"] == "highly_input_bound"
    assert bound["input_percent"] >= 20
    assert "HIGHLY input-bound" in bound["conclusion"]
    assert bound["breakdown_ms"]["input"] > bound["breakdown_ms"]["host_compute"]
    fine = profiling.analyze_trace(healthy)
    assert fine["steps"] >= 6 and fine["step_time_ms"] > 0
    assert fine["classification"] == "not_input_bound"
    assert fine["input_percent"] < 5
    assert fine["conclusion"]  # XProf's sentence (may blame "All Others" time)


def test_a_log_dir_resolves_to_its_latest_run(traces):
    log_dir, _, healthy = traces
    assert profiling.xplane_files(log_dir) == profiling.xplane_files(healthy)
    files = profiling.xplane_files(healthy)
    assert len(files) == 1 and files[0].endswith(".xplane.pb")
    assert profiling.xplane_files(files[0]) == files


def test_stock_tensorboard_traces_have_no_step_marker(tmp_path):
    tensorboard = keras.callbacks.TensorBoard(str(tmp_path), profile_batch=(2, 6))
    tiny_model().fit(planted_dataset("healthy", batches=10), epochs=1, verbose=0,
                     callbacks=[tensorboard])
    analysis = profiling.analyze_trace(tmp_path)  # found under train/plugins/profile
    assert analysis["steps"] == 0
    assert analysis["step_time_ms"] is None and analysis["classification"] is None
    assert any("No step marker observed" in d for d in analysis["diagnostics"])
    assert "No step time measured" in analysis["conclusion"]


def test_stop_trace_stops_only_our_own_and_busy_is_reported(tmp_path):
    assert profiling.stop_trace() is None  # nothing of ours runs
    tf.profiler.experimental.start(str(tmp_path / "theirs"))
    try:
        assert profiling.active_trace() is None
        with pytest.raises(profiling.ProfilerBusyError, match="another profiler is running"):
            profiling.start_trace(tmp_path / "ours")
        assert profiling.stop_trace() is None
    finally:
        tf.profiler.experimental.stop(save=False)  # theirs still ran: no error
    profiling.start_trace(tmp_path / "ours", owner="me")
    try:
        assert profiling.active_trace()["owner"] == "me"
        with pytest.raises(profiling.ProfilerBusyError, match="keras_gpufix trace"):
            profiling.start_trace(tmp_path / "ours")
    finally:
        assert profiling.stop_trace(save=False) is None
    profiling.start_trace(tmp_path / "again")  # nothing left running
    profiling.stop_trace(save=False)


def test_two_traces_in_one_second_get_two_run_folders(tmp_path):
    paths = []
    for _ in range(3):
        profiling.start_trace(tmp_path, tag="same")
        with profiling.step_marker(0):
            tf.reduce_sum(tf.ones([8]))
        paths.append(profiling.stop_trace())
    assert len(set(paths)) == 3
    assert all(len(profiling.xplane_files(p)) == 1 for p in paths)


@pytest.mark.parametrize("percent, expected", [
    (None, None), (0.0, "not_input_bound"), (4.99, "not_input_bound"),
    (5.0, "moderately_input_bound"), (19.9, "moderately_input_bound"),
    (20.0, "highly_input_bound"), (87.9, "highly_input_bound"),
])
def test_classification_uses_xprof_thresholds(percent, expected):
    assert profiling.classify_input_percent(percent) == expected


def test_analyze_trace_without_a_trace_names_the_path(tmp_path):
    with pytest.raises(ValueError, match="No .xplane.pb trace found"):
        profiling.analyze_trace(tmp_path)


def test_format_analysis_and_tensorboard_command():
    analysis = {"step_time_ms": 21.14, "steps": 8, "input_percent": 87.9,
                "classification": "highly_input_bound", "conclusion": "Your program is..."}
    line = profiling.format_analysis(analysis, "my logs")
    assert line.startswith("step time 21.1 ms over 8 steps, input 87.9% -> highly_input_bound")
    assert line.endswith("Open: tensorboard --logdir 'my logs' (Profile tab)")
    empty = profiling.format_analysis({"step_time_ms": None, "conclusion": "No step time."})
    assert empty == "no step time measured; No step time."
