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
median of these pairs and `speedup_range` their extremes. A step slower on
the real input than on the cached batch with no wait for it (the pipeline
computing beside the step on the same cores: contention) shows there too.
A range wider than `THRESHOLDS["what_if_uncertainty"]` of the prediction
either side (the host's load changed between blocks) makes it `known`
False: the what-if does not know, and `analysis.weigh` ignores it.

A loop step that was not called on its batches as they came (`step(x /
255)`) is replayed on its last batch only, against the run's own cycles
(`method` `replay`: the changed part of each cycle becomes the replayed
step; the range adds twice the standard error of the cycles). A step that
cannot be replayed (an eager `GradientTape` step has no function to call
again) is taken as measured in the run (`method` `in_run`): the speedup is
then the share of the cycle spent waiting for input, nothing more.
"""

import statistics
import time

from keras_gpufix.analysis import THRESHOLDS

__all__ = ["Cycles", "input_rate", "fit_replay", "replay_rates", "what_if",
           "format_what_if"]

SECONDS = 1.5  # budget of each of the two measurements
ROUNDS = 4  # timings per block of the replay (`replay_rates`)
MAX_BATCHES = 2000  # the input drain never reads more than this


class Cycles:
    """Steady-state cycles of one run, in seconds.

    Args:
        skip: cycles left out at the start of each epoch (iterator
            start-up, the first call's trace and compile). Defaults to 2.
    """

    def __init__(self, skip=2):
        self.skip = skip
        self.cycle_s = []
        self.input_s = []
        self.step_s = []
        self._left = skip

    def epoch(self):
        """A new epoch begins: its first `skip` cycles are left out."""
        self._left = self.skip

    @classmethod
    def of(cls, records, skip=2):
        """The steady cycles of a run's step records (the step stream's clock).

        `fit`'s records, as `StepTimer.records()` gives them: each record's
        cycle, its measured input wait (0 when not measured: then it lies
        in the step, where `fit` fetches the batch) and its step.
        """
        cycles = cls(skip)
        for record in records:
            if record.epoch_first:
                cycles.epoch()
            cycles.add(record.cycle, record.input_wait or 0.0, record.step)
        return cycles

    def add(self, cycle_s, input_s, step_s):
        """One cycle: batch start to next batch start, its time getting the batch, its step.

        `fit` gets its batch inside the train function: a wait the input
        probe did not measure is in `step_s`.
        """
        if self._left:
            self._left -= 1
            return
        self.cycle_s.append(cycle_s)
        self.input_s.append(input_s)
        self.step_s.append(step_s)


def input_rate(dataset, seconds=SECONDS):
    """Batches/s a fresh iterator of `dataset` supplies alone (None: under two batches).

    The first batch (the pipeline's start-up: shuffle buffers, the first
    file) is not timed.
    """
    iterator = iter(dataset)
    if next(iterator, None) is None:
        return None
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
                 rounds=ROUNDS):
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

    Args:
        cached: runs the step on one cached batch.
        variables: every variable the step writes (weights, optimizer
            slots and iterations, metric totals).
        real: None, or a function that returns a new call running the
            step on the next batch of a fresh iterator of the real input.
        batches_per_call: steps one call runs (`steps_per_execution`).
        seconds: the timing budget of each kind (real, cached).
        rounds: timings per block (at least one call each).

    Returns:
        A dict `cached` and `real` (None without `real`): per block, the
        batches/s of each of its timings.
    """
    saved = [(v, v.numpy()) for v in variables]
    readable = next((v for v in variables if v.trainable), variables[0] if variables else None)

    def sync():  # a read of a written variable waits for the queued steps
        if readable is not None:
            readable.numpy()

    def block(call, warm=True):
        if warm:
            call()  # a trace at the batch's shape, or the pipeline's start-up, is not timed
            sync()
        t0 = time.perf_counter()
        call()  # sizes the timings
        sync()
        per_call, rates = time.perf_counter() - t0, []
        for _ in range(rounds):
            calls = max(1, min(MAX_BATCHES // rounds,
                               int(seconds / 4 / rounds / max(per_call, 1e-6))))
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            sync()
            elapsed = time.perf_counter() - t0
            per_call = elapsed / calls
            rates.append(calls * batches_per_call / elapsed)
        return rates

    out = {"cached": [], "real": [] if real else None}
    try:
        step = None
        for kind in ("cached", "real", "real", "cached", "cached", "real", "real", "cached"):
            if kind == "cached" or real is None:
                step = None  # the real iterator is released before a cached block
                out["cached"].append(block(cached))
            else:
                fresh = step is None
                step = real() if fresh else step
                out["real"].append(block(step, warm=fresh))
        step = None
    finally:
        for variable, value in saved:
            variable.assign(value)
    return out


def what_if(cycles, input_per_s, rates, batches_per_cycle=1):
    """The what-if figures of one run, or None when it had no steady cycles.

    Args:
        cycles: the run's `Cycles`.
        input_per_s: batches/s the input supplies alone (None: not measured).
        rates: `replay_rates`'s dict; None when the step could not be
            replayed: then the step stays as measured in the run and only
            its wait for input goes (`method` "in_run").
        batches_per_cycle: batches one cycle runs (`steps_per_execution`).

    Returns:
        A dict `input_batches_per_s`, `step_batches_per_s` (the step alone
        on a cached batch), `input_and_step_batches_per_s` (the step alone
        on the real input; None when not timed), `observed_batches_per_s`,
        `between_ms` (mean time of a cycle outside its input and step:
        every hook, the loop's own work), `step_in_run_ms` (mean time in
        the step in the run, with `fit`'s batch fetch),
        `speedup_if_input_free`, `speedup_range` (`[low, high]`, high None
        when unbounded), `known` (the range lies within
        `what_if_uncertainty` of the speedup), `bound` (`input` or `step`),
        `method` (`side_by_side`: the step timed on the real and on the
        cached input, block beside block; `replay`: the cached step against
        the run's own cycles; `in_run`), `cycles` (how many were timed).
    """
    if not cycles.cycle_s:
        return None
    n = len(cycles.cycle_s)
    cycle = statistics.fmean(cycles.cycle_s)
    in_run = [i + s for i, s in zip(cycles.input_s, cycles.step_s)]
    rest = cycle - statistics.fmean(in_run)  # hooks and the loop's work: they stay

    def per_batch(blocks):  # seconds per batch of each block (its median timing)
        return [batches_per_cycle / statistics.median(b) for b in blocks]

    real_rate = None
    if rates and rates.get("real"):  # each real block against the cached block beside it
        method = "side_by_side"
        real, free = per_batch(rates["real"]), per_batch(rates["cached"])
        pairs = sorted((r + rest) / (f + rest) for r, f in zip(real, free))
        z, low, high = statistics.median(pairs), pairs[0], pairs[-1]
        real_rate = statistics.median([r for b in rates["real"] for r in b])
        rate = statistics.median([r for b in rates["cached"] for r in b])
    else:
        if rates:  # the cached step against the run's own cycles
            method, changed = "replay", in_run
            free = per_batch(rates["cached"])
            replay, spread = statistics.median(free), (max(free) - min(free)) / 2
            rate = statistics.median([r for b in rates["cached"] for r in b])
        else:  # the step stays as it ran: only the wait for input goes
            method, changed, replay, spread = "in_run", list(cycles.input_s), 0.0, 0.0
            outside = cycle - statistics.fmean(changed)
            rate = batches_per_cycle / outside if outside > 0 else None
        saving = statistics.fmean(changed) - replay
        error = spread + (2 * statistics.stdev(changed) / n ** 0.5 if n > 1 else float("inf"))

        def speedup(gain):
            return cycle / (cycle - gain) if gain < cycle else None

        z, low, high = speedup(saving), speedup(saving - error), speedup(saving + error)
    limit = THRESHOLDS["what_if_uncertainty"]
    known = bool(z and low and high and low >= z * (1 - limit) and high <= z * (1 + limit))
    bound = None
    if input_per_s and rate and z:
        bound = "input" if input_per_s < batches_per_cycle * z / cycle else "step"
    return {"input_batches_per_s": input_per_s, "step_batches_per_s": rate,
            "input_and_step_batches_per_s": real_rate,
            "observed_batches_per_s": batches_per_cycle / cycle, "between_ms": 1000 * rest,
            "step_in_run_ms": 1000 * statistics.fmean(cycles.step_s),
            "speedup_if_input_free": z, "speedup_range": [low, high], "known": known,
            "bound": bound, "method": method, "cycles": n}


def format_what_if(result):
    """The what-if as one sentence for people."""
    x, y = result.get("input_batches_per_s"), result.get("step_batches_per_s")
    z = result.get("speedup_if_input_free")
    if not x or not y or z is None:
        return (f"what-if: not measured ({result.get('reason', 'no steady cycles')}); "
                f"the run went at {result.get('observed_batches_per_s') or 0:.1f} batches/s")
    low, high = result.get("speedup_range") or (None, None)
    span = (f"{low:.2f}x-{high:.2f}x" if low and high
            else f"at least {low:.2f}x" if low else "unbounded")
    known = result.get("known", True)
    faster = known and z >= THRESHOLDS["min_speedup"]
    if not known:
        gain = f"{z:.2f}x faster, but the what-if does not know ({span}: its timings varied)"
    elif faster:
        gain = f"{z:.2f}x faster ({span})"
    else:
        gain = f"no faster ({z:.2f}x, {span})"
    replayed = result.get("method") in ("replay", "side_by_side")
    how = "" if replayed else " (step as measured in the run)"
    if result["bound"] == "input":
        return (f"what-if: input supplies {x:.1f} batches/s, the step consumes {y:.1f} "
                f"batches/s{how}: with input free the run would be {gain} "
                f"(it ran at {result['observed_batches_per_s']:.1f} batches/s)")
    return (f"what-if: the step consumes {y:.1f} batches/s{how}, input supplies {x:.1f} "
            f"batches/s: the step is the bound (the input could feed a step {x / y:.1f}x "
            f"faster); with input free the run would be {gain}"
            + (" (the input competes with the step for the host)"
               if faster and replayed else "")
            + f" (it ran at {result['observed_batches_per_s']:.1f} batches/s)")
