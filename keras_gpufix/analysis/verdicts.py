"""The one verdict table, the one set of thresholds, the one slow-step rule.

Nothing outside this module defines a verdict, a fix text, a threshold, what
makes a step slow or what a recompile costs: the detector, the callbacks,
`kg.watch` and `keras-gpufix diagnose` all read them from here, and
`docs/monitoring.md` quotes them.

Verdicts, in order of precedence (the detector tries them in this order):

| verdict           | evidence                                                    |
|-------------------|-------------------------------------------------------------|
| `recompiling`     | steps at new input shapes (or new traces) that compiled cost|
|                   | >= `cost_share` of the time, and shapes keep coming         |
| `eager_step`      | the gradient step runs eagerly (direct evidence)            |
| `periodic_stall`  | slow steps recur with a period and cost >= `cost_share`     |
| `input_bound`     | input wait >= `input_wait_share` of the cycle, or low GPU   |
|                   | utilisation on long steps; phase `step` (contention): the   |
|                   | what-if finds the input costing >= `what_if_share` while    |
|                   | the wait reads low (`detector.weigh`)                       |
| `padded_batches`  | the step's work on padding (frames past each utterance's    |
|                   | end, priced by the step's own time per element) costs       |
|                   | >= `cost_share`                                             |
| `sync_callbacks`  | callbacks turned Keras's asynchronous dispatch off (JAX,    |
|                   | torch, numpy) and the host time per step that no longer     |
|                   | overlaps the device step costs >= `cost_share`              |
| `dispatch_bound`  | low GPU utilisation on short steps, input ready             |
| `irregular_stall` | steps slower than `stall_factor` x the median, without a    |
|                   | period, cost >= `irregular_share`                           |
| `degrading`       | the median cycle grew well above the first window's         |
| `healthy`         | steps were measured and none of the above holds             |
| `unknown`         | too few steps (or none) were measured to judge, or the      |
|                   | steps read healthy but the input wait was not measured      |
"""

import numpy as np

__all__ = [
    "where_place",
    "VERDICTS",
    "NOT_CAUSES",
    "FIXES",
    "PHASES",
    "PHASE_FIXES",
    "STALL_FIXES",
    "STAGE_FIXES",
    "CONTENTION_FIX",
    "THRESHOLDS",
    "TOO_FEW_STEPS",
    "INPUT_UNMEASURED",
    "RETRACE_FIX",
    "recompiling_fix",
    "not_run_verdict",
    "UNSYNCED_NOTE",
    "INPUT_SOURCE_FIXES",
    "fix_for",
    "slow_limit",
    "slow_mask",
    "recompile_cost",
    "step_compiled",
    "is_recompiling",
    "rank_causes",
    "contradicted",
    "COMPILED_STEP_FIXES",
    "compiled_step_fix",
    "patch_refusal",
    "one_off_gain",
    "compiled_share",
    "speedup_of",
]

VERDICTS = (
    "recompiling",
    "eager_step",
    "periodic_stall",
    "input_bound",
    "padded_batches",
    "sync_callbacks",
    "dispatch_bound",
    "irregular_stall",
    "degrading",
    "healthy",
    "unknown",
)

#: Verdicts that name no cause: nothing to fix, or nothing measured.
NOT_CAUSES = ("healthy", "unknown")

#: The three phases of one training cycle, in the order they happen.
PHASES = ("input_wait", "step", "between")

THRESHOLDS = {
    # The slow-step rule: slower than slow_factor x the median cycle, by at
    # least min_slow_ms, and by spread_factor robust standard deviations.
    "slow_factor": 1.25,
    "min_slow_ms": 2.0,
    "spread_factor": 4.0,
    # Cost rule: share of the cycle time lost to slow steps (their excess
    # over the median) that makes a periodic_stall or recompiling.
    "cost_share": 0.10,
    # Slow steps without a period are stalls only when they are long (a
    # loaded host makes many steps 1.3x-1.7x slower: that is noise, not a
    # stall) and cost irregular_share of the time.
    "stall_factor": 2.0,
    "irregular_share": 0.15,
    # A window must lose at least this much before a stall is reported
    # (a host hiccup in a window of 1 ms steps is not worth a verdict).
    "min_lost_ms": 20.0,
    # Share of the cycle spent waiting for input (XProf's "highly
    # input-bound" threshold).
    "input_wait_share": 0.20,
    "low_gpu_util": 0.5,
    "short_step_ms": 10.0,
    "acf_threshold": 0.5,
    "growth_threshold": 0.5,
    # Distinct input shapes that compile once each without being a problem
    # (kg.data with num_buckets=8 and its partial batches, twice over).
    "max_new_shapes": 16,
    # Fewest steps (after warmup) a judgement is made on.
    "min_judge_steps": 8,
    # A worker of a multi-worker job is the straggler when its own host time
    # per step (input wait + between steps) exceeds the other workers' by
    # this share of the job's cycle (analysis/job.py).
    "straggler_share": 0.10,
    # ... and where its cause is its own step's work (its CPU time per step above
    # the others'), this share: two identical workers pinned to their own CPUs of a
    # shared VM did the same steps' work up to 16% of the cycle apart in CPU time
    # (benchmarks/straggler.py, healthy pairs of 88 steps); a planted slow step 45%.
    "straggler_step_share": 0.20,
    # XProf's own classification of a trace by its input share
    # (op_stats_to_input_pipeline_analysis.cc: kHighlyInfeedBoundThresholdInPercent,
    # kModeratelyInfeedBoundThresholdInPercent), in percent of step time.
    "xprof_highly_input_bound_percent": 20.0,
    "xprof_moderately_input_bound_percent": 5.0,
    # The what-if's speedup with the input free below which the run would be
    # "no faster" (measurement noise of two short timings).
    "min_speedup": 1.05,
    # The share of the run the what-if must find the input costing, at the
    # low end of its own range, before it overturns a `healthy` step log
    # (analysis.weigh): the cause rule's cost_share. It was 0.30 while the
    # what-if counted the monitors' hooks as input (1.19x-1.37x on a cached
    # input, true ~1.0); since each cycle is split into the part a free input
    # changes and the hooks that stay, and the gain comes with its range,
    # benchmarks/what_if.py checks it against re-measured truth.
    "what_if_share": 0.10,
    # The what-if knows its speedup when its range (replay spread and twice
    # the standard error of the run's timings) lies within this share of it
    # on either side: the 25% its predictions are checked to
    # (benchmarks/what_if.py); a wider range is "does not know" and
    # analysis.weigh ignores it.
    "what_if_uncertainty": 0.25,
    # A pipeline whose input, drained alone, supplies this many times the
    # batches/s the step alone consumes is not what the step waits for: a run
    # of it is never input_bound (analysis.weigh). keras-io's CTC ASR read
    # input_bound 37% (predicted 1.56x) beside its own what-if of 51.7 batches/s
    # against a demand of 0.6; its cache measured 0.88x.
    "input_rate_margin": 4.0,
    # compile_model's measured steps_per_execution (compile/calibration.py):
    # the smallest k whose per-execution overhead is under this share of the
    # execution's time, capped so callbacks fire at least every
    # `spe_max_execution_s` seconds.
    "spe_overhead_share": 0.05,
    "spe_max_execution_s": 1.0,
    # Unsynced asynchronous steps (analysis.dispatch): a step at most this
    # share of the mean step is at dispatch cost; a period is looked for
    # over at least min_periods periods (fewer, and noise on a loaded host
    # lines up by chance).
    "dispatch_share": 0.25,
    "min_periods": 8,
    # Steps of one input shape whose median is that shape's expected step
    # (the detector judges a step against steps of its own shape, so
    # uneven lengths are not slow steps): 3, so one stall among them does
    # not move the median; a shape seen fewer times is expected from a
    # Theil-Sen line of step time vs elements per batch over the shapes.
    "shape_min_steps": 3,
    # diagnose names the line where periodic work runs (stack samples of
    # the slow cycles, `analysis.locate_periodic`) only when that line
    # holds at least half the slow cycles' extra samples: the work, not
    # the step's noise, is then where they spend their extra time.
    "locate_share": 0.5,
    # ... and by this many standard errors of its samples per cycle: the
    # offset in step with the period is the one with the most excess, which
    # favours some line by about 2 standard errors on noise alone.
    "locate_z": 4.0,
    # A periodic stall's after-effect: the cycles right after each stall run
    # slower than the period's other cycles (the work's own cold start: caches
    # and threads parked while it ran, the cores taken meanwhile); removing the
    # stall removes that too, so it is priced with the stall when the after
    # cycles' median exceeds the other cycles' by this many standard errors
    # (fewer, and noise among a few cycles would be priced as an effect).
    "after_effect_z": 2.0,
    # The slow stage of an input pipeline (analysis.stages) is named when its
    # cost is at least this share of the pipeline's time per batch: below
    # half, no one stage is the bottleneck and fixing it alone cannot double
    # the input's rate (Plumber ranks stages the same way, by their share).
    # A run whose input wait is this share of its time has its input measured
    # stage by stage even when judged healthy (analysis.stages_needed): half
    # the cost rule, so an input cause near its threshold (the transformer
    # ASR's slow map, 10-25% of the run) names its line and gain in every run.
    "stage_wait_share": 0.05,
    "stage_share": 0.5,
}

PHASE_FIXES = {
    "input_wait": (
        "the input pipeline stalls every {period} batches and that costs {share} of the "
        "run: look for a slow element on that schedule (a py_function, a cache or "
        "shuffle buffer refilling, a slow file) and move it off the step path"
    ),
    "step": (
        "the step itself is slow every {period} steps and that costs {share} of the "
        "run: look for work on that schedule inside the step (a metric or summary "
        "written every k steps, garbage collection)"
    ),
    "between": (
        "work between steps every {period} steps costs {share} of the run: a "
        "callback, logging or checkpointing on that schedule; run it less often "
        "or move it off the step path"
    ),
    "loop_body": (
        "work in the loop body every {period} steps costs {share} of the run "
        "(logging, plots, checkpoints or host syncs on that schedule); run it less "
        "often or move it off the step path"
    ),
}

#: The fix of `irregular_stall` by the phase holding most of the long cycles'
#: excess: where the run's own measurements say where the time went (the
#: input, the time between steps), the fix names that; a trace is the advice
#: only for long steps nothing measured explains, and it says what the trace
#: will show.
STALL_FIXES = {
    "input_wait": (
        "occasional late batches cost {share} of the run (the step waited for its input at "
        "those cycles, on no schedule): part of the input is slow now and then (a slow "
        "file, a py_function's uneven work, a shuffle or cache buffer refilling): cache "
        "the input's costly work (ds.cache() after it, or kg.data.SpeechDatasetBuilder("
        "cache_dir=...)) and prefetch, so one late batch no longer stops the step"
    ),
    "between": (
        "occasional long gaps between steps cost {share} of the run (callbacks, logging, "
        "checkpoints or garbage collection on no fixed schedule): run that work less often "
        "or off the step path"
    ),
    "step": (
        "occasional long steps cost {share} of the run and nothing the run measured "
        "explains them (not the input, new shapes, padding or the time between steps): "
        "capture a trace of one (kg.ProfilerTrigger(trigger='slow_step')): it shows whether "
        "the long step waits on a host op, a copy between host and device, or cores taken "
        "by other processes"
    ),
}

#: The located fix of `input_bound` (analysis.stages): one text per kind of
#: slow stage, `function` (where the stage's own function is), and `text`,
#: the sentence that names the stage.
STAGE_FIXES = {
    "python": (
        "move the Python work of `{op}` at {where}{function} into TF ops (tf.audio, "
        "tf.signal, kg.data) or cache its output (`.cache()` right after it, or "
        "kg.data.SpeechDatasetBuilder(cache_dir=...))"
    ),
    "parallel": (
        "`{op}` at {where}{function} runs one element at a time "
        "(num_parallel_calls={parallel}; tf.data parallelizes only a stateless map by "
        "itself): pass num_parallel_calls=tf.data.AUTOTUNE ({cpus} cores)"
    ),
    "source": (
        "the source at {where}{function} reads slowly: cache what it reads (`.cache()` "
        "after it; where it reads many files, read them in parallel: interleave with "
        "num_parallel_calls=tf.data.AUTOTUNE)"
    ),
    "cache": (
        "`{op}` at {where}{function} is slow even in parallel: cache its output "
        "(`.cache()` right after it) or make its work cheaper"
    ),
    "function": " (Python function at {function})",
    "text": (
        "the input's slow stage is `{op}` at {where}: it takes {share:.0%} of the input's "
        "time (drained stage by stage, its work alone caps the input at {rate:.1f} "
        "batches/s, the whole input at {input:.1f} batches/s in the same drains{demand}); "
        "{fix}: predicted "
        "{gain:.2f}x faster per step"
    ),
    "from_epoch_2": "; a cache serves from the second epoch: the first runs as now",
    "from_pass_2": (
        "; the `.repeat()` right before it goes after the cache, which then serves from the "
        "second pass over the data ({steps:.0f} batches): the first runs as now"
    ),
    "cached_instead": (
        "; with a cache instead of TF ops (it serves from the second epoch) the whole run "
        "{gain:.2f}x"
    ),
    "run": (
        "; over the script's run ({steps} steps, and {fixed:.1f} s of start-up and compiles "
        "that no input fix removes) the whole run {gain:.2f}x"
    ),
    "later_runs": (
        "; with the cache on disk (`.cache(filename)`, or kg.data.SpeechDatasetBuilder("
        "cache_dir=...)) every later run of the script {gain:.2f}x, from its first step"
    ),
}

#: The fix of `input_bound` when its time goes in the step (phase `step`):
#: the input pipeline competes with the step for the host's cores, the wait
#: for input reads ~0 while the step runs slower beside it than alone (the
#: what-if's replay, weighed in by `analysis.weigh`).
CONTENTION_FIX = (
    "the input pipeline competes with the step for the CPU and costs {share} of the run "
    "(the input wait reads low, but the step runs slower beside the pipeline than alone): "
    "take its Python/NumPy work off the step's cores: a feature cache "
    "(kg.data.SpeechDatasetBuilder(cache_dir=...), or ds.cache() after the costly map), "
    "the features in TF ops instead of numpy_function/py_function, fewer parallel calls "
    "than cores, or the tf.data service on other machines"
)

#: The fix of `eager_step` once diagnose compiled the user's own step both ways
#: on a real batch (`diagnose.what_if.compile_step`): by which way was faster,
#: or by the op XLA could not compile.
COMPILED_STEP_FIXES = {
    "tf.function(jit_compile=True)": (
        "wrap the step {function} in tf.function(jit_compile=True): measured on a real batch, "
        "{eager_ms:.1f} ms eager -> {xla_ms:.1f} ms with XLA ({function_ms:.1f} ms as a plain "
        "tf.function)"
    ),
    "tf.function": (
        "wrap the step {function} in tf.function: measured on a real batch, {eager_ms:.1f} ms "
        "eager -> {function_ms:.1f} ms ({xla_ms:.1f} ms with jit_compile=True: no faster)"
    ),
    "no_xla": (
        "wrap the step {function} in tf.function, without jit_compile: measured on a real "
        "batch, {eager_ms:.1f} ms eager -> {function_ms:.1f} ms. XLA cannot compile it: "
        "`{xla_op}` at {xla_where} has no XLA kernel (a tf.print, a string op); move it out of "
        "the step (print the returned loss outside) before trying jit_compile=True"
    ),
}

#: The fix of `input_bound` when the input is not a `tf.data` pipeline (a
#: `keras.utils.PyDataset`, a generator, a Python iterable: the JAX and torch
#: backends' usual input), where tf.data's own advice does not apply.
PYTHON_INPUT_FIX = (
    "the step waits for its batches, made in Python ({x}): make them in parallel "
    "(keras.utils.PyDataset(workers=N, use_multiprocessing=True), N up to the cores), "
    "compute the features once and read them back (a feature cache on disk, e.g. .npy "
    "files), and keep the per-batch Python light"
)

#: What stops tf.function from running the user's eager step as written
#: (`diagnose.step_blockers`), each with the change that removes it; a report
#: line is `{where}: ` and one of these.
STEP_BLOCKERS = {
    "python_state": (
        "`{code}` changes Python state: under tf.function it runs once, when the step is "
        "traced, not at every step; move it out of the step (count in the loop) or keep the "
        "value in a tf.Variable (`.assign_add`)"
    ),
    "host_read": (
        "`{code}` reads a tensor's value into Python (.numpy(), float(), int()): inside "
        "tf.function there is no value yet; return the tensor from the step and read it "
        "after the call"
    ),
    "none_before_loop": (
        "`{code}`: {message}; tf.function runs that loop in TensorFlow and needs each "
        "value it sets to be a tensor before it: start from zeros (`tuple(tf.zeros_like(v) "
        "for v in model.trainable_variables)`, kept a tuple in the loop: a list is packed "
        "into one tensor there; `loss = tf.constant(0.0)`) or accumulate into tf.Variables"
    ),
    "trace_error": "`{code}`: tf.function could not trace the step here: {message}",
}

#: What `compiled_step_fix` adds where the script wraps the step's function in
#: tf.function itself (`diagnose.own_wrappers`), measured or blocked.
OWN_WRAPPER_NOTE = {
    "measured": (
        "; the script already wraps it in tf.function at {lines}: take that path (the flag "
        "or branch that leads there) rather than a new wrapper (diagnose timed its own "
        "tf.function of the same function, not that path's arguments)"
    ),
    "blocked": "; the script's own tf.function of it at {lines} needs the same changes",
}

#: The `eager_step` fix when diagnose could not compile the user's step as written.
BLOCKED_STEP_FIX = (
    "the step {function} runs eagerly, and tf.function cannot run it as written: change the "
    "{count} line{s} below first (each says how), then wrap it in tf.function (then try "
    "jit_compile=True)"
)

#: What `compiled_step_fix` adds from diagnose's patched copy of the step
#: (`diagnose.step_patch`): the changes that made it run under tf.function,
#: checked to compute the eager step's result, and the patch file; or where the
#: copy stopped (the line, TensorFlow's message, what was not checked); or that the
#: copy ran but computed something else (then nothing is offered).
STEP_PATCH_NOTES = {
    "applied": (
        "; diagnose ran it so: {changed}checked on the run's batch to give the eager step's "
        "returns and updated weights{within} (from the same weights, restored after); "
        "`patch -p1 < {patch}` from the folder diagnose ran in applies {what}"
    ),
    "no_patch": (
        "; diagnose ran it so: {changed}checked on the run's batch to give the eager step's "
        "returns and updated weights{within}; no patch file was written ({reason})"
    ),
    "stopped": (
        "; diagnose made {count} change{s} in a copy of the step and traced it {traces} "
        "time{ts}, and stopped at {where} (`{code}`): {message}; it cannot make that change: "
        "{unchecked}"
    ),
    "differs": (
        "; diagnose made {count} change{s} in a copy of the step so that it runs, but the "
        "copy computes a different result ({differs}): no change is offered"
    ),
}

#: The eager-step fix's gain once diagnose ran the script with its patch
#: (`diagnose.patched_run`): the script as it is and with the patch, alternated, their
#: steady steps/s judged as `compare` judges two runs (`analysis.paired_gain`).
PATCHED_RUN_TEXT = (
    "measured: diagnose ran the script as it is and with {what}, alternated (in memory, its "
    "files untouched; {rounds} round{s} of {steps} steps): {before} -> {after} steps/s, "
    "{gain} (the mean wall per steady step, stalls included, as `compare` judges two "
    "runs){whole}"
)
#: ... where a periodic stall's loop-body line was skipped: all of its time removed; how
#: often to run that work is the user's choice, so no patch.
SKIPPED_RUN_WHAT = ("{where} skipped (all of that work removed; run it k times less often "
                    "to gain about 1 - 1/k of the difference)")
#: ... where the script does not run with that line skipped: the cost share stands.
SKIPPED_RUN_FAILED = ("diagnose could not check it by a run with {where} skipped ({error}): "
                      "the prediction is the share it cost")
#: ... and all the fixes diagnose ran, run together once more (their gains apart do not
#: add up: the causes interact).
TOGETHER_RUN_TEXT = (
    "the {count} fixes together, measured: diagnose ran the script as it is and with all of "
    "them, alternated ({rounds} round{s} of {steps} steps): {before} -> {after} steps/s, "
    "{gain}; the causes interact, so their gains apart do not add up"
)
#: ... and where the script with the patch failed or ran no step: the patch is not offered.
PATCHED_RUN_FAILED = (
    "not offered: the step's copy ran and computed the same on one batch, but the script "
    "with the patch did not run: {error}; make the changes below by hand and check them"
)


#: What an `input_bound` fix that is an edit at a named line adds
#: (`diagnose.step_patch.input_patch`): the patch that makes it.
INPUT_PATCH_NOTE = (
    "; `patch -p1 < {patch}` from the folder diagnose ran in makes the edit ({edits})"
)

#: Where the patch caches on disk (`analysis.on_disk_cache`).
ON_DISK_NOTE = (
    " (the cache on disk: the first run writes it, every later run reads it; delete its "
    "files when the data or the work before it changes)"
)

#: A change of diagnose's patch, listed under the `eager_step` fix.
STEP_CHANGE = "{where}: `{code}` -> {change}"

#: What `compiled_step_fix` adds when the step compiled but changes Python state.
STATEFUL_STEP_NOTE = (
    "; first move the Python state it changes out of it ({lines}, below): the step as "
    "measured ran it once, at its trace"
)

#: The fix of `unknown` when steps were seen, but fewer than min_judge_steps.
TOO_FEW_STEPS = (
    "only {steps} steps after warmup (fewer than min_judge_steps={min_steps}): too few to "
    "judge; run longer or lower warmup"
)

#: The fix of `unknown` where the steps were judged healthy but the input wait was not
#: measured (`{phase}`: the phase that holds the input's time, `{share}` its share,
#: `{command}` the script's command line).
INPUT_UNMEASURED = (
    "the input wait was not measured: the {phase} ({share} of the run) holds the time "
    "spent waiting for each batch; measure it: keras-gpufix diagnose -- {command}"
)

#: Said first in the `recompiling` fix when the step was traced again (not only
#: compiled for new shapes): what makes tf.function retrace.
RETRACE_FIX = ("feed tensors of fixed dtype and structure (no Python numbers or lists in "
               "the batch)")


def recompiling_fix(verdict: str, fix: str, retraces: int) -> str:
    """The run's `fix`, with `RETRACE_FIX` said first when the run is `recompiling`
    and its step was traced again after its first compile (`retraces`), not only
    compiled for new shapes."""
    return f"{RETRACE_FIX}; {fix}" if verdict == "recompiling" and retraces else fix


def not_run_verdict() -> dict:
    """The verdict of a monitor that took part in no run yet: `unknown`, in
    the shape of `OscillationDetector.verdict()`."""
    return {"verdict": "unknown", "fix": "no run was monitored yet", "phase": None,
            "cost_share": None, "because": [], "changed": None}


#: Said with a judgement of unsynced asynchronous steps (analysis.dispatch).
UNSYNCED_NOTE = (
    "steps timed at dispatch, each ending where the host read a value every {period} "
    "steps (asynchronous execution): judged per {period} steps; for per-step times let "
    "kg.watch sync at each step's end (sync=True, the default) or read a value every step"
)

FIXES = {
    "recompiling": (
        "bound the number of input shapes: bucket by length with "
        "`pad_to_bucket_boundary` (kg.data `num_buckets`) or pad to a multiple"
    ),
    "eager_step": (
        "the training step runs eagerly (a GradientTape outside any tf.function, or fit "
        "with run_eagerly=True): compile it: wrap the step in tf.function, then try "
        "jit_compile=True (`keras-gpufix diagnose` compiles it both ways, times them and "
        "names what stops it from compiling), or use kg.compile_model(model, ...) (fit), "
        "at {where}"
    ),
    "periodic_stall": (
        "something runs every {period} steps: look for work on that schedule "
        "(a py_function or slow element in the input pipeline, checkpoints, "
        "logging, garbage collection) and move it off the step path"
    ),
    "input_bound": (
        "the step waits for data: move decoding/features into TF ops or a "
        "feature cache (kg.data.SpeechDatasetBuilder(cache_dir=...)), raise "
        "map parallelism to AUTOTUNE and prefetch"
    ),
    "padded_batches": (
        "{padding} of the batches' frames are padding (each batch padded to its longest "
        "utterance; {shapes} input shapes in the steps judged) and the step's work on it "
        "costs {share} of the run: bucket the utterances by length "
        "(kg.data.SpeechDatasetBuilder(num_buckets=8), or tf.data's "
        "bucket_by_sequence_length(..., pad_to_bucket_boundary=True)), so each "
        "batch pads only to its bucket's boundary; the few bounded shapes then let the step "
        "compile with XLA once each (kg.compile_model(jit_compile=True)): predicted {gain} "
        "faster with the padding's time gone (XLA's own gain is not in it)"
    ),
    "sync_callbacks": (
        "{where} override a batch-end hook without `async_safe = True`, so Keras waits for "
        "each step before dispatching the next ({share} of the time lost): set "
        "`async_safe = True` on a callback whose batch-end work is thread-safe, or move "
        "per-batch work to on_epoch_end (Keras's own TensorBoard, ModelCheckpoint, "
        "BackupAndRestore and TerminateOnNaN block it whatever their update_freq / save_freq)"
    ),
    "dispatch_bound": (
        "steps are too short for per-step dispatch: raise steps_per_execution "
        "(kg.compile_model(steps_per_execution='auto')) or the batch size"
    ),
    "irregular_stall": (
        "occasional long cycles cost {share} of the run, most of it in {phase}: capture "
        "a trace of one (kg.ProfilerTrigger(trigger='slow_step')) to see what runs then"
    ),
    "degrading": (
        "step time keeps growing: look for state that accumulates per step "
        "(Python lists of tensors, retracing, unbounded caches) or throttling"
    ),
    "healthy": "nothing to fix",
    "unknown": (
        "no training step was seen (no model.fit, no gradient step between iterations of "
        "a tf.data dataset): nothing was measured, so nothing can be judged"
    ),
}


#: The `input_bound` fix for fit's Python data sources (the Keras data
#: adapter's kind, `backends.batch_clock.BatchClock.source`), not `tf.data`.
INPUT_SOURCE_FIXES = {
    "PyDataset": (
        "the step waits for data from a keras.utils.PyDataset: give it workers "
        "(PyDataset(workers=N, use_multiprocessing=True) for CPU-heavy __getitem__), or compute "
        "the features once into a cache (kg.data.SpeechDatasetBuilder(cache_dir=...))"
    ),
    "Generator": (
        "the step waits for data from a Python generator: make it a keras.utils.PyDataset "
        "with workers (use_multiprocessing=True for CPU-heavy work), or compute the features "
        "once into a cache (kg.data.SpeechDatasetBuilder(cache_dir=...))"
    ),
}


class _Fields(dict):
    def __missing__(self, key):
        return "?"


def fix_for(verdict: str, phase: str = None, **fields) -> str:
    """The fix text of `verdict`, its `{fields}` filled in.

    Args:
        verdict: a name in `VERDICTS`.
        phase: for `periodic_stall`, the phase where the time goes
            (`input_wait`, `step`, `between`, or `loop_body` for an unsplit
            custom-loop span); selects the phase's text from `PHASE_FIXES`;
            for `irregular_stall`, from `STALL_FIXES` (a trace only for
            long steps nothing measured explains).
            For `input_bound`, `step` (the input's cost shows as a slower
            step: contention for the host's cores) selects `CONTENTION_FIX`,
            and a `source` field of `INPUT_SOURCE_FIXES` (fit's Python data
            source) that source's text.
            `FIXES` itself uses `{period}`, `{where}`, `{share}` and
            `{phase}` (`irregular_stall`: the phase holding most of the
            long cycles' excess); `padded_batches` `{padding}` (the share
            of the features' frames that are padding, a fraction),
            `{shapes}` (distinct input shapes) and `{gain}` (computed
            from `share` unless given).
        **fields: `period`, `share` (a fraction, printed as a percentage),
            `where`, ...; a missing one prints as `?`.

    Raises:
        ValueError: for a name not in `VERDICTS`.
    """
    if verdict not in FIXES:
        raise ValueError(f"`verdict` must be one of {VERDICTS}. Received: verdict={verdict!r}")
    if verdict == "periodic_stall" and phase in PHASE_FIXES:
        text = PHASE_FIXES[phase]
    elif verdict == "irregular_stall" and phase in STALL_FIXES:
        text = STALL_FIXES[phase]
    elif verdict == "input_bound" and phase == "step":
        text = CONTENTION_FIX
    elif verdict == "input_bound" and fields.get("source") in INPUT_SOURCE_FIXES:
        text = INPUT_SOURCE_FIXES[fields["source"]]
    else:
        text = FIXES[verdict]
    if verdict == "periodic_stall" and fields.get("where"):
        text += ", at {where}"  # located (diagnose's stack samples of the slow cycles)
    values = _Fields({k: v for k, v in fields.items() if v is not None})
    if verdict == "padded_batches" and isinstance(values.get("share"), float):
        gain = speedup_of(values["share"])
        values.setdefault("gain", "unbounded" if gain is None else f"{gain:.2f}x")
    if isinstance(values.get("padding"), float):
        values["padding"] = f"{values['padding']:.0%}"
    if isinstance(values.get("share"), float):
        values["share"] = f"{values['share']:.0%}"
    if phase is not None:
        values.setdefault("phase", phase.replace("_", " "))
    return text.format_map(values)


def slow_limit(times, median: float = None, factor: float = None,
               min_ms: float = None, spread: bool = True) -> float:
    """THE slow-step rule, as a limit: a step slower than this is slow.

    A step is slow when it is slower than `factor` x the median, by at
    least `min_ms`, and by `THRESHOLDS["spread_factor"]` robust standard
    deviations (1.4826 x median absolute deviation) of `times`, so OS jitter
    on short steps and a noisy neighbour are not slow steps. A callback
    that judges one step at a time (`ProfilerTrigger`) computes the limit
    over its recent normal steps once in a while and compares each step
    with it; `slow_mask` judges a whole series.

    Args:
        times: seconds per step (1-D, not empty): the reference steps.
        median: the reference: one number, or one per step of `times`
            (each step's expected time, e.g. the median of steps of its
            own input shape: `analysis.detector`); defaults to the median
            of `times`.
        factor: defaults to `THRESHOLDS["slow_factor"]`.
        min_ms: defaults to `THRESHOLDS["min_slow_ms"]`.
        spread: apply the spread condition. Defaults to True. The detector
            leaves it out where a period must also be found: a period, not
            the spread, then tells a schedule from noise (frequent slow
            steps, every 3rd, widen the spread themselves).

    Returns:
        The limit, in seconds per step (one per step for a per-step `median`).
    """
    t = np.asarray(times, dtype=np.float64)
    med = np.median(t) if median is None else np.asarray(median, dtype=np.float64)
    factor = THRESHOLDS["slow_factor"] if factor is None else factor
    min_ms = THRESHOLDS["min_slow_ms"] if min_ms is None else min_ms
    limit = np.maximum(factor * med, med + min_ms / 1e3)
    if spread:
        mad = 1.4826 * float(np.median(np.abs(t - med)))
        limit = np.maximum(limit, med + THRESHOLDS["spread_factor"] * mad)
    return float(limit) if limit.ndim == 0 else limit


def slow_mask(times, median: float = None, factor: float = None,
              min_ms: float = None, spread: bool = True) -> np.ndarray:
    """THE slow-step rule (`slow_limit`): which of `times` are slow.

    Args:
        times: seconds per step (1-D).
        median, factor, min_ms, spread: as in `slow_limit`, over `times`.

    Returns:
        A boolean array, True for a slow step.
    """
    t = np.asarray(times, dtype=np.float64)
    if not t.size:
        return np.zeros(0, bool)
    return t > slow_limit(t, median, factor, min_ms, spread)


def recompile_cost(step_s: float, median_s: float, steps: int = 1, *, traces: int = 0,
                   new_shape: bool = False, jit=None, compiled_before: bool = False,
                   compile_s: float = None) -> float:
    """THE recompile pricing: seconds a step spent compiling (estimated).

    A step compiled when it traced its function again (`traces > 0`) or met
    a new input shape under XLA (`jit is True`) that was not compiled in an
    earlier fit. It then costs its time above the median step; any other
    step costs no compile (an eager step, a new shape without XLA, or a
    slow step whose shape is unknown: without `kg.data.instrument` slow
    steps are never priced as recompiles). Where the backend counted the
    step's compiles (`compile_s`, JAX's `jax.monitoring` events), that
    measurement decides: the step cost its compile seconds (at most its
    time).

    Args:
        step_s: the step's time, without its input wait (seconds, for all
            its `steps`).
        median_s: the median time of one step (seconds).
        steps: steps the record covers (`steps_per_execution`).
        traces: new traces during the step.
        new_shape: the step met an input shape never seen before.
        jit: whether the step is XLA-compiled (None: not known).
        compiled_before: the shape was compiled in an earlier fit.
        compile_s: seconds the step spent compiling, measured (None: not
            counted).
    """
    if not step_compiled(traces=traces, new_shape=new_shape, jit=jit,
                         compiled_before=compiled_before, compile_s=compile_s):
        return 0.0
    if compile_s is not None:
        return min(float(compile_s), float(step_s))
    return max(0.0, float(step_s) - float(median_s) * steps)


def step_compiled(*, traces: int = 0, new_shape: bool = False, jit=None,
                  compiled_before: bool = False, compile_s: float = None) -> bool:
    """Whether a step compiled: it traced again, or met a new input shape
    under XLA (`jit is True`) not compiled in an earlier fit; where its
    compiles were counted (`compile_s` not None), whether it spent time
    compiling. The arguments are those of `recompile_cost`."""
    if compile_s is not None:
        return compile_s > 0
    return traces > 0 or (new_shape and jit is True and not compiled_before)


def is_recompiling(compile_s: float, total_s: float, *, retraces: int = 0,
                   late_compiles: int = 0, shapes: int = 0, max_new_shapes: int = None,
                   cost_share: float = None) -> tuple:
    """THE recompiling rule: new shapes (or traces) keep costing compile time.

    Compiles that stop (a bounded set of shapes compiled once each in the
    first epoch: the fix for `recompiling` applied) are warm-up, never
    `recompiling`, whatever they cost. Compiles keep coming when the step
    was traced again after its first compile, a new shape compiled after
    the first epoch, or more than `max_new_shapes` distinct shapes were
    seen; then the run is `recompiling` when the compiles (priced by
    `recompile_cost`) cost at least `cost_share` of the time.

    Args:
        compile_s: seconds the compiling steps cost (sum of `recompile_cost`).
        total_s: the time they are a share of (cycle time, or fit time).
        retraces: traces after the function's first compile.
        late_compiles: steps that compiled a new shape after the first epoch.
        shapes: distinct input shapes seen.
        max_new_shapes: defaults to `THRESHOLDS["max_new_shapes"]`.
        cost_share: defaults to `THRESHOLDS["cost_share"]`.

    Returns:
        `(verdict_is_recompiling, share)`, share = compile_s / total_s.
    """
    max_new_shapes = THRESHOLDS["max_new_shapes"] if max_new_shapes is None else max_new_shapes
    cost_share = THRESHOLDS["cost_share"] if cost_share is None else cost_share
    share = float(compile_s) / float(total_s) if total_s > 0 else 0.0
    kept = retraces > 0 or late_compiles > 0 or shapes > max_new_shapes
    return bool(kept and share >= cost_share), share


def rank_causes(causes) -> list:
    """Ranks measured causes by the share of time each cost, best first.

    Args:
        causes: iterable of `(verdict, cost_share, evidence)` (evidence a
            dict; its `period`, `phase`, `share`, `where` fill the fix).
            One verdict seen several times keeps its largest share.

    Returns:
        A list of dicts `verdict`, `score` (share of time, 0..1),
        `evidence` (list of the evidence dicts), `fix`. `healthy` and
        `unknown` are never ranked as causes.
    """
    merged = {}
    for verdict, share, evidence in causes:
        if verdict in NOT_CAUSES:
            continue
        if verdict not in FIXES:
            raise ValueError(f"Unknown verdict {verdict!r}; expected one of {VERDICTS}")
        slot = merged.setdefault(verdict, {"verdict": verdict, "score": 0.0, "evidence": []})
        slot["score"] = max(slot["score"], float(share or 0.0))
        slot["evidence"].append(dict(evidence or {}))
    ranking = sorted(merged.values(),
                     key=lambda c: (-c["score"], VERDICTS.index(c["verdict"])))
    for cause in ranking:
        best = next((e for e in cause["evidence"] if e.get("period") or e.get("phase")),
                    cause["evidence"][0] if cause["evidence"] else {})
        fields = {k: best.get(k) for k in ("period", "where", "padding", "shapes")}
        fields["share"] = cause["score"]
        cause["fix"] = fix_for(cause["verdict"], phase=best.get("phase"), **fields)
    return ranking


def contradicted(verdict: str, median_step_ms: float = None) -> "str | None":
    """Why the run's measurement rules out a static finding's `verdict`, or None.

    `dispatch_bound` (a step too short for per-step dispatch, a `.numpy()`
    sync per step) needs steps shorter than `short_step_ms`: beside a
    longer median step, per-step dispatch or a sync costs a small share.

    Args:
        verdict: the finding's verdict (a name in `VERDICTS`).
        median_step_ms: the run's measured median step (None: not measured).
    """
    limit = THRESHOLDS["short_step_ms"]
    if verdict == "dispatch_bound" and median_step_ms is not None and median_step_ms >= limit:
        return (f"the measured median step is {median_step_ms:.0f} ms, not shorter than "
                f"short_step_ms={limit:.0f} ms: per-step dispatch costs a small share of it")
    return None


def blocker_line(blocker: dict) -> str:
    """`file:line: ...`: one blocker of the user's step (`STEP_BLOCKERS`) and its fix."""
    return f"{blocker['where']}: " + STEP_BLOCKERS[blocker["kind"]].format_map(_Fields(
        {k: v for k, v in blocker.items() if v}))


def where_place(where: str) -> tuple:
    """`(file, line)` of a fix's location `file:line: why` (`line` a string; `file`
    "" where it names none)."""
    file, _, line = where.split(": ", 1)[0].rpartition(":")
    return file, line


def compiled_step_fix(compiled: dict) -> "str | None":
    """The `eager_step` fix from `compile_step`'s measurement: the way that compiled,
    measured, with the Python state to move out first; when it could not be
    compiled, to change what blocks it (`blocker_line`, each its own line); None
    without either."""
    if not compiled:
        return None
    blockers = compiled.get("blockers") or []
    if compiled.get("best_ms") is None:
        if not blockers:
            return None
        text = BLOCKED_STEP_FIX.format(function=compiled.get("function", "?"),
                                       count=len(blockers), s="s" * (len(blockers) != 1))
        kind = "blocked"
    else:
        key = "no_xla" if compiled.get("xla_ms") is None else compiled["best"]
        values = _Fields({k: v for k, v in compiled.items() if v is not None})
        text = COMPILED_STEP_FIXES[key].format_map(values)
        if blockers and compiled.get("changes") is None:  # no copy moved them out
            text += STATEFUL_STEP_NOTE.format(lines=", ".join(b["where"] for b in blockers))
        kind = "measured"
    text += step_patch_note(compiled)
    wrappers = compiled.get("own_wrappers")
    if wrappers:
        text += OWN_WRAPPER_NOTE[kind].format(lines=", ".join(
            f"{w['where']} (`{w['code']}`)" for w in wrappers))
    return text


def patch_refusal(compiled: dict) -> "str | None":
    """Why diagnose offers no patch of the eager step, in one clause for the headline
    (the user's line and TensorFlow's message where its copy stopped; the result that
    differed; why no file was written), or None where it offers one or made no copy."""
    if not compiled or compiled.get("patch") or compiled.get("changes") is None:
        return None
    stopped = compiled.get("stopped")
    if stopped:
        message = (stopped.get("message") or "").strip().splitlines()
        return f"its copy stopped at {stopped.get('where', '?')}: " + (
            message[0] if message else "?")
    if compiled.get("differs"):
        return f"its copy computes a different result ({compiled['differs']})"
    return compiled.get("patch_reason")


def steps_per_s_words(value: float) -> str:
    """A rate as the reruns' texts say it: three figures (`19.1`, `218`), whole above
    a thousand (`1012`, never `1.01e+03`)."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def step_patch_note(compiled: dict) -> str:
    """What diagnose's patched copy of the step showed (`STEP_PATCH_NOTES`), or ""
    where no copy was made."""
    changes = compiled.get("changes")
    if changes is None:
        return ""
    count = len(changes)
    lines = dict(count=count, s="s" * (count != 1), traces=compiled.get("traces", 0),
                 ts="s" * (compiled.get("traces", 0) != 1))
    if compiled.get("stopped"):
        return STEP_PATCH_NOTES["stopped"].format_map(_Fields({**lines, **compiled["stopped"]}))
    if compiled.get("differs"):
        return STEP_PATCH_NOTES["differs"].format_map(_Fields({**lines, **compiled}))
    if compiled.get("best_ms") is None:
        return ""
    changed = (f"the {count} change{lines['s']} below, then tf.function; " if count
               else "as written in tf.function; ")
    what = ("the changes and the wrapper" if count else "the wrapper") + (
        " (jit_compile=True)" if compiled.get("best") == "tf.function(jit_compile=True)" else "")
    tolerance = compiled.get("tolerance")
    within = (f" within rtol {tolerance['rtol']:g} ({tolerance['why']})" if tolerance else "")
    if compiled.get("patch"):
        return STEP_PATCH_NOTES["applied"].format(changed=changed, patch=compiled["patch"],
                                                  what=what, within=within)
    return STEP_PATCH_NOTES["no_patch"].format(changed=changed, within=within,
                                               reason=compiled.get("patch_reason") or "?")


def compiled_share(steady_share: float, eager_ms: float, compiled_ms: float) -> float:
    """The share of a run that compiling its eager step saves: the run's steady step
    time (its share, the stalls' excess left out: `judge`'s `eager_step` cause) times
    the part of the step compiling removes, measured side by side on one batch
    (`1 - compiled / eager`). Both figures are the run's own clock's: the steady share
    from its cycles, the ratio from two timings under the same load.

    Args:
        steady_share: the steady step time's share of the run.
        eager_ms, compiled_ms: one call of the step each way (the same batch).
    """
    if not eager_ms or eager_ms <= 0:
        return 0.0
    return steady_share * max(0.0, 1.0 - compiled_ms / eager_ms)


def cost_share_prediction(share: float) -> str:
    """The predicted effect of fixing a cause known only by the share of the run it cost:
    the whole run's gain once the fix removes that time (`speedup_of`)."""
    speedup = speedup_of(share)
    return ((f"predicted: the whole run {speedup:.2f}x faster" if speedup
             else "predicted: unbounded")
            + f" once the fix removes this cause's time ({share:.0%} of the run, measured; a "
              "fix that removes part of it gains that part)")


def combined_speedup(speedups) -> "float | None":
    """The whole run's gain of several fixes of causes that never overlap: the time
    each saves (`1 - 1 / speedup`) adds up; None when unbounded."""
    return speedup_of(sum(1.0 - 1.0 / s for s in speedups))


def one_off_gain(speedup: "float | None", once_s: float, run_s: float) -> "float | None":
    """The gain over a run of `run_s` seconds of a fix that makes it `speedup` times
    faster after a one-off cost of `once_s` (a trace and compile); None when unbounded."""
    if speedup is None:
        return None
    return run_s / (run_s / speedup + once_s)


def speedup_of(share: float) -> "float | None":
    """The whole run's speedup when time of `share` goes: 1 / (1 - share); None when
    unbounded (share >= 1). Shares of different causes, never overlapping, add up."""
    return 1.0 / (1.0 - share) if share < 1.0 else None
