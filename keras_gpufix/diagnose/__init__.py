"""`keras-gpufix diagnose`: run an unchanged training script and say why it is slow.

Like `python -m cProfile train.py`, the script runs in this process as
`__main__` with its own `sys.argv`. While it runs, `keras.Model.fit` is
patched so that every `fit` gets, beside the user's own callbacks:

| callback                | what it contributes                                  |
|-------------------------|------------------------------------------------------|
| `GPUOscillationMonitor` | step times (its `StepTimer`), input wait, events     |
| `RetracingMonitor`      | train-step traces, new input shapes, recompile cost  |
| `ProfilerTrigger`       | an XProf trace (at a fixed step and on oscillation), |
|                         | analysed headless: input %, classification, conclusion|

A `tf.data.Dataset` passed as `x` goes through `kg.data.instrument` (unless
it already did), so the input wait is measured. `steps=N` stops each `fit`
after N steps. The script is also scanned statically (`scan_script`) for
known traps, and the environment is recorded (`environment`).

`run_diagnosis` returns one dict; `verdict` is the cause that cost the most
measured time (`rank_causes`), `healthy` when none did. Every figure in it
was measured in this run. A script that raises keeps its traceback and exit
code, and `ended_by` names the exception, where it was raised and the
training steps before; SIGTERM or SIGINT ends the script the same way, and
the report of what was measured is still returned (and printed).

After each run that timed steps, the what-if (`what_if`) measures how fast
the input alone supplies batches and how fast the step alone consumes
them, and says how much faster the run would be with the input free.
When the input costs time, each stage of its `tf.data` pipeline is
measured (`stages`): the slow stage, by the script's line that built it,
becomes the located fix of `input_bound`, with its predicted gain.

The package holds one concern per module: `scan` (the static scan), `run`
(the patching and the run), `loop_patch` (custom loops), `jax_steps` (a JAX
script's `jax.jit` steps; on JAX no TensorFlow is imported), `what_if` (input
alone vs step alone), `stages` (the input's stages, where built and how
fast), `step_blockers` (what stops tf.function running an eager step),
`step_patch` (the eager step's copy changed until tf.function runs it and
checked to compute the same; the patch files of the step's and the input's
fixes, written in the log dir) and `report` (the ranking and the text report).
"""

from keras_gpufix.analysis import TRAPS
from keras_gpufix.diagnose.report import format_report, rank_causes
from keras_gpufix.diagnose.run import environment, run_diagnosis
from keras_gpufix.diagnose.scan import scan_script

__all__ = [
    "run_diagnosis",
    "scan_script",
    "environment",
    "rank_causes",
    "format_report",
    "TRAPS",
]
