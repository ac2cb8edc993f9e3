"""callbacks/_job.py: the job report gathered through a shared folder."""

import json
import time
from types import SimpleNamespace

from keras_gpufix.callbacks._job import JOB_FOLDER, cluster_task, gather_job


def _summary(step_ms=10.0, wait_ms=0.0, steps=20):
    """A monitor's report with its `step_time` (the `StepLog.summary()`) only."""
    cycle = (step_ms + wait_ms) / 1e3
    return {"step_time": {
        "count": steps, "total_s": steps * cycle, "samples_per_s": 8 / cycle,
        "phases": {"input_wait": wait_ms / 1e3 / cycle, "step": step_ms / 1e3 / cycle,
                   "between": 0.0}}}


def _model(spec, task_type, task_id):
    resolver = SimpleNamespace(task_type=task_type, task_id=task_id,
                               cluster_spec=lambda: SimpleNamespace(as_dict=lambda: spec))
    return SimpleNamespace(distribute_strategy=SimpleNamespace(cluster_resolver=resolver))


def test_cluster_task_numbers_the_chief_first():
    workers = {"worker": ["a:1", "a:2"]}
    assert cluster_task(_model(workers, "worker", 0)) == (0, True, 2)
    assert cluster_task(_model(workers, "worker", 1)) == (1, False, 2)
    with_chief = {"chief": ["c:1"], "worker": ["a:1", "a:2"]}
    assert cluster_task(_model(with_chief, "chief", 0)) == (0, True, 3)
    assert cluster_task(_model(with_chief, "worker", 0)) == (1, False, 3)
    assert cluster_task(_model({"worker": ["a:1"]}, "worker", 0)) is None
    assert cluster_task(SimpleNamespace()) is None


def test_every_worker_judges_the_job_from_the_shared_folder(tmp_path):
    began = time.time()
    # An older run's summary of task 1 is in the folder: it must not be read.
    folder = tmp_path / JOB_FOLDER
    folder.mkdir()
    stale = {"task": 1, "chief": False, "steps": 5, "total_s": 1.0, "samples": 1.0,
             "input_wait_s": 0.0, "step_s": 1.0, "between_s": 0.0, "end_time": began - 60}
    (folder / "task-1.json").write_text(json.dumps(stale))
    alone = gather_job((0, True, 2), _summary(step_ms=40.0), tmp_path, began, wait_s=0.3)
    assert alone["workers"] == 1 and alone["missing"] == [1]
    slowed = gather_job((1, False, 2), _summary(step_ms=10.0, wait_ms=30.0), tmp_path, began,
                        wait_s=0.3)
    assert slowed["workers"] == 2 and not slowed["missing"]
    assert slowed["straggler"]["task"] == 1 and slowed["straggler"]["phase"] == "input_wait"
    assert sorted(p.name for p in folder.iterdir()) == ["task-0.json", "task-1.json"]


def test_a_worker_without_timed_steps_writes_nothing(tmp_path):
    assert gather_job((0, True, 2), {"count": 0}, tmp_path, time.time(), wait_s=0.1) is None
    assert not (tmp_path / JOB_FOLDER).exists()


def test_the_monitor_samples_the_cpu_from_its_first_steady_step():
    import keras_gpufix as kg

    monitor = kg.GPUOscillationMonitor(warmup=3, nvml=False, verbose=0)
    spent = []
    with kg.watch(range(8), callbacks=[monitor]) as watched:
        for item in watched:
            began = time.process_time()
            while time.process_time() - began < (0.3 if item == 0 else 0.01):
                pass  # the first step's CPU (a compile) is left out of the steady figures
            spent.append(time.process_time() - began)
    report = monitor.report()
    whole, steady = report["contention"], report["steady_contention"]
    assert whole["own_cpu_s"] >= sum(spent) >= 0.3
    assert steady["wall_s"] < whole["wall_s"] and steady["own_cpu_s"] < 0.3
    assert steady["own_cpu_s"] >= sum(spent[4:])
