"""bench/ruler.py: RULER samples are generated offline and deterministically, hit their target
length in the real tokenizer, contain (or let one derive) their answers, and are scored as RULER's
string_match_all. No server, no model forward."""
from __future__ import annotations

import re
import socket

import pytest

from bench import ruler, ruler_tasks
from server.tokenizer import Tokenizer

NIAH = ("niah_single", "niah_multikey", "niah_multivalue")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


@pytest.fixture(scope="module")
def samples(tokenizer) -> list[dict]:
    """Two samples per task at ~1000 and ~4000 tokens."""
    return ruler_tasks.generate(tokenizer, ruler_tasks.TASKS, [1000, 4000], per_task=2, seed=0)


def test_generation_is_offline_and_deterministic(tokenizer, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("generation opened a socket")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    a = ruler_tasks.generate(tokenizer, ruler_tasks.TASKS, [1000], per_task=2, seed=3)
    b = ruler_tasks.generate(tokenizer, ruler_tasks.TASKS, [1000], per_task=2, seed=3)
    c = ruler_tasks.generate(tokenizer, ruler_tasks.TASKS, [1000], per_task=2, seed=4)
    assert a == b
    assert all(x["prompt"] != y["prompt"] and x["answers"] != y["answers"] for x, y in zip(a, c))
    assert len({s["prompt"] for s in a}) == len(a)          # samples differ from each other


@pytest.mark.parametrize("task", ruler_tasks.TASKS)
@pytest.mark.parametrize("length", [1000, 4000])
def test_samples_hit_their_target_length(samples, tokenizer, task, length):
    sel = [s for s in samples if s["task"] == task and s["length"] == length]
    assert len(sel) == 2
    for s in sel:
        measured = len(tokenizer.encode_chat([{"role": "user", "content": s["prompt"]}]))
        assert s["tokens"] == measured
        assert 0.95 * length <= measured <= length + 64, (task, length, measured)
        assert measured + ruler_tasks.MAX_TOKENS[task] <= ruler_tasks.MAX_POSITIONS


def test_lengths_beyond_the_model_are_refused(tokenizer):
    with pytest.raises(ValueError, match="positions"):
        ruler_tasks.make_sample(tokenizer, "niah_single", ruler_tasks.MAX_POSITIONS - 10, 0, 1)


@pytest.mark.parametrize("task", NIAH)
def test_niah_answers_are_in_the_prompt(samples, task):
    num_k, num_v = ruler_tasks.NIAH_SHAPES[task]
    for s in (s for s in samples if s["task"] == task):
        assert len(s["answers"]) == num_v
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.",
                             s["prompt"])
        assert len(needles) == num_k * num_v
        asked = re.search(r"special magic numbers? for ([a-z]+-[a-z]+) mentioned in the provided "
                          r"text\?$", s["prompt"]).group(1)
        # every answer is a value of the asked key, and the asked key has no other value
        assert sorted(v for k, v in needles if k == asked) == sorted(s["answers"])
        singular = num_v == 1
        assert s["prompt"].startswith("A special magic number is hidden" if singular
                                      else "Some special magic numbers are hidden")


def test_niah_depths_spread_over_samples(tokenizer):
    ss = [ruler_tasks.make_sample(tokenizer, "niah_single", 1000, i, 3) for i in range(3)]
    rel = [s["prompt"].index(s["answers"][0]) / len(s["prompt"]) for s in ss]
    assert [round(s["depth"], 3) for s in ss] == [0.167, 0.5, 0.833]
    assert rel == sorted(rel) and rel[1] - rel[0] > 0.2 and rel[2] - rel[1] > 0.2
    for s, r in zip(ss, rel):
        assert abs(r - s["depth"]) < 0.1


def test_vt_chain_resolves_to_the_answers(samples):
    for s in (s for s in samples if s["task"] == "vt"):
        # the question comes after RULER's one-shot example: resolve the chain in the task part
        task_part = s["prompt"][s["prompt"].rindex("Memorize and track"):]
        query = re.search(r"assigned the value (\d+) in the text above\.$", task_part).group(1)
        assigned = {}
        for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", task_part):
            assigned[name] = rhs.removeprefix("VAR ")
        def value(name):
            while name in assigned:
                name = assigned[name]
            return name
        holders = sorted(n for n in assigned if value(n) == query)
        assert holders == sorted(s["answers"]) and len(holders) == 5
        assert all(len(a) == 5 and a.isupper() for a in s["answers"])


def test_sentence_splitter():
    assert ruler_tasks.sent_tokenize("It works. Does it? Yes! e.g. this stays.  \"Quoted.\" Then 3 more.") \
        == ["It works.", "Does it?", "Yes! e.g. this stays.", "\"Quoted.\"", "Then 3 more."]


def test_string_match_all_by_hand():
    refs = ["1234567", "7654321", "ABCDE", "xyz"]
    assert ruler_tasks.string_match_all("1234567, 7654321, abcde and XYZ", refs) == 1.0
    assert ruler_tasks.string_match_all("the numbers are 1234567 and abcde", refs) == 0.5
    assert ruler_tasks.string_match_all("I don't know", refs) == 0.0
    assert ruler_tasks.string_match_all("The special magic number is 123456.", ["1234567"]) == 0.0
    assert ruler_tasks.string_match_all("VAR abcde", ["ABCDE"]) == 1.0
    # a task's score: mean over samples x 100 (1 + 0.25 + 0) / 3
    assert ruler_tasks.task_score(["a b c d", "a", "none"], [list("abcd"), list("abcd"), ["x"]]) \
        == pytest.approx(100 * 1.25 / 3)
    assert ruler_tasks.postprocess("  7\x00654\n321 ") == "7\n654\n321"
    assert ruler_tasks.postprocess(None) == ""


def test_config_flags():
    assert ruler.config_flags("dense") == []
    assert ruler.config_flags("sparse-512") == ["--sparse-budget", "512",
                                                "--sparse-threshold", "1"]
    assert ruler.config_flags("sparse-1024-p0") == ["--sparse-budget", "1024",
                                                    "--sparse-threshold", "1",
                                                    "--sparse-prior-share", "0"]
    with pytest.raises(ValueError):
        ruler.config_flags("sparse")
