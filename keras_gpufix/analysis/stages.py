"""Which stage of a `tf.data` pipeline is the slow one, its fix and what the fix gains.

`keras-gpufix diagnose` drains bounded prefixes of the user's pipeline
(`diagnose/stages.py`): the source alone, the source and the first
transformation, and so on to the dataset given to `fit` (or iterated by the
loop). Each prefix's rate is converted to batches/s of the final dataset
(an element before a `batch(32)` is 1/32 of a batch). As in Plumber
(Kuchnik et al., MLSys 2022) and XProf's tf.data bottleneck analysis, a
stage's cost is what its addition costs the pipeline: the time per final
batch of its prefix minus that of the prefix before it (stages that run in
parallel with a slower one cost nothing by this measure, as they should).

The slow stage is the costliest, named when it holds at least
`THRESHOLDS["stage_share"]` of the pipeline's time per batch. Its fix
depends on its kind (`STAGE_FIXES`): Python work (`numpy_function`,
`py_function`, a generator) moves into TF ops or is cached, a TF `map`
run one element at a time gets `num_parallel_calls=AUTOTUNE`, a slow
source is cached. The predicted gain of the fix comes from the run's own
figures: the run's cycle less the time the fix saves per batch (the
stage's share of the input's time, applied to the input's part of the
cycle: what the what-if found the input costs, where it knows, else the
drained input's time), but never faster than the step alone (with the time
between steps) allows. `run_gain` turns that gain per step into the whole
run's, as the script runs it (its start-up and compiles kept; a cache's
first epoch unchanged).

| function        | what it answers                                         |
|-----------------|---------------------------------------------------------|
| `stages_needed` | measure the stages of this run? (input_bound, or the    |
|                 | what-if finds the input costing time)                   |
| `judge_stages`  | each stage's cost, the slow stage, its fix and gain     |
| `located_by_stage` | does the slow stage locate a verdict's fix?          |
|                 | (`input_bound`'s)                                       |
| `located_stage` | the first judgement whose slow stage's fix gains at     |
|                 | least `min_speedup`                                     |
"""

from keras_gpufix.analysis.verdicts import STAGE_FIXES, THRESHOLDS

__all__ = ["stages_needed", "judge_stages", "run_gain", "located_by_stage", "located_stage"]

#: Stage kinds whose fix is a cache: it serves from the second epoch.
CACHED_KINDS = ("cache", "source")



def stages_needed(verdict, what_if=None, input_wait=None) -> bool:
    """Whether a run's input pipeline is worth measuring stage by stage.

    Args:
        verdict: the run's monitor verdict (None when not judged).
        what_if: the run's what-if figures (`speedup_if_input_free`,
            `bound`), or None.
        input_wait: the run's input-wait share, or None (not measured).

    Returns:
        True when the run was judged `input_bound`, or the what-if (when
        it knows: `known` not False) finds the input the bound or the run
        faster with the input free, or the run waited `stage_wait_share` of
        its time for its input (a cause near its threshold: a run that
        reads it just below is located as one that reads it above, so both
        name the same line and gain).
    """
    what_if = what_if or {}
    if what_if.get("known") is False:  # the what-if says it does not know
        what_if = {}
    speedup = what_if.get("speedup_if_input_free") or 0.0
    return (verdict == "input_bound" or what_if.get("bound") == "input"
            or speedup >= THRESHOLDS["min_speedup"]
            or (input_wait or 0.0) >= THRESHOLDS["stage_wait_share"])


def _kind(stage, first):
    """`python`, `parallel`, `source` or `cache`: which fix the stage gets.

    A `map` or `interleave` runs one element at a time when given
    `num_parallel_calls=1`, or none: tf.data then parallelizes a stateless
    `map` by itself (`map_parallelization`, as it does `batch`:
    `parallel_batch`), not a stateful one nor an `interleave`.
    """
    if stage.get("python"):
        return "python"
    parallel, op = stage.get("parallel"), stage.get("op")
    if op in ("map", "interleave") and (parallel == 1 or parallel is None and not (
            op == "map" and stage.get("stateful") is False)):
        return "parallel"
    return "source" if first else "cache"


def run_gain(gain: float, kind: str, cycle_s: float, run=None) -> "float | None":
    """The whole run's gain of a stage's fix, as the script runs it.

    The run's fixed time (start-up, the trace and compiles: its wall less its
    steady cycles) stays; its steps run `gain` times faster, a cache's (the fix
    of a `cache` or `source` stage) from the second epoch only: 1.0 in a
    one-epoch script.

    Args:
        gain: the fix's gain per step (`predicted_gain`).
        kind: the stage's kind; any other (`on_disk`: a cache already filled
            by an earlier run) gains from the first step.
        cycle_s: the run's steady cycle, seconds.
        run: None, or a dict `steps` (the script's steps: its epochs times
            steps per epoch, else the steps the run timed), `steps_per_epoch`
            (None: not known), `steps_per_pass` (the steps of one pass over
            the stage's data where a `.repeat()` repeats it within an epoch:
            a cache after the stage, the repeat after the cache, serves from
            the second pass; None: an epoch's), `fixed_s` and `released_s`
            (seconds the input's epoch iterators took to release, outside
            the steps: the input's, kept only for the steps a cache has not
            yet served).

    Returns:
        The gain, or None for a cache whose epochs are not known.
    """
    run = run or {}
    steps, fixed = run.get("steps"), run.get("fixed_s")
    filled = [n for n in (run.get("steps_per_epoch"), run.get("steps_per_pass")) if n]
    cached = kind in CACHED_KINDS
    if cached and not (steps and filled):
        return None
    if not steps:
        return gain
    first = min(steps, *filled) if cached else 0
    released = run.get("released_s") or 0.0
    now = (fixed or 0.0) + released + steps * cycle_s
    return now / ((fixed or 0.0) + released * first / steps + first * cycle_s
                  + (steps - first) * cycle_s / gain)


def judge_stages(stages, step_per_s=None, observed_per_s=None, cpus=1, run=None,
                 input_free=None) -> dict:
    """Each stage's cost, the slow stage, its fix and the fix's predicted gain.

    Args:
        stages: the measured stages, source first, each a dict with `op`
            (`map`, `batch`, ... or the source's name), `where`
            (file:line of the script's call, or None), `function`
            (file:line of the stage's Python function, or None), `python`
            (the stage runs Python per element), `parallel`
            (`num_parallel_calls` as given: None, an int, or -1 for
            AUTOTUNE), `stateful` (a map's function holds a stateful op;
            None: not known) and `batches_per_s` (rate of the pipeline up to and
            including this stage, in batches/s of the final dataset; None
            when not measured), `pass_batches` (final batches in one pass
            over the stage's data where a `.repeat()` is made right before
            it; absent or None otherwise).
        step_per_s: batches/s the step alone consumes, with the run's time
            between steps (the step's demand). None when not measured.
        observed_per_s: batches/s the run went at. None when not measured.
        cpus: cores the input may use (what `num_parallel_calls` can gain).
        run: the script's run as `run_gain` takes it (its steps, steps per
            epoch, fixed time), or None.
        input_free: the what-if's speedup with the input free, where it knows
            (None: not measured): the input's part of the run's cycle is then
            what the what-if found it costs, else the drained input's time.

    Returns:
        A dict: `stages` (each input stage with `cost_ms` per final batch,
        `share` of the time per batch of the slowest prefix and `kind`), `input_per_s` (the whole
        pipeline's rate), `demand_per_s`, `observed_per_s`, and `slow`
        (None when no stage holds `stage_share` of the time; else the slow
        stage's dict with `fix`, `saved_ms`, `predicted_per_s` and
        `predicted_gain`, the run's steady speed after the fix over its
        speed now, `run_gain` (`run_gain`: the whole run's, as the script
        runs it; None when a cache's epochs are not known), `run_gain_cached`
        (Python work cached instead of moved into TF ops: from the second
        epoch; None for other kinds) and `text`, one sentence for people).
    """
    out = {"stages": [], "input_per_s": None, "demand_per_s": step_per_s,
           "observed_per_s": observed_per_s, "slow": None}
    before = longest = 0.0
    for index, stage in enumerate(stages):
        rate = stage.get("batches_per_s")
        item = dict(stage, kind=_kind(stage, index == 0), cost_ms=None, share=None)
        if rate:  # a prefix faster than a shorter one (fused, or noise) costs nothing,
            now = 1.0 / rate  # and the next stage's cost counts from the slowest so far
            item["cost_ms"] = 1000.0 * max(0.0, now - longest)
            before, longest = now, max(longest, now)
        out["stages"].append(item)
    measured = [s for s in out["stages"] if s["cost_ms"] is not None]
    if not measured or before <= 0:
        return out
    out["input_per_s"] = 1.0 / before
    for stage in measured:  # of the slowest prefix: a later stage may run faster (fused)
        stage["share"] = min(1.0, stage["cost_ms"] / (1000.0 * longest))
    slow = max(measured, key=lambda s: s["cost_ms"])
    if slow["share"] < THRESHOLDS["stage_share"]:
        return out
    kind = slow["kind"]
    # parallelism divides the stage's time by the cores but one, which stays
    # with the step (its dispatch on a GPU host, all of it on a CPU host: on
    # a 2-core VM, AUTOTUNE on a stateful map gave 0.60x-1.54x, three runs);
    # the other fixes (TF ops, a cache) take the stage off the per-batch path
    kept = 1.0 / max(1, cpus - 1) if kind == "parallel" else 0.0
    # the stage's share of the input's time, applied to the time the input
    # takes in the run's cycle (the drains alone run at another speed than
    # the run: a share carries over, an absolute time does not)
    cycle = 1.0 / observed_per_s if observed_per_s else before
    input_s = cycle * (1.0 - 1.0 / input_free) if input_free and input_free > 1 else min(
        cycle, before)
    saved = slow["share"] * (1.0 - kept) * input_s
    floor = 1.0 / step_per_s if step_per_s else 0.0
    predicted = max(floor, cycle - saved, 1e-9)
    gain = cycle / predicted
    where = slow.get("where") or slow.get("function") or "?"
    function = slow.get("function")
    fix = STAGE_FIXES[kind].format(op=slow.get("op"), where=where,
                                   function=STAGE_FIXES["function"].format(function=function)
                                   if function and function != where else "",
                                   parallel=slow.get("parallel"), cpus=cpus)
    demand = (f" against the step's demand of {step_per_s:.1f}" if step_per_s else "")
    rate = 1000.0 / slow["cost_ms"] if slow["cost_ms"] > 0 else float("inf")
    # a `.repeat()` right before the stage: a cache after it (the repeat moved after the
    # cache) serves from the second pass over the data, within the epoch
    per_pass = slow.get("pass_batches") if run else None
    if per_pass:
        run = dict(run, steps_per_pass=per_pass)
    whole = run_gain(gain, kind, cycle, run)
    # Python work's fix is either TF ops (from the first step) or a cache (from epoch 2)
    cached = run_gain(gain, "cache", cycle, run) if kind == "python" else None
    # a cache kept on disk serves every later run of the script from its first step
    later = (run_gain(gain, "on_disk", cycle, run)
             if kind in CACHED_KINDS + ("python",) and run else None)
    slow.update(fix=fix, saved_ms=1000.0 * saved, predicted_per_s=1.0 / predicted,
                predicted_gain=gain, rate_per_s=rate, run_gain=whole, run_gain_cached=cached,
                run_gain_later=later)
    slow["text"] = STAGE_FIXES["text"].format(
        op=slow.get("op"), where=where, rate=rate, share=slow["share"],
        input=out["input_per_s"], demand=demand, fix=fix, gain=gain)
    if kind in CACHED_KINDS:
        slow["text"] += (STAGE_FIXES["from_pass_2"].format(steps=per_pass) if per_pass
                         else STAGE_FIXES["from_epoch_2"])
    if whole is not None and run:
        slow["text"] += STAGE_FIXES["run"].format(steps=run["steps"], gain=whole,
                                                  fixed=run.get("fixed_s") or 0.0)
    if cached is not None:
        slow["text"] += STAGE_FIXES["cached_instead"].format(gain=cached)
    if later is not None:
        slow["text"] += STAGE_FIXES["later_runs"].format(gain=later)
    out["slow"] = slow
    return out


def on_disk_cache(whole, later) -> bool:
    """Whether an input fix's cache goes on disk (`.cache(filename)`): a cache in memory
    gains nothing in the script's own run (`whole`, the whole run's gain, under
    `THRESHOLDS["min_speedup"]`: one epoch, no second pass to serve) while one on disk
    gains in every later run (`later`)."""
    least = THRESHOLDS["min_speedup"]
    return bool(later and later >= least and whole is not None and whole < least)


def located_by_stage(verdict: str) -> bool:
    """Whether the slow stage of the input (`judge_stages`) locates `verdict`'s fix:
    `input_bound`'s."""
    return verdict == "input_bound"


def located_stage(judgements) -> "dict | None":
    """The first of `judge_stages`'s judgements (None: a run whose stages were not
    measured) with a slow stage whose fix gains at least `THRESHOLDS["min_speedup"]`
    (a stage whose fix gains nothing is no located fix), or None."""
    return next((j for j in judgements if j and j["slow"]
                 and j["slow"]["predicted_gain"] >= THRESHOLDS["min_speedup"]), None)
