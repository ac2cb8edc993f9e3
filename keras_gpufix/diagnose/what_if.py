"""What-if: how fast the input alone supplies batches vs how fast the step alone consumes them.

After a run (a `fit` or a custom loop) that timed steps, diagnose measures,
with nothing else running:

| figure                        | how                                            |
|-------------------------------|------------------------------------------------|
| `input_batches_per_s`         | a fresh iterator of the same `tf.data` dataset,|
|                               | drained for a bounded few seconds (the user's  |
|                               | own iterator is not touched; its first batch,  |
|                               | the pipeline's start-up, is not timed)         |
| `step_batches_per_s`          | the same step function (`model.train_function` |
|                               | for fit, its logs read back each call as fit   |
|                               | does; the observed train `tf.function` for a   |
|                               | loop) on one cached batch                      |
| `input_and_step_batches_per_s`| the same step on a fresh iterator of the real  |
|                               | input, in blocks beside the cached ones        |
|                               | (`replay_rates`); the weights, optimizer and   |
|                               | metric state are restored afterwards           |
| `observed_batches_per_s`      | the run's own steady-state cycles (batch start |
|                               | to batch start, the first cycles of each epoch |
|                               | left out)                                      |

Each cycle of the run holds the part a free input changes (getting the
batch and the step: for `fit`, the train function from the last callback's
begin hook to the first callback's end hook, which holds the batch fetch
and the read-back of the logs) and the part that stays (every callback
hook, the loop's own work between steps: `between_ms`). The what-if used to
take the whole cycle against the replayed step alone, so the hooks read as
input (1.17x-1.37x "with input free" on an input already cached, true
~1.0). Now each real block against the cached block beside it gives
`(real + between) / (cached + between)`: `speedup_if_input_free` is the
median of these pairs and `speedup_range` their extremes (the middle half
of the pairs once measured again: `what_if_until_known`). A step slower on
the real input than on the cached batch with no wait for it (the pipeline
computing beside the step on the same cores: contention) shows there too.
A range wider than `THRESHOLDS["what_if_uncertainty"]` of the prediction
either side (the host's load changed between blocks) makes it `known`
False: the what-if does not know, and `analysis.weigh` ignores it.

This module measures (its timers time the hypothetical: the input drained
alone, the step replayed alone, the eager step compiled); the figures,
the budgets and whether the what-if knows are `analysis.what_if`'s.

A loop step that was not called on its batches as they came (`step(x /
255)`) is replayed on its last batch only, against the run's own cycles
(`method` `replay`: the changed part of each cycle becomes the replayed
step; the range adds twice the standard error of the cycles). A step that
cannot be replayed (an eager `GradientTape` step has no function to call
again) is taken as measured in the run (`method` `in_run`): the speedup is
then the share of the cycle spent waiting for input, nothing more.
"""

import os
import statistics
import time

# The judgement (figures, budgets, when it knows) is analysis's; diagnose measures.
from keras_gpufix.analysis.what_if import (COMPILE_TIMINGS, MAX_BATCHES, ROUNDS, SECONDS,
                                           Cycles, block_timings, format_what_if, ratio_words,
                                           what_if, what_if_until_known)
from keras_gpufix.diagnose.step_blockers import own_wrappers, step_blockers
from keras_gpufix.diagnose.step_patch import (make_runnable, saved_state, write_patch,
                                              xla_refusal)

__all__ = ["Budget", "Cycles", "input_rate", "fit_replay", "replay_rates", "what_if",
           "what_if_until_known", "format_what_if", "ratio_words", "compile_step"]


class Budget:
    """The time budget of one run's what-if (`analysis.what_if_budget`), its clock
    started when it is made: the input drain, the replay and its retries, and the
    stages measured after share it.

    Args:
        seconds: the budget, stated in the report.

    Attributes:
        seconds: as given.
        cut: None, or why a measurement stopped short ("budget reached after N s").
    """

    def __init__(self, seconds):
        self.seconds = float(seconds)
        self.cut = None
        self._t0 = time.perf_counter()

    def spent(self):
        """Seconds since the what-if began."""
        return time.perf_counter() - self._t0

    def left(self):
        """Seconds left of the budget (0 once reached)."""
        return max(0.0, self.seconds - self.spent())

    def stop(self):
        """A measurement stops short for the budget: `cut` says so (the first time)."""
        if self.cut is None:
            self.cut = f"budget reached after {self.spent():.0f} s"


def input_rate(dataset, seconds=SECONDS, budget=None):
    """Batches/s a fresh iterator of `dataset` supplies alone (None: under two batches,
    or no budget left).

    The first batch (the pipeline's start-up: shuffle buffers, the first
    file) is not timed. The drain takes `seconds`, or what the start-up left
    of `budget` (a `Budget`) where that is less (one batch at least).
    """
    if budget is not None and budget.left() <= 0:
        budget.stop()
        return None
    iterator = iter(dataset)
    if next(iterator, None) is None:
        return None
    if budget is not None:
        seconds = min(seconds, budget.left())
    count, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    for _ in iterator:
        count += 1
        if count >= MAX_BATCHES or time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - t0
    return count / elapsed if count and elapsed > 0 else None


def fit_replay(model, dataset):
    """(cached, real, variables, batches per call) for `model.train_function`.

    `cached()` runs the step on the dataset's first batch, cached
    (`take(1).cache().repeat()`: the element spec the step was traced for),
    prefetched, so the step never waits for it: the input made free;
    `real()` returns a call that runs it on the next batch of a fresh
    iterator of the dataset itself (repeated). Each call reads its logs
    back as `fit` does before its callbacks' end hooks.
    """
    import keras
    import numpy as np

    strategy = model.distribute_strategy
    function = model.train_function
    variables = {id(v): v for v in (*model.variables, *model.optimizer.variables,
                                     *model.metrics_variables)}

    def on(batches):
        iterator = iter(strategy.experimental_distribute_dataset(batches))
        return lambda: keras.tree.map_structure(np.asarray, function(iterator))

    return (on(dataset.take(1).cache().repeat().prefetch(2)), lambda: on(dataset.repeat()),
            list(variables.values()), model.steps_per_execution)


def replay_rates(cached, variables, real=None, batches_per_call=1, seconds=SECONDS,
                 rounds=ROUNDS, budget=None):
    """Batches/s of the step run alone, on a cached batch and on the real input.

    Blocks of each kind are timed in the order cached, real, real, cached,
    cached, real, real, cached: each real block has a cached one beside
    it, so a change of the host's load shows as two pairs that disagree,
    not as a gain. Each block takes `seconds / 4` in `rounds` timings. Each
    two real blocks run on a fresh iterator (its first batch, the
    pipeline's start-up, not timed: two start-ups in all), released before
    the next cached block, so the input pipeline never runs beside a
    cached block. Without `real` every block is cached. The values of
    `variables` are restored after.

    Each block's first call (after the untimed one of a fresh call: a trace
    at the batch's shape, or the pipeline's start-up) sizes its timings
    (`analysis.block_timings`). With a `budget`, a block takes no more than
    its share of what is left (the blocks still to come share it), so a
    multi-second step gets fewer timings (its sizing call alone, where no
    more fits); a block whose calls no longer fit is not run, nor any
    after it (`budget.stop()`).

    Args:
        cached: runs the step on one cached batch.
        variables: every variable the step writes (weights, optimizer
            slots and iterations, metric totals).
        real: None, or a function that returns a new call running the
            step on the next batch of a fresh iterator of the real input.
        batches_per_call: steps one call runs (`steps_per_execution`).
        seconds: the timing budget of each kind (real, cached).
        rounds: timings per block (at least one call each).
        budget: None, or the run's what-if `Budget`. Defaults to None.

    Returns:
        A dict `cached` and `real` (None without `real`): per block, the
        batches/s of each of its timings (fewer blocks where the budget
        cut the replay short).
    """
    saved = [(v, v.numpy()) for v in variables]
    readable = next((v for v in variables if v.trainable), variables[0] if variables else None)
    order = ("cached", "real", "real", "cached", "cached", "real", "real", "cached")
    per_call = None  # seconds of the last call timed: what the next block's calls cost

    def sync():  # a read of a written variable waits for the queued steps
        if readable is not None:
            readable.numpy()

    def timed(call, calls=1):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        return (time.perf_counter() - t0) / calls

    def block(call, fresh, share):
        nonlocal per_call
        if budget is not None and per_call is not None and (
                budget.left() < (1 + fresh) * per_call):
            return None  # not even its first calls fit
        if fresh:
            timed(call)  # a trace at the batch's shape, or the pipeline's start-up
        per_call = timed(call)  # sizes the timings
        left = seconds / 4 if budget is None else min(seconds / 4, budget.left() / share)
        timings, calls = block_timings(per_call, left, rounds)
        if not timings:  # a slow step: the sizing call is the block's one timing
            return [batches_per_call / per_call]
        rates = []
        for _ in range(timings):
            per_call = timed(call, calls)
            rates.append(batches_per_call / per_call)
            calls = max(1, block_timings(per_call, left, timings)[1])
        return rates

    out = {"cached": [], "real": [] if real else None}
    try:
        step, warm = None, True
        for index, kind in enumerate(order):
            if budget is not None and budget.left() <= 0:
                rates = None
            elif kind == "cached" or real is None:
                step = None  # the real iterator is released before a cached block
                rates = block(cached, warm, len(order) - index)
                warm = False
            else:
                fresh = step is None
                step = real() if fresh else step
                rates = block(step, fresh, len(order) - index)
            if rates is None:
                budget.stop()
                break
            out["real" if kind == "real" and real is not None else "cached"].append(rates)
        step = None
    finally:
        for variable, value in saved:
            variable.assign(value)
    return out


def _per_call_ms(call, sync, seconds):
    """(median ms of `call()`, seconds of its first call): the first (a trace and
    compile) apart, then at least `COMPILE_TIMINGS[0]` timings, as many more as fit in
    `seconds` (at most `COMPILE_TIMINGS[1]`)."""
    least, most = COMPILE_TIMINGS
    t0 = time.perf_counter()
    sync(call())
    first = time.perf_counter() - t0
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < least or (time.perf_counter() < deadline and len(times) < most):
        t0 = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), first


def _as_written(fn, args, kwargs, library, made):
    """`make_runnable`'s result for a step that traced as written but that diagnose
    could not copy (a lambda) or change (Python state set from the step's values): `fn`
    itself in tf.function, timed as before, with no patch (`no_patch` says why)."""
    import tensorflow as tf

    plain, xla = tf.function(fn), tf.function(fn, jit_compile=True)
    graph = plain.get_concrete_function(*args, **kwargs).graph  # traced: its first call runs
    out = {**made, "runs": True, "same": True, "function": plain, "xla_function": None,
           "no_patch": "{where}: {message}".format(**made["blocker"]), "first_call_s": None}
    saved = saved_state(args, kwargs, fn)
    try:
        xla(*args, **kwargs)
        out.update(xla_function=xla, xla_error=None, xla_op=None, xla_where=None)
    except Exception as exc:  # an op XLA cannot compile
        out.update(xla_refusal(exc, graph, library))
    finally:
        saved.restore()
    return out


def compile_step(fn, args, kwargs=None, library=(), seconds=SECONDS / 3, log_dir=None,
                 cwd=None):
    """The user's eager step made to run under tf.function, checked, and timed.

    `fn(*args, **kwargs)` (the function that computed the eager gradient,
    on the arguments of its last call) is first made to run under
    `tf.function` (`step_patch.make_runnable`: a patched copy, traced until
    it runs, checked to give the eager step's returns and variables); the
    copy is then timed eagerly (`fn` as written), as `tf.function` and as
    `tf.function(jit_compile=True)`, each on the same batch, each first call
    (trace and compile) untimed. Every variable the step writes (model,
    optimizer, accumulators) and its arguments' Python state are restored
    after. An op XLA cannot compile (`tf.print` in the loss: `StringFormat`)
    is named with the user's line that made it.

    Args:
        fn: the step's Python function.
        args, kwargs: its arguments.
        library: path prefixes of library code (the line named is the
            user's last frame outside them).
        seconds: the timing budget of each of the three ways.
        log_dir: where the patch is written (`step.patch`); None: not written.
        cwd: the folder the patch applies from (`patch -p1`); the current one by default.

    Returns:
        A dict `function` (`name (file:line)`), `own_wrappers` (`own_wrappers`: where
        the script wraps the function in tf.function itself), `blockers`
        (`step_blockers`: what stops tf.function running it as written), `changes`
        (each change the copy made: `kind`, `where`, `code`, `change`), `traces`;
        where the copy ran and computed the same result: `eager_ms`, `gradient_ms`
        (the median of its eager gradients' times while `eager_ms` was timed),
        `function_ms`,
        `xla_ms` (None when XLA failed), `xla_error` (its first line), `xla_op`,
        `xla_where` (`file:line`), `best` (`tf.function` or
        `tf.function(jit_compile=True)`, the faster that compiled), `best_ms`,
        `first_call_s` (the best way's trace and compile, a one-off cost), `patch`
        (the diff's path, or None) and `patch_reason` (why none); else `reason`, with
        `stopped` (`where`, `code`, `message`: the line the copy could not change, and
        `unchecked`) or `differs` (how the copy's result differs from the eager one's).
    """
    import numpy as np
    import tensorflow as tf

    kwargs = kwargs or {}
    code = fn.__code__
    out = {"function": f"{fn.__name__} ({code.co_filename}:{code.co_firstlineno})",
           "own_wrappers": own_wrappers(fn)}
    if not library:
        from keras_gpufix.diagnose.loop_patch import _library_prefixes

        library = _library_prefixes()
    library = tuple(library)
    t0 = time.perf_counter()
    try:
        tf.function(fn).get_concrete_function(*args, **kwargs)
        out["blockers"] = step_blockers(fn, library=library)  # Python state: traced, yet wrong
    except Exception as exc:
        out["blockers"] = step_blockers(fn, exc, library)
        out["reason"] = (f"tf.function could not trace it: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}")
    traced = time.perf_counter() - t0
    made = make_runnable(fn, args, kwargs, library=library,
                         static=[b for b in out["blockers"]
                                 if b["kind"] in ("python_state", "host_read")])
    out["changes"], out["traces"] = made["changes"], made["traces"]
    if not made["runs"] and "reason" not in out:  # traced as written, no running copy
        made = _as_written(fn, args, kwargs, library, made)
    if not made["runs"]:
        return {**out, "reason": out.get("reason") or "tf.function could not run it",
                "stopped": {**made["blocker"], "unchecked": made["unchecked"]}}
    if not made["same"]:
        return {**out, "reason": f"the changed step computes a different result: "
                                 f"{made['differs']}", "differs": made["differs"]}
    out.pop("reason", None)
    out["tolerance"] = made.get("tolerance")  # what "the same result" was judged within
    plain, xla = made["function"], made["xla_function"]
    for key in ("xla_error", "xla_op", "xla_where"):
        out[key] = made[key]
    saved = saved_state(args, kwargs, fn)
    first = {}  # each way's first call: trace and compile, once

    def sync(result):
        tf.nest.map_structure(lambda t: np.asarray(t) if tf.is_tensor(t) else t, result)

    gradient = tf.GradientTape.__dict__["gradient"]
    gradient_s = []  # the eager step's gradients, timed as diagnose's run timed them

    def timed_gradient(tape, *a, **k):
        start = time.perf_counter()
        result = gradient(tape, *a, **k)
        gradient_s.append(time.perf_counter() - start)
        return result

    try:
        tf.GradientTape.gradient = timed_gradient
        try:
            out["eager_ms"], _ = _per_call_ms(lambda: fn(*args, **kwargs), sync, seconds)
        finally:
            tf.GradientTape.gradient = gradient
        out["gradient_ms"] = 1000 * statistics.median(gradient_s) if gradient_s else None
        out["function_ms"], first["tf.function"] = _per_call_ms(
            lambda: plain(*args, **kwargs), sync, seconds)
        out["xla_ms"] = None
        if xla is not None:
            out["xla_ms"], first["tf.function(jit_compile=True)"] = _per_call_ms(
                lambda: xla(*args, **kwargs), sync, seconds)
    finally:
        saved.restore()
    best = min((ms, name) for ms, name in ((out["function_ms"], "tf.function"),
                                           (out["xla_ms"], "tf.function(jit_compile=True)"))
               if ms is not None)
    out["best_ms"], out["best"] = best
    out["first_call_s"] = (made["first_call_s"].get(out["best"], first[out["best"]])
                           if made.get("first_call_s") else first[out["best"]] + traced)
    if made.get("no_patch"):  # no copy of the step: as written, in tf.function
        return {**out, "changes": None, "patch": None, "patch_reason": made["no_patch"]}
    out["patch"], out["patch_reason"] = None, None
    if log_dir is None:
        out["patch_reason"] = "no log dir"
    else:
        out["patch"] = write_patch(made["step"], log_dir,
                                   jit=out["best"] == "tf.function(jit_compile=True)", cwd=cwd)
        if out["patch"] is None:
            out["patch_reason"] = (f"{made['step'].path} is not under the folder diagnose ran in "
                                   f"({os.path.abspath(cwd or os.getcwd())})")
    return out
