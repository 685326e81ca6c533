"""StopChecker: stop strings cut the output before them and are never partly streamed."""
from __future__ import annotations

import random

import pytest

from server.stop_checker import StopChecker


def run(stops, pieces) -> tuple[list[str], bool]:
    checker = StopChecker(stops)
    emitted = [checker.push(p) for p in pieces]
    if not checker.stopped:
        emitted.append(checker.flush())
    return emitted, checker.stopped


def reference(text: str, stops) -> str:
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(cuts)] if cuts else text


def test_output_ends_before_the_first_stop_string():
    emitted, stopped = run(["END"], ["hello ", "world END and more"])
    assert "".join(emitted) == "hello world " and stopped


def test_earliest_of_several_stop_strings_wins():
    emitted, _ = run(["zz", "b"], ["a b c zz"])
    assert "".join(emitted) == "a "


def test_stop_string_split_across_pushes_is_never_emitted():
    emitted, stopped = run(["STOP"], list("abcST") + list("OPxyz"))
    assert stopped and "".join(emitted) == "abc"
    assert all("S" not in piece for piece in emitted)


def test_partial_match_is_held_then_released():
    checker = StopChecker(["STOP"])
    assert checker.push("abcST") == "ab"          # the last len("STOP") - 1 chars wait
    assert checker.push("ar") == "cS"
    assert checker.flush() == "Tar"


def test_without_stop_strings_everything_is_emitted_at_once():
    checker = StopChecker([])
    assert checker.push("abc") == "abc" and checker.flush() == ""


def test_empty_stop_strings_are_ignored():
    emitted, stopped = run(["", "x"], ["abxcd"])
    assert "".join(emitted) == "ab" and stopped


def test_nothing_is_emitted_after_a_stop():
    checker = StopChecker(["!"])
    assert checker.push("hi!there") == "hi"
    assert checker.push("more") == "" and checker.flush() == ""


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_match_the_reference_and_never_leak_a_stop(seed):
    rng = random.Random(seed)
    alphabet = "ab\u00e9\U0001f600 "
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
             for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    checker = StopChecker(stops)
    so_far = ""
    for piece in pieces:
        so_far += checker.push(piece)
        assert reference(text, stops).startswith(so_far)
        assert not any(s in so_far for s in stops)
    so_far += checker.flush()
    assert so_far == reference(text, stops)


@pytest.mark.parametrize("pieces", [["hello wor", "ld END and more"], ["hello world E", "N", "D!"]])
def test_include_keeps_the_stop_string_and_nothing_after(pieces):
    checker = StopChecker(["END", "D!"], include=True)
    emitted = [checker.push(p) for p in pieces]
    assert "".join(emitted) == "hello world END" and checker.stopped


def test_include_takes_the_longest_of_stops_starting_at_one_place():
    checker = StopChecker(["ab", "abc"], include=True)
    assert checker.push("x abcd") == "x abc"
