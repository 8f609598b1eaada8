"""The checkpoint interval says what it means for the run at hand (seqpar.plan.options.interval), and a huge world's
divisors come at once (seqpar.plan.units.divisors)."""

from seqpar.plan.options import interval


def test_an_hourly_interval_past_the_run_says_only_at_the_end():
    n, why = interval(None, 0.0744, steps=1000)
    assert n == round(3600 / 0.0744)
    assert why.startswith("only at the end: 1000 steps") and "every" not in why


def test_an_hourly_interval_inside_the_run_names_its_steps():
    n, why = interval(None, 197.0, steps=1000)
    assert n == 18 and why == "every 18 steps: about hourly at the predicted 197 s per step"


def test_a_pinned_interval_past_the_run_and_zero():
    assert interval(5000, 1.0, steps=1000)[1] == "only at the end (every 5000 steps, and the run has 1000)"
    assert interval(100, 1.0, steps=1000)[1] == "every 100 steps"
    assert interval(0, 1.0, steps=1000)[1] == "only at the end (checkpoint_every 0)"


def test_without_steps_the_interval_is_unchanged():
    assert interval(None, 0.0744) == (48387, "every 48387 steps: about hourly at the predicted 0.0744 s per step")


def test_divisors_are_exact_and_fast_on_a_huge_world():
    from seqpar.plan.units import divisors

    for n in (1, 2, 12, 36, 97, 1000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert divisors(1024 * 131072) == [2**k for k in range(28)]  # 2^27 ranks: found up to the square root


def test_longest_is_the_largest_multiple_that_fits():
    from seqpar.plan.units import longest

    for edge in (0, 1, 1023, 1024, 5000, 2**20 + 7):
        calls = []

        def fits(n, edge=edge):
            calls.append(n)
            return n <= edge

        assert longest(1024, 2**26, fits) == edge // 1024 * 1024
        assert all(n % 1024 == 0 for n in calls) and len(calls) <= 2 * 16 + 2
    assert longest(1024, 4096, lambda n: True) == 7 * 1024  # doubling stops at the limit; bisection stays below 2x
