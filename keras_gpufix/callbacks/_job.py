"""Gathers a multi-worker job's report through the shared log dir.

At the end of `fit` every worker of a `MultiWorkerMirroredStrategy` job
writes its `analysis.job.worker_summary` to
`<log_dir>/keras_gpufix_job/task-<index>.json`, then reads the others'
(waiting up to `WAIT_S` for them) and judges the job with
`analysis.judge_job`. Every worker judges, so a non-chief worker knows
whether it is the straggler; only the chief prints the job's line. No
server, no collective: a worker that fails or is slow to finish costs the
others at most `WAIT_S`, and the report names it as missing. A summary
written before this `fit` began (an older run) is not read.
"""

import json
import os
import time

from keras_gpufix.analysis.job import judge_job, worker_summary

__all__ = ["JOB_FOLDER", "WAIT_S", "cluster_task", "gather_job"]

JOB_FOLDER = "keras_gpufix_job"
WAIT_S = 30.0
_POLL_S = 0.1


def cluster_task(model):
    """`(task index, chief, tasks)` of this process in a multi-worker job,
    or None (one worker, or no cluster).

    Tasks are numbered chief first, then the other jobs in name order
    (`worker` task i is index i when the cluster has no `chief` job); the
    chief is task 0.
    """
    strategy = getattr(model, "distribute_strategy", None)
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or resolver.task_type is None:
        return None
    spec = resolver.cluster_spec().as_dict()
    order = [(job, i) for job in sorted(spec, key=lambda j: (j != "chief", j))
             for i in range(len(spec[job]))]
    if len(order) < 2 or (resolver.task_type, resolver.task_id) not in order:
        return None
    index = order.index((resolver.task_type, resolver.task_id))
    return index, index == 0, len(order)


def gather_job(task, report, log_dir, began, wait_s=WAIT_S):
    """Writes this worker's summary, reads the others', judges the job.

    Args:
        task: `cluster_task(model)`.
        report: this worker's `GPUOscillationMonitor.report()`.
        log_dir: the folder every worker shares.
        began: wall time (`time.time()`) this `fit` began.
        wait_s: longest wait for the other workers' summaries. Defaults to
            `WAIT_S`.

    Returns:
        `analysis.judge_job`'s report, or None when this worker timed no step.
    """
    index, chief, tasks = task
    own = worker_summary(index, report, chief=chief, end_time=time.time())
    if not own["steps"]:
        return None
    folder = os.path.join(os.fspath(log_dir), JOB_FOLDER)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"task-{index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(own, f)
    os.replace(path + ".tmp", path)  # the others never read half a file
    deadline = time.monotonic() + wait_s
    while True:
        found = _read(folder, tasks, began)
        if len(found) == tasks or time.monotonic() > deadline:
            return judge_job(found, expected=tasks)
        time.sleep(_POLL_S)


def _read(folder, tasks, began):
    found = []
    for index in range(tasks):
        try:
            with open(os.path.join(folder, f"task-{index}.json")) as f:
                summary = json.load(f)
        except (OSError, ValueError):  # not written yet
            continue
        if (summary.get("end_time") or 0.0) >= began and summary["steps"]:
            found.append(summary)
    return found
