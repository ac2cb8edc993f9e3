"""How diagnose weighs a run's findings into causes: which verdicts are causes, which of
its measurements locate, price and predict each, which static findings it rules out.

`diagnose/report.py` gathers the runs' figures and words the report; every
decision about a verdict in it is one of these pure functions:

| function               | what it answers                                        |
|------------------------|--------------------------------------------------------|
| `is_cause`             | is a verdict a cause (not `healthy`, not `unknown`)?   |
| `is_judged`            | did a monitor's verdict judge steps (not `unknown`)?   |
| `what_if_cause`        | does the what-if's input cost make `input_bound` a     |
|                        | cause beside another verdict, and in which phase?      |
| `cause_where`          | where a cause was seen (the eager gradient, the        |
|                        | loop-body line of a periodic stall, the script's line) |
| `compiled_cause_share` | the share compiling the eager step saves, measured     |
| `run_clock`            | the run's clock over the step's timing alone after it  |
| `priced_by_compile`    | causes with `eager_step` priced by that measurement    |
| `measured_fix`         | a cause's fix, from diagnose's own measurement of it   |
| `measured_lines`       | the lines diagnose measured a cause at                 |
| `prediction_source`    | which measurement predicts a ranked cause's effect     |
| `ruled_out`            | the verdicts a judgement had the evidence for and did  |
|                        | not give (their static findings are not fixes)         |
| `verdict_of_ranking`   | the verdict that fits the ranked fixes (a cause that   |
|                        | costs what its verdict needs beside `healthy` takes its |
|                        | place)                                                 |
"""

from keras_gpufix.analysis.traps import traps_of
from keras_gpufix.analysis.verdicts import (NOT_CAUSES, STEP_CHANGE, THRESHOLDS, blocker_line,
                                           compiled_share, compiled_step_fix)

__all__ = ["is_cause", "is_judged", "what_if_cause", "cause_where",
           "compiled_cause_share", "run_clock", "priced_by_compile", "measured_fix",
           "measured_lines", "prediction_source", "verdict_of_ranking", "ruled_out"]

#: Where an eager step comes from when neither its measured gradient nor a scanned line says.
_EAGER_DEFAULT_WHERE = "the model's compile (run_eagerly=True)"


def is_cause(verdict: "str | None") -> bool:
    """Whether `verdict` names a cause (a verdict other than `NOT_CAUSES`)."""
    return verdict not in NOT_CAUSES


def is_judged(verdict: "str | None") -> bool:
    """Whether a monitor's `verdict` judged steps: given, and not `unknown`."""
    return verdict not in (None, "unknown")


def what_if_cause(cost, input_wait: "float | None",
                  verdict: "str | None") -> "tuple | None":
    """`input_bound` as a cause beside the run's other verdict, from the what-if.

    Args:
        cost: `what_if_input_cost`'s `(share, least, known)`, or None.
        input_wait: the run's measured input-wait share (None: not measured).
        verdict: the run's verdict (`weigh`ed).

    Returns:
        `("input_bound", share, phase)` when the what-if finds the input costing at least
        `THRESHOLDS["what_if_share"]` of a run whose verdict is not already
        `input_bound`: phase `step` (contention) where the input wait explains
        that much less of it, else `input_wait`. None otherwise.
    """
    share = THRESHOLDS["what_if_share"]
    if cost is None or verdict == "input_bound" or not cost[0] >= share:
        return None
    contention = input_wait is not None and cost[1] - input_wait >= share
    return "input_bound", cost[0], "step" if contention else "input_wait"


def cause_where(verdict: str, step: dict, findings=()) -> "str | None":
    """Where a cause was seen: an `eager_step`'s measured eager gradient (`eager_where`),
    else the first scan finding of its trap on a line that ran, else the model's
    compile; a `periodic_stall`'s (or `irregular_stall`'s) loop-body line its slow
    cycles were sampled at (`stall_where`); None for the others.

    Args:
        verdict: the cause.
        step: the run's step facts (`eager_where`, `stall_where`).
        findings: the static scan's findings (`trap`, `file`, `line`, `ran`).
    """
    if verdict in ("periodic_stall", "irregular_stall"):
        return step.get("stall_where")
    if verdict != "eager_step":
        return None
    traps = traps_of(verdict)
    return step.get("eager_where") or next(
        (f"{f['file']}:{f['line']}" for f in findings
         if f["trap"] in traps and f.get("ran") is not False), _EAGER_DEFAULT_WHERE)


def compiled_cause_share(causes, compiled: dict, cycle_ms: "float | None" = None
                         ) -> "float | None":
    """The share of a run that compiling its eager step saves, measured, or None.

    Where the step function's calls per cycle are known (`calls_per_step`), the
    saving is what its calls save in time (`eager_ms - best_ms` each) over the
    run's mean cycle: the step's phase also holds the loop's other eager work (an
    optimizer's apply every k steps), which compiling the function leaves as it is
    (accum_plot: 0.34 of the run predicted from the steady share against 0.18-0.30
    measured; 0.21 this way). It is at most the run less the other causes' shares
    (a stall's time is its own fix's) and less the compiled calls' own time (what
    the cycle still holds after the change), not the steady step share: an eager
    step's time above its median (Python and dispatch that vary from call to call)
    is time compiling removes too (xtts at load 8: saved 0.98 of the cycle, steady
    share 0.54, plot 0.31; the steady cap predicted 2.2-2.5x, this one 3.2x,
    against 2.8-5.7x measured with diagnose's own patch).

    The per-call times are taken alone after the run, on its last batch; the run's
    own clock differs (tf.data's threads and the loop's other work share the cores;
    back-to-back calls are warm): both are put on the run's clock by the ratio of
    the step's gradients' median time in the run (`run_gradient_ms`) to their median
    while `eager_ms` was timed (`gradient_ms`), the same ops timed both ways (xtts at
    load 3: 65-72 ms median cycles in the run against a 30-49 ms eager call alone).

    Args:
        causes: the judgement's causes (`verdict`, `share`).
        compiled: diagnose's compile of the user's step on a real batch
            (`eager_ms`, `best_ms`, optional `calls_per_step`, `gradient_ms`,
            `run_gradient_ms`), or None.
        cycle_ms: the run's mean cycle (its step log's `mean_ms`).
    """
    compiled = compiled or {}
    causes = list(causes or ())
    steady = next((c["share"] for c in causes if c["verdict"] == "eager_step"), None)
    if compiled.get("best_ms") is None or steady is None:
        return None
    share = compiled_share(steady, compiled["eager_ms"], compiled["best_ms"])
    calls = compiled.get("calls_per_step")
    if calls and cycle_ms:
        calls *= run_clock(compiled)
        saved = max(0.0, compiled["eager_ms"] - compiled["best_ms"]) * calls / cycle_ms
        others = sum(c["share"] or 0.0 for c in causes if c["verdict"] != "eager_step")
        left = others + compiled["best_ms"] * calls / cycle_ms
        share = min(max(0.0, 1.0 - left), saved)
    return share


def run_clock(compiled: dict) -> float:
    """How much slower the run's clock ran than the step's timing alone after it: its
    gradients' median time in the run over their median alone (1 where either is
    unknown)."""
    alone, in_run = compiled.get("gradient_ms"), compiled.get("run_gradient_ms")
    return in_run / alone if alone and in_run else 1.0


def priced_by_compile(causes: list, measured: "float | None") -> list:
    """`(verdict, share, evidence)` causes with every `eager_step` priced at `measured`
    (`compiled_cause_share`: the eager step's excess over the compiled one, not
    the bound); unchanged when it was not measured."""
    if measured is None:
        return causes
    return [(v, measured if v == "eager_step" else share, e) for v, share, e in causes]


def measured_fix(verdict: str, fix: str, compiled_steps) -> str:
    """A ranked cause's fix: for `eager_step`, the first measured compile of the user's
    step (`compiled_step_fix`); else (or without one) `fix`."""
    if verdict != "eager_step":
        return fix
    return next((compiled_step_fix(c) for c in compiled_steps if compiled_step_fix(c)), fix)


def measured_lines(verdict: str, steps, compiled_steps) -> list:
    """The lines diagnose measured a cause at: for `eager_step`, each run's measured
    eager gradient and each compile of the step that could not be done (why); for
    `periodic_stall` and `irregular_stall`, the loop-body line each run's slow cycles
    were sampled at (`stall_where`); nothing for the others.

    Args:
        verdict: the cause.
        steps: each run's step facts (`eager_where`, `stall_where`).
        compiled_steps: each run's compile of its step (`function`, `reason`).
    """
    if verdict in ("periodic_stall", "irregular_stall"):
        return list(dict.fromkeys(f"{s['stall_where']}: where the slow cycles ran (sampled)"
                                  for s in steps if s.get("stall_where")))
    if verdict != "eager_step":
        return []
    lines = [f"{s['eager_where']}: the step's gradient, measured eager"
             for s in steps if s.get("eager_where")]
    for c in compiled_steps:
        if c.get("best_ms") is not None and c.get("changes") is not None:
            lines += [STEP_CHANGE.format(**change) for change in c["changes"]]
            continue
        lines += [blocker_line(b) for b in c.get("blockers") or ()]
        if c.get("reason") and not c.get("blockers"):
            lines.append(f"{c.get('function', 'the step')}: diagnose could not compile it to "
                         f"check the fix ({c['reason']})")
    return lines


def prediction_source(verdict: str, what_if: dict, compiled: "dict | None") -> str:
    """Which measurement predicts a ranked cause's effect: `what-if` for `input_bound`
    where the what-if found a speedup and knows it, `compiled-step` for
    `eager_step` where the user's step was compiled and timed (`not-measured`
    where diagnose tried and could not compile it as written), else
    `cost_share` (the share the cause cost: the most its fix can save)."""
    if verdict == "input_bound" and what_if.get("speedup_if_input_free") \
            and what_if.get("known", True):
        return "what-if"
    if verdict == "eager_step" and compiled:
        return "compiled-step" if compiled.get("best_ms") is not None else "not-measured"
    return "cost_share"


def verdict_of_ranking(verdict: str, ranking: list) -> str:
    """The run's one verdict, fitting its own fixes: a judged run (`healthy`) whose
    ranking holds a measured cause costing at least what the judgement itself needs
    to give that verdict (`input_bound`: `THRESHOLDS["input_wait_share"]`; others
    `THRESHOLDS["cost_share"]`) takes that cause (the what-if's input cost of 22%
    beside a healthy step log); a judged cause whose measured cost falls below that
    (an eager step priced by its compiled twin at 1%) gives way to a larger cause
    that reaches it (a plot every 5 steps only the stack samples found, 13%);
    otherwise `verdict` as judged."""
    if verdict == "unknown":
        return verdict
    least = {"input_bound": THRESHOLDS["input_wait_share"]}
    top = next((c for c in ranking
                if c["score"] >= least.get(c["verdict"], THRESHOLDS["cost_share"])), None)
    if is_cause(verdict):
        own = next((c["score"] for c in ranking if c["verdict"] == verdict), None)
        below = own is not None and own < least.get(verdict, THRESHOLDS["cost_share"])
        return top["verdict"] if below and top and top["score"] > own else verdict
    return top["verdict"] if top else verdict


def ruled_out(verdict: str, *, judged: bool, input_wait_measured: bool,
              compiles_counted: bool) -> set:
    """Verdicts the run's judgement had the evidence for and did not give.

    Their static findings are not ranked as fixes: `input_bound` when the
    input wait was measured, `eager_step` and `recompiling` (traces or
    shapes counted) when steps were judged. A cause it cannot see
    (`dispatch_bound` without GPU utilisation) keeps its findings.

    Args:
        verdict: the run's verdict.
        judged: some run's steps were judged.
        input_wait_measured: every judged run measured its input wait.
        compiles_counted: some judged run counted traces or new shapes.
    """
    if not judged:
        return set()
    out = {"eager_step"} - {verdict}
    if input_wait_measured:
        out |= {"input_bound"} - {verdict}
    if compiles_counted:
        out |= {"recompiling"} - {verdict}
    return out
