"""numcoll.bench.findings: the notebook's conclusions, computed from rows."""

from collections import Counter

from numcoll.bench import findings


def rows(times_us, *, sizes=(8, 1024, 65536, 1 << 20), rank_times=None, maxes=None):
    out = []
    for i, (size, t) in enumerate(zip(sizes, times_us)):
        out.append({"size": size, "time_us": t, "time_us_max": (maxes or times_us)[i],
                    "busbw_gbps": size / t / 1e3,
                    "rank_time_us": None if rank_times is None else rank_times[i]})
    return out


def test_faster_from_the_crossover_up():
    a, b = rows([30, 30, 20, 100]), rows([10, 20, 25, 150])
    f = findings.faster_from(a, b)
    assert f == {"sizes": [8, 1024, 65536, 1 << 20], "better": [65536, 1 << 20],
                 "from_size": 65536}
    assert findings.faster_sentence("numcoll", a, "gloo", b, 2) == \
        "numcoll beats gloo from 64 KiB up at 2 ranks (faster at 2 of 4 sizes)."


def test_faster_sentences_for_every_shape_of_result():
    fast, slow = rows([1, 1, 1, 1]), rows([2, 2, 2, 2])
    assert "at every size measured at 4 ranks" in findings.faster_sentence("a", fast, "b", slow, 4)
    assert "slower than b at every size" in findings.faster_sentence("a", slow, "b", fast, 4)
    middle = rows([1, 3, 1, 3])
    sentence = findings.faster_sentence("a", middle, "b", slow, 2)
    assert "only below 1 MiB" in sentence and "faster at 2 of 4 sizes" in sentence
    assert "no size in common" in findings.faster_sentence("a", fast, "b", rows([1], sizes=[3]),
                                                           2)


def test_algorithm_choice_reports_where_the_automatic_choice_was_slower():
    ring, rd = rows([50, 50, 40, 100]), rows([20, 25, 45, 300])
    auto = {8: "recursive_doubling", 1024: "recursive_doubling", 65536: "recursive_doubling",
            1 << 20: "ring"}
    c = findings.algorithm_choice(auto, {"ring": ring, "recursive_doubling": rd})
    assert c["agree"] == [8, 1024, 1 << 20]
    assert c["disagree"] == [(65536, "recursive_doubling", "ring", 45 / 40)]
    assert findings.choice_sentence("allreduce", c) == (
        "numcoll's automatic allreduce choice was the fastest measured at 3 of 4 sizes; "
        "slower at 64 KiB (recursive_doubling took 12% longer than ring).")


def test_a_choice_never_measured_is_not_counted_as_agreeing():
    # issue 18: "picked the faster at 13 of 13 sizes" while the chosen algorithm
    # (shared) was never measured
    ring, rd = rows([50, 50, 40, 100]), rows([20, 25, 45, 300])
    auto = dict.fromkeys((8, 1024, 65536, 1 << 20), "shared")
    c = findings.algorithm_choice(auto, {"ring": ring, "recursive_doubling": rd})
    assert c["sizes"] == c["agree"] == [] and len(c["unmeasured"]) == 4
    assert findings.choice_sentence("allreduce", c).startswith(
        "numcoll's allreduce choice: nothing to compare")
    # measured, but alone: still nothing to compare
    c = findings.algorithm_choice(auto, {"shared": rows([5, 5, 5, 5])})
    assert c["sizes"] == [] and len(c["unmeasured"]) == 4


def test_a_choice_within_the_tolerance_is_said_so():
    shared, ring = rows([10, 10, 10, 10]), rows([10.5, 9.5, 20, 5])
    c = findings.algorithm_choice(dict.fromkeys((8, 1024, 65536, 1 << 20), "shared"),
                                  {"shared": shared, "ring": ring})
    assert c["agree"] == [8, 65536]
    text = findings.choice_sentence("allreduce", c)
    assert "fastest measured at 2 of 4 sizes and within 10% of it at 1 more" in text
    assert "1 MiB (shared took 100% longer than ring)" in text


def test_noise_stragglers_and_peak():
    r = rows([10, 10, 10, 10], maxes=[15, 25, 10, 30],
             rank_times=[[9, 10], [10, 8], [9, 7], [9.5, 9]])
    assert findings.noisy_sizes(r) == [1024, 1 << 20]
    assert findings.waited_for(r) == Counter({1: 3, 0: 1})
    assert findings.peak(r)["size"] == 1 << 20
