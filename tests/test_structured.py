"""Constrained decoding in the engine: grammar masks, logit_bias, a generated suite of JSON
Schemas whose outputs all validate (dense and sparse with tiers), constrained and free requests
in one batch."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine.args import EngineArgs
from engine.grammar import GrammarError, check_grammar
from engine.grammar_table import GrammarTable, unpack_bitmask
from engine.llm_engine import LLMEngine
from engine.sampler import Sampler
from scheduler.sampling_params import GrammarSpec, SamplingParams
from tests.engine_helpers import drive
from bench.schemas import generate

SUITE = generate(60, seed=0)
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from server.tokenizer import Tokenizer
    return Tokenizer.from_folder(smollm2_dir)


@pytest.fixture(scope="module")
def table(smollm2_dir) -> GrammarTable:
    from engine.model_config import ModelConfig
    cfg = ModelConfig.from_hf(smollm2_dir)
    return GrammarTable(smollm2_dir / "tokenizer.json", cfg.vocab_size, cfg.eos_token_ids)


def _allowed(table: GrammarTable, rid: str) -> torch.Tensor:
    m = table._matchers[rid]
    return unpack_bitmask(table.fill([(0, m)], 1), table.vocab_size)[0]


def test_masks_allow_each_valid_instance_and_only_then_the_end(table, tokenizer):
    for k, (schema, instance) in enumerate(SUITE):
        rid = f"s{k}"
        table.matcher(rid, GrammarSpec("json_schema", json.dumps(schema)))
        text = json.dumps(instance, ensure_ascii=False)
        for tok in tokenizer.encode(text, add_special_tokens=False):
            allowed = _allowed(table, rid)
            assert allowed[tok], (schema, text, tok)
            assert not allowed.all()
            table.accept(rid, tok)
        allowed = _allowed(table, rid)                 # complete: the end, nothing else
        assert set(allowed.nonzero()[:, 0].tolist()) == set(table._eos), (schema, text)
        table.release(rid)
    assert len(table) == 0


@pytest.mark.parametrize("grammar", ['start: "yes" | "no"', 'root ::= "yes" | "no"'])
def test_lark_and_gbnf_grammars(table, tokenizer, grammar):
    table.matcher("g", GrammarSpec("lark", grammar))
    for tok in tokenizer.encode("yes", add_special_tokens=False):
        table.accept("g", tok)
    assert set(_allowed(table, "g").nonzero()[:, 0].tolist()) == set(table._eos)
    table.release("g")


def test_a_token_outside_the_grammar_is_refused(table, tokenizer):
    table.matcher("r", GrammarSpec("regex", "(yes|no)"))
    x = tokenizer.encode("maybe", add_special_tokens=False)[0]
    assert not _allowed(table, "r")[x]
    with pytest.raises(GrammarError):
        table.accept("r", x)
    table.release("r")


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", '{"type": "strnig"}'),
    GrammarSpec("json_schema", "not json"),
    GrammarSpec("json_schema", '{"properties": {"a": {"$ref": "#/$defs/missing"}}}'),
    GrammarSpec("regex", "[a-z"),
    GrammarSpec("lark", "start: undefined_rule"),
    GrammarSpec("lark", "root ::= ("),
    GrammarSpec("lark", ""),                # (the converter's bare "No 'root' rule found")
    GrammarSpec("lark", "expr ::= \"a\""),
])
def test_invalid_grammars_are_refused(spec):
    with pytest.raises(GrammarError):
        check_grammar(spec)


def test_logit_bias_and_masks_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    logits[:, 7] = 50.0                                   # token 7 would always win
    params = [SamplingParams(temperature=0.0, logit_bias=((7, -100.0),)),
              SamplingParams(temperature=0.0, logit_bias=((3, 100.0),)),
              SamplingParams(temperature=1.0, seed=1)]
    allowed = torch.full((3, 4), -1, dtype=torch.int32)
    allowed[2] = 0
    allowed[2, 1] = 1 << (40 - 32)                        # row 2 may only take token 40
    out = Sampler().sample(logits, params, [[], [], []], [None, None, None], allowed=allowed)
    assert out.token_ids[0] != 7
    assert out.token_ids[1] == 3 or logits[1, 3] + 100 < 50
    assert out.token_ids[2] == 40


def _engine(folder, tmp_path=None, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(folder), page_size=16, prefix_cache="off", **kw))


def _prompt(tokenizer, long: bool) -> list[int]:
    text = "Answer with a JSON object."
    if long:            # longer than the sparse budget: selection and the tiers at work
        text = ("The harbour log lists ships, cargo and weather for each day. " * 10) + text
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def _run_suite(engine: LLMEngine, prompt: list[int], count: int = 50):
    for k, (schema, _) in enumerate(SUITE[:count]):
        engine.add_request(f"q{k}", prompt, SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.7, seed=k,
            grammar=GrammarSpec("json_schema", json.dumps(schema))))
    got, errors = drive(engine, [f"q{k}" for k in range(count)])
    assert not errors
    return got


def _check_suite(got, table: GrammarTable, tokenizer) -> int:
    """Every answer that ended parses and validates; one cut by max_tokens (the model looping
    inside an unbounded string or number) is a prefix its grammar accepts. Returns the ended."""
    ended = 0
    for k, tokens in sorted(got.items(), key=lambda kv: int(kv[0][1:])):
        schema = SUITE[int(k[1:])][0]
        if tokens and tokens[-1] in table._eos:
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
            ended += 1
            continue
        assert len(tokens) == MAX_TOKENS
        rid = f"check-{k}"
        table.matcher(rid, GrammarSpec("json_schema", json.dumps(schema)))
        for tok in tokens:
            table.accept(rid, tok)
        table.release(rid)
    return ended


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse-tiers"])
def test_generated_schemas_always_validate(smollm2_dir, tokenizer, table, tmp_path, mode):
    if mode == "dense":
        engine = _engine(smollm2_dir, sparse_budget=0, max_num_seqs=64)
    else:
        engine = _engine(smollm2_dir, sparse_budget=64, kv_device_gb=0.05, kv_host_gb=0.6,
                         kv_host_pool="separate", max_num_seqs=32)
    got = _run_suite(engine, _prompt(tokenizer, long=mode != "dense"))
    ended = _check_suite(got, table, tokenizer)
    assert ended >= 25, f"only {ended} of 50 answers ended before max_tokens"
    if mode != "dense":
        stats = engine.store.stats.snapshot()
        assert stats.hits.get("host", 0) > 0


@pytest.fixture(scope="module")
def dense_engine(smollm2_dir) -> LLMEngine:
    return _engine(smollm2_dir, sparse_budget=0)


@pytest.mark.slow
def test_constrained_and_free_requests_in_one_batch_do_not_interfere(dense_engine, tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rain": {"type": "boolean"}},
              "required": ["city", "rain"], "additionalProperties": False}
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Weather in Paris?"}])
    constrained = SamplingParams(max_tokens=40, temperature=0.0,
                                 grammar=GrammarSpec("json_schema", json.dumps(schema)))
    free = SamplingParams(max_tokens=40, temperature=0.0)
    engine = dense_engine
    # NOTE: compared batch against batch of the same shape: a matmul over 2 rows may round
    # differently from one over 1 (bf16 GEMM kernels on AVX512_BF16 CPUs do; torch's int4 by
    # up to 0.6 logits on the bundled model), so "alone" would test the BLAS, not the
    # grammar. What must hold: the grammar of one request changes nothing in the other's
    # rows while they share the batch (the constrained one ends first, its JSON done), and
    # the constrained one follows its schema.
    runs = {}
    for name, first in (("with-grammar", constrained), ("without", free)):
        engine.add_request("c", prompt, first)
        engine.add_request("f", prompt, free)
        runs[name], errors = drive(engine, ["c", "f"])
        assert not errors
    shared = len(runs["with-grammar"]["c"])
    assert runs["with-grammar"]["f"][:shared] == runs["without"]["f"][:shared]
    assert runs["without"]["c"] == runs["without"]["f"]          # same prompt, same rows
    answer = json.loads(tokenizer.decode(runs["with-grammar"]["c"]))
    jsonschema.validate(answer, schema)
    assert answer["city"] and runs["with-grammar"]["c"] != runs["with-grammar"]["f"]


@pytest.mark.slow
def test_a_bad_grammar_fails_its_request_alone(dense_engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    dense_engine.add_request("bad", prompt, SamplingParams(
        max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "[a-z")))
    dense_engine.add_request("good", prompt, SamplingParams(
        max_tokens=8, temperature=0.0, grammar=GrammarSpec("regex", "(hello|goodbye) world")))
    got, errors = drive(dense_engine, ["bad", "good"])
    assert set(errors) == {"bad"} and "regex" in errors["bad"]
    assert tokenizer.decode(got["good"]) in ("hello world", "goodbye world")
    assert len(dense_engine.runner.grammars) == 0


@pytest.mark.slow
def test_a_grammar_starts_after_the_thinking_span(dense_engine, tokenizer):
    """Under a reasoning parser the grammar constrains what follows </think> (vLLM's rule).
    The bundled model has no <think> token, so two of its own greedy tokens stand in: the
    first it writes opens the span and a later one closes it; the tokens in between are its
    free greedy ones, and the answer after the close follows the grammar."""
    from scheduler.sampling_params import ReasoningMarks

    prompt = tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue? Explain."}])
    choice = GrammarSpec("regex", "(yes|no)")

    def run(rid: str, **kw) -> list[int]:
        dense_engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                             **kw))
        got, errors = drive(dense_engine, [rid])
        assert not errors
        return got[rid]

    free = run("free")
    close = next(j for j in range(2, len(free)) if free[j] not in free[:j])
    opened = run("opened", grammar=choice, reasoning=ReasoningMarks(free[close], free[0]))
    assert opened[:close + 1] == free[:close + 1]         # thinking: the free tokens
    assert tokenizer.decode(opened[close + 1:]) in ("yes", "no")
    # the prompt opened the span (DeepSeek-R1's template): free from the first token
    r1 = run("r1", grammar=choice, reasoning=ReasoningMarks(free[close]))
    assert r1 == opened
    # an answer that does not open the span follows the grammar from its first token, as
    # without a span (the bundled model never starts an answer with <|im_start|>)
    plain = run("plain", grammar=choice)
    never = run("never", grammar=choice,
                reasoning=ReasoningMarks(free[close], tokenizer.token_id("<|im_start|>")))
    assert never == plain and tokenizer.decode(plain) in ("yes", "no")
    assert len(dense_engine.runner.grammars) == 0
