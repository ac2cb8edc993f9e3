"""Two runs judged fairly (`analysis.comparison`): reruns taken side by side
(`paired_gain`) and `compare` of two records whose loads differ. Synthetic records:
no TensorFlow, no timing; the runs themselves are in test_run_record.py and
test_patched_run.py."""

import numpy as np
import pytest

from keras_gpufix.analysis.comparison import (LOAD_GAP, MIN_GAIN, REPEAT, WAIT_GAP,
                                              compare_runs, format_comparison, load_of,
                                              loads_differ, paired_gain, paired_words)


def _record(wall_ms, points=60, spread=0.05, others=0.1, waited=0.05, cpu_ms=None, seed=0):
    """A run record's data as `compare_runs` reads it: `points` steady points of one
    step each, their cycle `wall_ms` with a relative `spread`; its load (`others`:
    other processes' share of the CPU, `waited`: its threads' wait per second) and its
    CPU time per step (`cpu_ms`, defaults to the wall's)."""
    rng = np.random.default_rng(seed)
    cycles = wall_ms * (1 + spread * rng.standard_normal(points))
    wall_s = float(cycles.sum()) / 1000
    return {
        "verdict": {"verdict": "healthy"}, "causes": [], "fixes": [],
        "environment": {"host": "h", "keras_backend": "tensorflow"},
        "step_time": {"count": points, "batch_size": 8.0},
        "series": {"input_wait_ms": [0.0] * points, "step_ms": list(cycles),
                   "between_ms": [0.0] * points, "steps": [1] * points,
                   "judged": [True] * points},
        "contention": {"others_share": others, "waited_share": waited, "load": 1 + 4 * others,
                       "cpus": 2, "wall_s": wall_s,
                       "own_cpu_s": points * (cpu_ms or wall_ms) / 1000},
    }


def test_a_paired_gain_is_the_as_is_wall_over_the_fixed_and_its_range_holds_it():
    rounds = [(_record(20, seed=2 * i), _record(10, seed=2 * i + 1)) for i in range(2)]
    paired = paired_gain(rounds)
    assert paired["gain"] == pytest.approx(2.0, rel=0.05)
    low, high = paired["gain_range"]
    assert 1 < low < paired["gain"] < high
    assert paired["known"] and paired["settle_steps"] is None
    before, after = paired["steps_per_s"]
    assert after / before == pytest.approx(paired["gain"])
    assert paired["rounds"] == paired["rounds_run"] == 2 and paired["load_gaps"] == []
    assert paired_words(paired) == f"{paired['gain']:.2f}x ({low:.2f}x-{high:.2f}x)"


def test_a_range_that_holds_one_is_not_known_yet_with_the_steps_that_would_settle_it():
    # a 3% gain in noisy steps (30% spread): 40 steps cannot tell it from none
    rounds = [(_record(10.3, points=40, spread=0.3, seed=1),
               _record(10.0, points=40, spread=0.3, seed=2))]
    paired = paired_gain(rounds)
    low, high = paired["gain_range"]
    assert low < 1 < high and not paired["known"]
    assert paired["settle_steps"] > 40  # more steps narrow the range
    words = paired_words(paired)
    assert words.startswith("not known yet: ") and "holds 1.0" in words
    assert f"runs of about {paired['settle_steps']} steady steps would settle it" in words
    # a range within MIN_GAIN of 1.0 is known: no gain
    same = paired_gain([(_record(10, points=400, spread=0.01, seed=3),
                         _record(10, points=400, spread=0.01, seed=4))])
    low, high = same["gain_range"]
    assert low < 1 < high and high < 1 + MIN_GAIN and same["known"]


def test_a_round_whose_loads_differ_is_left_out_where_a_matched_one_exists_and_named():
    # round 1: a burner beside the as-is run only, which made it look 1.6x slower
    loaded = (_record(32, others=0.6, seed=1), _record(10, others=0.1, seed=2))
    matched = (_record(20, others=0.1, seed=3), _record(10, others=0.12, seed=4))
    assert loads_differ(load_of(loaded[0]), load_of(loaded[1])) == pytest.approx(-0.5)
    assert loads_differ(load_of(matched[0]), load_of(matched[1])) is None
    paired = paired_gain([loaded, matched])
    assert paired["gain"] == pytest.approx(2.0, rel=0.05)  # the matched round's alone
    assert paired["rounds"] == 1 and paired["rounds_run"] == 2
    (gap,) = paired["load_gaps"]
    assert gap["round"] == 1 and gap["left_out"]
    assert gap["as_is"]["others_share"] == pytest.approx(0.6)
    assert ("round 1's loads differed (as is: other processes 60% of the CPU, load 3.4 on "
            "2 CPUs, its threads waited 0.05 s/s for a CPU; fixed: other processes 10% of the "
            "CPU, load 1.4 on 2 CPUs, its threads waited 0.05 s/s for a CPU), left out"
            ) in paired_words(paired)
    # no round matched: kept, and said so
    alone = paired_gain([loaded])
    assert alone["load_gaps"][0]["left_out"] is False
    assert "kept: no round matched" in paired_words(alone)


def test_loads_that_differ_by_less_than_the_gap_or_were_not_measured_do_not_differ():
    quiet = load_of(_record(10, others=0.1))
    busy = load_of(_record(10, others=0.11 + LOAD_GAP))
    assert loads_differ(quiet, busy) == pytest.approx(0.01 + LOAD_GAP)
    assert loads_differ(busy, quiet) == pytest.approx(-0.01 - LOAD_GAP)
    assert loads_differ(quiet, load_of(_record(10, others=0.2))) is None
    # a saturated machine: the share barely moves, the threads' wait does
    saturated = load_of(_record(10, others=0.9, waited=0.3))
    starved = load_of(_record(10, others=0.95, waited=0.31 + WAIT_GAP))
    assert loads_differ(saturated, starved) == pytest.approx(0.01 + WAIT_GAP)
    # beside no other process, a wait is the run's own threads waiting for each other (a
    # compiled step's thread pool against an eager step's one thread): not a load
    eager = load_of(_record(10, others=0.0, waited=0.04))
    compiled = load_of(_record(10, others=0.0, waited=1.27))
    assert loads_differ(eager, compiled) is None
    unmeasured = load_of(dict(_record(10), contention=None))
    assert unmeasured["others_share"] is None and loads_differ(quiet, unmeasured) is None
    assert load_of(_record(10, cpu_ms=7))["cpu_ms_per_step"] == pytest.approx(7)


def test_no_round_with_steps_on_both_sides_is_no_gain():
    empty = _record(10, points=0)
    assert paired_gain([(empty, _record(10))]) is None


def test_compare_never_calls_a_difference_the_load_explains_a_regression():
    # the fixed run (twice as fast at one load) ran beside a burner and measured slower:
    # its threads waited 0.8 s a second for a CPU, the as-is run's 0.1
    before = _record(10, others=0.1, waited=0.1, cpu_ms=9)
    after = _record(14, others=0.7, waited=0.8, cpu_ms=4.6)
    result = compare_runs(before, after)
    assert result["gain"] < 1 and result["gain_range"][1] < 1  # alone: a regression
    assert result["word"] == "inconclusive"
    load = result["load"]
    assert load["more"] == "after" and load["explains"]
    # with the waits taken out (none to all), the gain could be 0.71x to 0.71 * 0.9 / 0.2
    low, high = load["quiet_range"]
    assert low == pytest.approx(result["gain"]) and high == pytest.approx(
        result["gain"] * 0.9 / 0.2)
    assert result["after"]["load"]["others_share"] == pytest.approx(0.7)
    text = format_comparison(result, "a", "b")
    assert text.startswith(f"inconclusive: b runs {result['gain']:.2f}x")
    assert "load of a: other processes 10% of the CPU, load 1.4 on 2 CPUs" in text
    assert "load of b: other processes 70% of the CPU, load 3.8 on 2 CPUs" in text
    assert "its CPU time 4.6 ms per step" in text
    assert ("inconclusive: b ran under more load than a, enough to explain the difference "
            "measured (it got 0.33 of a CPU against 0.90) (with the runs' waits for a CPU taken "
            f"out, none to all of them, the gain is {low:.2f}x-{high:.2f}x); its CPU time per "
            "step, which load moves less, went 9 -> 4.6 ms (1.96x; it leaves out time not spent "
            f"computing); {REPEAT}") in text
    # no change beside loads that differ: the load may hide a gain
    flat = compare_runs(_record(10, others=0.1), _record(10, others=0.7, seed=1))
    assert flat["word"] == "inconclusive" and flat["load"]["explains"]
    # the waits not measured: the loads' gap alone explains it
    unmeasured = compare_runs(_record(10, others=0.1, waited=None),
                              _record(14, others=0.7, waited=None))
    assert unmeasured["word"] == "inconclusive" and unmeasured["load"]["quiet_range"] is None


def _starved_pair(share_before, share_after, others_after=0.74):
    """The measured eager pair (benchmarks/load_pairs.py, truth 1.02x) with a burner
    beside the as-is run: 635 vs 295 ms a step, its threads' waits as long (1.50 vs
    1.48 s/s: a pool that waits for itself), the CPUs each run got as given."""
    before = _record(635, others=0.85, waited=1.50)
    after = _record(295, others=others_after, waited=1.48, seed=1)
    before["contention"]["own_cpu_s"] = share_before * before["contention"]["wall_s"]
    after["contention"]["own_cpu_s"] = share_after * after["contention"]["wall_s"]
    return before, after


def test_a_run_the_load_starved_of_the_cpu_keeps_its_cpu_times_word_without_a_figure():
    # measured: the as-is run got 0.30 of a CPU against 0.52 while other processes took
    # 85% against 74%: the wall reads 2.15x; the CPU time per step, which load moves
    # less, 1.24x: the word stands on it, with no figure (neither is the gain at one
    # load: a cached map's 4.09x read 2.13x by its CPU time, 3.16x by its wall)
    result = compare_runs(*_starved_pair(0.30, 0.52))
    assert result["gain"] == pytest.approx(2.15, rel=0.05)
    assert result["word"] == "improvement" and result["load"]["starved"]
    assert result["load"]["cpu_gain"] == pytest.approx(2.15 * 0.30 / 0.52, rel=0.05)
    text = format_comparison(result, "a", "b")
    assert text.startswith("improvement: b runs faster than a, by how much not known at "
                           "these loads")
    assert f"holds the word ({result['load']['cpu_gain']:.2f}x)" in text
    assert f"{result['gain']:.2f}x (" not in text  # no figure stated as the gain
    # the same walls, the same CPU time per step: the load explains all of it
    flat = compare_runs(*_starved_pair(0.30, 0.30 * 635 / 295))
    assert flat["word"] == "inconclusive" and flat["load"]["explains"]
    # the same shares with other processes' as before: the fix's own doing, as measured
    assert compare_runs(*_starved_pair(0.30, 0.52, others_after=0.85))["load"] is None
    # a run that mostly waits (0.05 of a CPU: sleeps, I/O) was not starved of the CPU
    waiting = compare_runs(*_starved_pair(0.05, 0.08))
    assert waiting["word"] == "improvement" and not (waiting["load"] or {}).get("starved")


def test_compare_keeps_its_word_where_the_load_cannot_explain_it():
    # the faster run was the more loaded: the difference is at least the one measured
    result = compare_runs(_record(20, others=0.1, waited=0.1),
                          _record(10, others=0.7, waited=0.8, seed=1))
    assert result["word"] == "improvement"
    assert result["load"]["more"] == "after" and not result["load"]["explains"]
    assert ("b ran under more load than a and was still the faster: the difference is at "
            "least the one measured") in format_comparison(result, "a", "b")
    worse = compare_runs(_record(10, others=0.7, waited=0.8), _record(20, others=0.1, seed=1))
    assert worse["word"] == "regression" and worse["load"]["more"] == "before"
    # the slower run waited a little more, far from enough to explain 2x: word stands,
    # nothing said of the load beyond each run's figures
    near = compare_runs(_record(20, others=0.3, waited=0.35), _record(10, others=0.3,
                                                                     waited=0.3, seed=1))
    assert near["word"] == "improvement" and near["load"] is None
    # matched loads: the word as measured, the loads still beside the throughput
    quiet = compare_runs(_record(20, others=0.1), _record(10, others=0.2, seed=1))
    assert quiet["word"] == "improvement" and quiet["load"] is None
    assert "load of a: " in format_comparison(quiet, "a", "b")


def test_a_known_gain_is_settled_only_within_25_percent_either_way():
    from keras_gpufix.analysis.comparison import SETTLED, settled

    tight = paired_gain([(_record(20, seed=2 * i), _record(10, seed=2 * i + 1))
                         for i in range(2)])
    # the same 2x, one round's as-is run far slower: known (above 1), not yet precise
    wide = paired_gain([(_record(20, seed=5), _record(10, seed=6)),
                        (_record(40, seed=7), _record(10, seed=8))])
    assert tight["known"] and wide["known"]
    assert settled(tight)
    low, high = wide["gain_range"]
    assert high / wide["gain"] > SETTLED and not settled(wide)
