"""The brain of the monitors: step records, the bounded step log, the one
slow-step rule, the cost-based detector and the one verdict table.

Pure NumPy: imports neither TensorFlow nor Keras, so it is testable anywhere
and reusable outside `model.fit`. The callbacks in `keras_gpufix.callbacks`,
`kg.watch` and `keras-gpufix diagnose` are adapters that feed it.

| module        | what it defines                                              |
|---------------|--------------------------------------------------------------|
| `step_log`    | `StepRecord` (one step's phases), `StepLog` (bounded log)    |
| `step_series` | `StepSeries`: every record of a run in at most 1024 points   |
|               | (the run record's timeline)                                  |
| `comparison`  | `compare_runs`, `format_comparison`: two run records, the    |
|               | steady gain and its range, one word (`MIN_GAIN`), each run's |
|               | load weighed (`load_of`, `loads_differ`); `paired_gain`:     |
|               | reruns alternated with the script as it is (`MAX_ROUNDS`)    |
| `verdicts`    | `VERDICTS`, `NOT_CAUSES`, `FIXES`, `THRESHOLDS`,             |
|               | `slow_limit`,                                                |
|               | `slow_mask`, `recompile_cost`, `step_compiled`,              |
|               | `is_recompiling`, `rank_causes`, `fix_for`, `contradicted`,  |
|               | `compiled_share`, `compiled_step_fix`, `patch_refusal`,      |
|               | `speedup_of`,                                                |
|               | `one_off_gain`, `where_place`,                               |
|               | `cost_share_prediction`, `combined_speedup`,                 |
|               | `not_run_verdict`, `recompiling_fix`                         |
| `dispatch`    | `fold_unsynced` (unsynced asynchronous steps, per period)    |
| `phases`      | `hook_span`, `split_cycle`: one hook's begin and ready times |
|               | -> its input wait, step and time between steps;              |
|               | `seconds_within` (compile seconds per hook)                  |
| `facts`       | `RunFacts`: what the adapters know about a run (jit, eager,  |
|               | synced, thresholds), handed to the detector as one object    |
| `detector`    | `judge` (no side effects), `OscillationDetector` (its        |
|               | `verdict()`: the run's one verdict), `weigh` (XProf and the  |
|               | what-if weighed into it; `what_if_input_cost`),              |
|               | `locate_periodic` (the line where                            |
|               | periodic work runs, from stack samples), `sampled_share`     |
| `job`         | `worker_summary`, `judge_job`: one report for a multi-worker |
|               | job (samples/s counted once, the straggler, its cause and    |
|               | what the others lose); `job_headline`                        |
| `stages`      | `judge_stages`: the slow stage of a tf.data pipeline, its    |
|               | fix and predicted gain (`run_gain`: a cache's, from epoch 2, |
|               | `CACHED_KINDS`); `stages_needed`; `located_by_stage`,        |
|               | `located_stage`: the fix the slow stage locates              |
| `what_if`     | the what-if's judgement: `Cycles` (a run's steady cycles),   |
|               | `what_if` (its figures), `what_if_until_known`,              |
|               | `ratio_words`, `format_what_if`, its budgets                 |
| `diagnosis`   | diagnose's other decisions: `trace_plan`, `trace_question`,  |
|               | `stall_period`, `stall_located`, `main_what_if`,             |
|               | `MONITOR_WARMUP`; its own                                    |
|               | bill: `own_cost`, `traced_extra_s`, `OWN_ITEMS`              |
| `traps`       | `TRAPS`: the one table of a script's traps and the verdict   |
|               | each would produce (`traps_of`); config traps' rules:        |
|               | `divisible_batch`, `missing_gpus`                            |
| `xprof`       | `classify_input_percent` (XProf's classification of a trace),|
|               | `reads_not_input_bound`                                      |
| `contention`  | `cpu_contention`, `contention_text`: what other processes    |
|               | took of the CPU over a run (`CONTENTION_SHARE`)              |
| `headline`    | `headline`: the three lines every view of a run opens with   |
|               | (verdict and share, one fix with its line and one gain, the  |
|               | `compare` command); `HEADLINE_FIXES`, `gain_words`           |
| `causes`      | diagnose's findings -> causes: `is_cause`, `is_judged`,      |
|               | `what_if_cause`, `cause_where`, `compiled_cause_share`,      |
|               | `run_clock`, `priced_by_compile`, `measured_fix`,            |
|               | `measured_lines`,                                            |
|               | `prediction_source`, `ruled_out`, `verdict_of_ranking`       |
"""

from keras_gpufix.analysis.causes import (cause_where, compiled_cause_share, is_cause,
                                          is_judged, measured_fix, measured_lines,
                                          priced_by_compile, prediction_source, ruled_out,
                                          run_clock,
                                          verdict_of_ranking, what_if_cause)
from keras_gpufix.analysis.contention import CONTENTION_SHARE, contention_text, cpu_contention
from keras_gpufix.analysis.detector import (OscillationDetector, judge, locate_periodic,
                                            sampled_share, weigh,
                                            what_if_input_cost)
from keras_gpufix.analysis.diagnosis import (MONITOR_WARMUP, OWN_COST_FLOOR_S, OWN_COST_SHARE,
                                             OWN_ITEMS, TRACE_SLOWDOWN, main_what_if, own_cost,
                                             sampled_stall, stall_located, stall_period,
                                             trace_cost_text,
                                             trace_plan,
                                             trace_question, traced_extra_s)
from keras_gpufix.analysis.facts import RunFacts
from keras_gpufix.analysis.headline import HEADLINE_FIXES, gain_words, headline
from keras_gpufix.analysis.job import job_headline, judge_job, worker_summary
from keras_gpufix.analysis.stages import (CACHED_KINDS, judge_stages, located_by_stage,
                                          located_stage, run_gain, stages_needed)
from keras_gpufix.analysis.step_log import StepLog, StepRecord, summarize_step_times
from keras_gpufix.analysis.traps import TRAPS, divisible_batch, missing_gpus, traps_of
from keras_gpufix.analysis.verdicts import (
    COMPILED_STEP_FIXES,
    PYTHON_INPUT_FIX,
    FIXES,
    NOT_CAUSES,
    PHASES,
    RETRACE_FIX,
    STAGE_FIXES,
    THRESHOLDS,
    TOO_FEW_STEPS,
    UNSYNCED_NOTE,
    VERDICTS,
    compiled_share,
    compiled_step_fix,
    patch_refusal,
    contradicted,
    fix_for,
    is_recompiling,
    not_run_verdict,
    rank_causes,
    recompile_cost,
    recompiling_fix,
    slow_limit,
    slow_mask,
    speedup_of,
    one_off_gain,
    cost_share_prediction,
    combined_speedup,
    step_compiled,
    where_place,
)
from keras_gpufix.analysis.what_if import (Cycles, format_what_if, ratio_words,
                                           what_if_until_known)
from keras_gpufix.analysis.xprof import classify_input_percent, reads_not_input_bound

__all__ = [
    "where_place",
    "CONTENTION_SHARE",
    "contention_text",
    "cpu_contention",
    "HEADLINE_FIXES",
    "gain_words",
    "headline",
    "verdict_of_ranking",
    "CACHED_KINDS",
    "run_gain",
    "COMPILED_STEP_FIXES",
    "PYTHON_INPUT_FIX",
    "FIXES",
    "OscillationDetector",
    "PHASES",
    "RETRACE_FIX",
    "RunFacts",
    "STAGE_FIXES",
    "StepLog",
    "StepRecord",
    "THRESHOLDS",
    "TOO_FEW_STEPS",
    "UNSYNCED_NOTE",
    "VERDICTS",
    "compiled_share",
    "compiled_step_fix",
    "patch_refusal",
    "contradicted",
    "fix_for",
    "is_recompiling",
    "judge",
    "job_headline",
    "judge_job",
    "judge_stages",
    "locate_periodic",
    "sampled_share",
    "not_run_verdict",
    "rank_causes",
    "recompile_cost",
    "slow_limit",
    "slow_mask",
    "speedup_of",
    "one_off_gain",
    "cost_share_prediction",
    "combined_speedup",
    "stages_needed",
    "step_compiled",
    "summarize_step_times",
    "weigh",
    "what_if_input_cost",
    "worker_summary",
    "Cycles",
    "MONITOR_WARMUP",
    "format_what_if",
    "main_what_if",
    "ratio_words",
    "stall_period",
    "sampled_stall",
    "stall_located",
    "trace_plan",
    "trace_question",
    "trace_cost_text",
    "traced_extra_s",
    "own_cost",
    "OWN_ITEMS",
    "OWN_COST_SHARE",
    "OWN_COST_FLOOR_S",
    "TRACE_SLOWDOWN",
    "what_if_until_known",
    "TRAPS",
    "traps_of",
    "divisible_batch",
    "missing_gpus",
    "classify_input_percent",
    "reads_not_input_bound",
    "NOT_CAUSES",
    "is_cause",
    "is_judged",
    "what_if_cause",
    "cause_where",
    "compiled_cause_share",
    "run_clock",
    "priced_by_compile",
    "measured_fix",
    "measured_lines",
    "prediction_source",
    "ruled_out",
    "located_by_stage",
    "located_stage",
    "recompiling_fix",
]
