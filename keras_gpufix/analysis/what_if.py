"""The what-if's judgement: its budgets, its figures and when it knows.

Pure arithmetic over what `keras-gpufix diagnose` measured
(`diagnose/what_if.py`: the input drained alone, the step replayed on a
cached batch and on the real input, block beside block) and the run's own
steady cycles, read from the step stream's records (`Cycles.of`). Here are
decided: how much each measurement may take (`SECONDS`, `ROUNDS`,
`MAX_BATCHES`, `COMPILE_TIMINGS`), how many times a what-if that does not know is measured
again (`TRIES`) and how many block pairs make one measurement (`PAIRS`);
the time budget of one run's whole what-if (`what_if_budget`: `BUDGET_S`
or `BUDGET_SHARE` of the run, whichever is larger) and how a replay block
shrinks to fit it (`block_timings`);
the speedup with the input free and its range, whether the range is
narrow enough to know (`THRESHOLDS["what_if_uncertainty"]`), which side
bounds the run, and when a ratio is "faster" (`THRESHOLDS["min_speedup"]`).
Imports neither TensorFlow nor Keras.
"""

import statistics

from keras_gpufix.analysis.verdicts import THRESHOLDS

__all__ = ["SECONDS", "ROUNDS", "MAX_BATCHES", "TRIES", "PAIRS", "COMPILE_TIMINGS",
           "BUDGET_S", "BUDGET_SHARE", "Cycles", "what_if_budget", "block_timings", "what_if",
           "what_if_until_known", "ratio_words", "format_what_if"]

SECONDS = 1.5  # budget of each of the two measurements
ROUNDS = 4  # timings per block of the replay (`replay_rates`)
MAX_BATCHES = 2000  # the input drain never reads more than this
TRIES = 3  # side-by-side what-ifs measured at most, while they do not know
PAIRS = 4  # real/cached block pairs of one measurement (`replay_rates`)
COMPILE_TIMINGS = (3, 50)  # timings of each way of the eager step (`compile_step`): least, most
# One run's whole what-if (the input drained, the replay and its retries, the stages)
# takes about BUDGET_S, or BUDGET_SHARE of the run's measured time where that is more.
BUDGET_S = 60.0
BUDGET_SHARE = 0.1


def what_if_budget(run_s, given=None):
    """Seconds the what-if of a run that took `run_s` seconds may take: `given` (the
    user's `--what-if-budget`), else the larger of `BUDGET_S` and `BUDGET_SHARE` of
    the run."""
    if given is not None:
        return float(given)
    return max(BUDGET_S, BUDGET_SHARE * (run_s or 0.0))


def block_timings(per_call_s, seconds, rounds=ROUNDS):
    """`(timings, calls)` of one replay block whose calls take `per_call_s` each, in
    `seconds`: up to `rounds` timings of `calls` calls, as many as fit (at most
    `MAX_BATCHES` calls in all); `(0, 0)` when not one more call fits (a multi-second
    step): the call that sized the block is then its only timing."""
    fit = int(seconds / max(per_call_s, 1e-6))
    if fit < 1:
        return 0, 0
    timings = min(rounds, fit)
    return timings, max(1, min(MAX_BATCHES // rounds, fit // timings))


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
    def of(cls, records, skip=2, steps=None):
        """The steady cycles of a run's step records (the step stream's clock).

        The records as `StepTimer.records()` gives them: each record's
        cycle, its measured input wait (0 when not measured: then it lies
        in the step, where `fit` fetches the batch) and its step.

        Args:
            records: the run's `analysis.StepRecord`s, in order.
            skip: as the constructor takes it.
            steps: None (each record's own step), or step index -> seconds
                of the step, for records whose `step` holds more than the
                step (a custom loop's whole body: diagnose timed the train
                functions it calls); an index without one is 0.
        """
        cycles = cls(skip)
        for record in records:
            if record.epoch_first:
                cycles.epoch()
            step = record.step if steps is None else steps.get(record.index, 0.0)
            cycles.add(record.cycle, record.input_wait or 0.0, step)
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
    if rates and not rates["cached"]:  # cut short before its first block: not replayed
        rates = None
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
        if len(pairs) > PAIRS:  # measured again: the middle half of all the pairs
            low, _, high = statistics.quantiles(pairs, n=4)
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


def ratio_words(z, span=None):
    """A speedup in words: `1.30x faster`, `no faster (0.98x)`, `1.06x slower (0.94x)`;
    a ratio below 1 is never "faster". `span` (e.g. "0.94x-1.06x") joins the figure in
    its parentheses: `no faster (0.98x, 0.94x-1.06x)`."""
    more = f", {span}" if span else ""
    if z >= THRESHOLDS["min_speedup"]:
        return f"{z:.2f}x faster" + (f" ({span})" if span else "")
    if z * THRESHOLDS["min_speedup"] > 1.0:
        return f"no faster ({z:.2f}x{more})"
    return f"{1 / z:.2f}x slower ({z:.2f}x{more})"


def _why_unknown(result):
    if result.get("method") != "side_by_side":
        return "; the run's own cycles varied"
    repeats = result.get("repeats") or 1
    return (f"; measured {repeats} time{'s' * (repeats != 1)}, the real and cached blocks "
            "disagreed each time: the host's load changed between blocks")


def what_if_until_known(cycles, input_per_s, measure, batches_per_cycle=1, tries=TRIES,
                        budget=None):
    """`what_if` of `measure()`'s rates, measured afresh while it does not know.

    A side-by-side what-if whose range is too wide (`known` False: the
    host's load changed between its blocks) is measured again, up to
    `tries` times in all: a measurement that knows alone is kept, else the
    pairs of all measurements so far are pooled and their middle half is
    the range (more pairs: one block beside a load spike no longer sets
    it). When none knows, the last is kept, with `repeats` saying how many
    times it was measured (the sentence gives that as the reason). A
    replay against the run's own cycles is not repeated: its range is the
    run's.

    With a `budget`, a measurement is taken again only while what is left
    of it holds one more (as long as the last took); where a measurement
    was cut short for it (`budget.cut`) or no other fitted, the figures
    measured are kept with `known` False and `cut_short` saying so.

    Args:
        cycles, input_per_s, batches_per_cycle: as `what_if` takes them.
        measure: returns `replay_rates`'s dict; None when the step cannot be
            replayed (`method` `in_run`).
        tries: measurements at most. Defaults to `TRIES`.
        budget: None, or the run's what-if budget (`diagnose.what_if.Budget`:
            `seconds`, `spent()`, `left()`, `stop()`, `cut`). Defaults to None.

    Returns:
        `what_if`'s dict with `repeats`, and with a budget `budget_s`,
        `spent_s` (the what-if so far) and `cut_short` (None, or
        "budget reached after N s"); None without steady cycles.
    """
    pooled = result = None
    for attempt in range(1, tries + 1):
        started = budget.spent() if budget is not None else 0.0
        rates = measure() if measure is not None else None
        took = budget.spent() - started if budget is not None else 0.0
        result = what_if(cycles, input_per_s, rates, batches_per_cycle=batches_per_cycle)
        if result is None:
            return None
        result["repeats"] = attempt
        if result["known"] or result["method"] != "side_by_side":
            break
        if pooled is None:
            pooled = {"cached": list(rates["cached"]), "real": list(rates["real"])}
        else:  # every pair so far: their middle half is the range
            pooled["cached"] += rates["cached"]
            pooled["real"] += rates["real"]
            result = what_if(cycles, input_per_s, pooled, batches_per_cycle=batches_per_cycle)
            result["repeats"] = attempt
            if result["known"]:
                break
        if budget is None:
            continue
        if attempt < tries and budget.left() < took:  # no room for one more
            budget.stop()
        if budget.cut:
            break
    if budget is not None:
        result.update(budget_s=budget.seconds, spent_s=budget.spent(), cut_short=budget.cut)
        if budget.cut:
            result["known"] = False
    return result


def _budget_words(result):
    """`; what-if budget 60 s, 12 s used`, or nothing where no budget was kept."""
    if result.get("budget_s") is None:
        return ""
    return f"; what-if budget {result['budget_s']:.0f} s, {result.get('spent_s') or 0:.0f} s used"


def format_what_if(result, gain=True):
    """The what-if as one sentence for people; with `gain=False` its rates only, where
    a located fix (the input's slow stage) gives the one gain of the input's cause."""
    x, y = result.get("input_batches_per_s"), result.get("step_batches_per_s")
    z = result.get("speedup_if_input_free")
    if not x or not y or z is None:
        why = result.get("cut_short") or result.get("reason", "no steady cycles")
        ran = result.get("observed_batches_per_s")
        return (f"what-if: not measured ({why})"
                + (f"; the run went at {ran:.1f} batches/s" if ran else "")
                + _budget_words(result))
    if not gain:
        return (f"what-if: input supplies {x:.1f} batches/s, the step alone consumes "
                f"{y:.1f} batches/s (the run went at {result['observed_batches_per_s']:.1f} "
                "batches/s; the fix of the input's slow stage, below, gives what fixing it "
                "gains)" + _budget_words(result))
    low, high = result.get("speedup_range") or (None, None)
    span = (f"{low:.2f}x-{high:.2f}x" if low and high
            else f"at least {low:.2f}x" if low else "unbounded")
    known = result.get("known", True)
    faster = known and z >= THRESHOLDS["min_speedup"]
    slower = z * THRESHOLDS["min_speedup"] <= 1.0  # what `ratio_words` calls slower
    if slower:  # freeing the input cannot slow the run: the step alone was timed slower
        z_words = (f"no faster ({z:.2f}x: the step alone was timed slower than it ran in the "
                   "run, as when the host's load changes between the timings)")
    else:
        z_words = ratio_words(z)
    if result.get("cut_short"):
        gain = (f"{z_words}, but the what-if does not know ({span}: cut short, "
                f"{result['cut_short']}, before its timings were all taken)")
    elif not known:
        gain = (f"{z_words}, but the what-if does not know ({span}: its timings "
                f"varied{_why_unknown(result)})")
    else:
        gain = z_words if slower else ratio_words(z, span)
    replayed = result.get("method") in ("replay", "side_by_side")
    how = "" if replayed else " (step as measured in the run)"
    if result["bound"] == "input":
        return (f"what-if: input supplies {x:.1f} batches/s, the step consumes {y:.1f} "
                f"batches/s{how}: with input free the run would be {gain} "
                f"(it ran at {result['observed_batches_per_s']:.1f} batches/s)"
                + _budget_words(result))
    # the input alone may be a little slower than the step alone and still keep up
    # with the run's cycle (the step's rate leaves out the time between steps)
    room = (f"the input could feed a step {x / y:.1f}x faster" if x >= y else
            f"the input alone keeps up with the cycle the run would have with it free, "
            f"{z * result['observed_batches_per_s']:.1f} batches/s")
    return (f"what-if: the step consumes {y:.1f} batches/s{how}, input supplies {x:.1f} "
            f"batches/s: the step is the bound ({room}); with input free the run would be "
            f"{gain}"
            + (" (the input competes with the step for the host)"
               if faster and replayed else "")
            + f" (it ran at {result['observed_batches_per_s']:.1f} batches/s)"
            + _budget_words(result))
