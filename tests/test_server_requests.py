"""Request validation, error shapes and SamplingParams building (pure functions, no server)."""
from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from engine.protocol import EngineDeadError, QueueFullError, RequestTooLargeError
from server.errors import APIError, from_engine_error, one_line, validation_error
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.protocol_responses import ChatCompletionChunk, ChatCompletionStreamChoice, DeltaMessage
from server.sampling import build_sampling_params, resolve_max_tokens, stop_strings

HELLO = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": HELLO, **kw})


def error_for(model, body: dict) -> APIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_error(RequestValidationError(errors))


@pytest.mark.parametrize("body, param", [
    ({"messages": HELLO, "temperature": 2.5}, "temperature"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "n": 0}, "n"),
    ({"messages": HELLO, "n": 17}, "n"),
    ({"messages": HELLO, "top_p": 0.0}, "top_p"),
    ({"messages": HELLO, "presence_penalty": -3}, "presence_penalty"),
    ({"messages": HELLO, "stop": ["a"] * 5}, "stop"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    # a seed is a 64-bit signed integer (2^64 used to overflow inside the engine step)
    ({"messages": HELLO, "seed": 2 ** 64}, "seed"),
    ({"messages": HELLO, "seed": 10 ** 30}, "seed"),
    ({"messages": HELLO, "seed": -2 ** 63 - 1}, "seed"),
    # integers and booleans are strict
    ({"messages": HELLO, "max_tokens": "2"}, "max_tokens"),
    ({"messages": HELLO, "n": "2"}, "n"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": HELLO, "logprobs": 1}, "logprobs"),
    ({"messages": HELLO, "seed": 1.5}, "seed"),
    # lone surrogates are not text
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ({"messages": HELLO, "model": "m\udfff"}, "model"),
    ({"messages": HELLO, "stop": ["\ud800"]}, "stop"),
    # vLLM's token-level controls and chat template switches
    ({"messages": HELLO, "allowed_token_ids": []}, "allowed_token_ids"),
    ({"messages": HELLO, "allowed_token_ids": [-1]}, "allowed_token_ids[0]"),
    ({"messages": HELLO, "bad_words": ["ok", " "]}, "bad_words"),
    ({"messages": HELLO, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"messages": HELLO, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"messages": HELLO, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"messages": HELLO, "continue_final_message": True}, "continue_final_message"),
    ({"messages": HELLO, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),           # the last message is the user's
    ({"messages": HELLO, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": HELLO, "spaces_between_special_tokens": False},
     "spaces_between_special_tokens"),
    # llama.cpp's samplers: those not implemented, on; the others' bad values
    ({"messages": HELLO, "tfs_z": 0.95}, "tfs_z"),
    ({"messages": HELLO, "dry_base": 0.5}, "dry_base"),
    ({"messages": HELLO, "dry_sequence_breakers": [""]}, "dry_sequence_breakers[0]"),
    ({"messages": HELLO, "typical_p": 0}, "typical_p"),
    ({"messages": HELLO, "mirostat": 3}, "mirostat"),
    ({"messages": HELLO, "repeat_last_n": -2}, "repeat_last_n"),
    ({"messages": HELLO, "xtc_threshold": 1.5}, "xtc_threshold"),
])
def test_invalid_chat_values_name_the_param(body, param):
    error = error_for(ChatCompletionRequest, body)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert error.body()["error"].keys() == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "suffix": 3}, "suffix"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "a\ud800"}, "prompt"),
    ({"prompt": "x", "seed": 2 ** 63}, "seed"),
])
def test_invalid_completion_values_name_the_param(body, param):
    assert error_for(CompletionRequest, body).param == param


def test_llamacpp_samplers_when_off_are_accepted():
    # what a llama.cpp client sends by default: each sampler off, and the knobs of off samplers
    off = {"repeat_penalty": 1.0, "repeat_last_n": 64, "typical_p": 1, "tfs_z": 1.0,
           "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "dry_multiplier": 0.0,
           "dry_base": 1.75, "xtc_probability": 0, "xtc_threshold": 0.1,
           "dynatemp_range": 0.0, "top_n_sigma": -1.0}
    ChatCompletionRequest.model_validate({"messages": HELLO, **off})
    CompletionRequest.model_validate({"prompt": "x", **off})
    error = error_for(CompletionRequest, {"prompt": "x", "tfs_z": 0.9})
    assert "llama.cpp sampler this server does not implement" in error.message


def test_llamacpp_samplers_map_onto_the_sampling_params():
    from server.sampling import build_sampling_params
    from server.errors import APIError

    def params(**fields):
        request = CompletionRequest.model_validate({"prompt": "x", **fields})
        return build_sampling_params(request, max_tokens=4)
    p = params(repeat_penalty=1.3)                   # llama.cpp's default window
    assert (p.repetition_penalty, p.repetition_window) == (1.3, 64)
    assert params(repeat_penalty=1.3, repeat_last_n=-1).repetition_window == 0    # all
    assert params(repeat_penalty=1.3, repeat_last_n=0).repetition_penalty == 1.0  # none
    p = params(repetition_penalty=1.2)
    assert (p.repetition_penalty, p.repetition_window) == (1.2, 0)
    p = params(mirostat=2, mirostat_tau=3.0, typical_p=0.9, top_n_sigma=1.5,
               xtc_probability=0.5, xtc_threshold=0.2, dynatemp_range=0.3)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.typical_p, p.top_n_sigma,
            p.xtc_probability, p.xtc_threshold, p.dynatemp_range) == (
        2, 3.0, 0.1, 0.9, 1.5, 0.5, 0.2, 0.3)
    p = params(dry_multiplier=0.8, dry_allowed_length=3, dry_penalty_last_n=256)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (
        0.8, 1.75, 3, 256)
    with pytest.raises(APIError) as err:
        params(repetition_penalty=1.2, repeat_penalty=1.1)
    assert err.value.param == "repeat_penalty"


def test_seed_range_edges_are_accepted_and_choice_seeds_wrap():
    from engine.sampler import make_generator
    top = chat(seed=2 ** 63 - 1, n=2)
    params = build_sampling_params(top, max_tokens=4, seed_offset=1)
    assert params.seed == 2 ** 63
    make_generator(params.seed)                     # past int64: taken modulo 2^64
    make_generator(chat(seed=-2 ** 63).seed)


def test_tiny_temperature_is_greedy():
    assert build_sampling_params(chat(temperature=1e-300), max_tokens=4).temperature == 0.0
    assert build_sampling_params(chat(temperature=1e-3), max_tokens=4).temperature == 1e-3


def test_the_user_field_is_the_fair_share_client():
    assert build_sampling_params(chat(user="alice"), max_tokens=4).client == "alice"
    assert build_sampling_params(chat(), max_tokens=4).client == ""
    assert len(build_sampling_params(chat(user="x" * 5000), max_tokens=4).client) == 256


def test_an_empty_body_says_so():
    # what FastAPI reports for a POST without a body
    error = validation_error(RequestValidationError(
        [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]))
    assert error.status == 400 and "body" in error.message and "None" not in error.message


def test_completion_length_errors_talk_about_the_prompt():
    with pytest.raises(APIError) as info:
        resolve_max_tokens(10, 4096, 4096, "prompt")
    assert info.value.param == "prompt" and "prompt" in info.value.message
    assert "messages" not in info.value.message


def test_unknown_fields_are_ignored_and_text_parts_are_joined():
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}],
                   no_such_field=1)
    assert request.messages[0].text() == "a\nb"


def test_prompts_accept_text_batches_and_token_ids():
    for prompt in ("x", ["x", "y"], [1, 2], [[1], [2, 3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt


def test_context_overflow_names_both_numbers():
    with pytest.raises(APIError) as info:
        resolve_max_tokens(100, prompt_tokens=30, max_model_len=120)
    error = info.value
    assert error.code == "context_length_exceeded" and error.status == 400
    assert "120" in error.message and "130" in error.message
    assert "30 in the messages" in error.message and "100 in the completion" in error.message


def test_prompt_alone_filling_the_context_is_rejected():
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, prompt_tokens=120, max_model_len=120)
    assert info.value.code == "context_length_exceeded" and "120" in info.value.message


def test_max_tokens_defaults_to_the_rest_of_the_context():
    assert resolve_max_tokens(None, prompt_tokens=30, max_model_len=120) == 90
    assert resolve_max_tokens(90, prompt_tokens=30, max_model_len=120) == 90


def test_sampling_params_from_a_chat_request():
    request = chat(max_tokens=5, max_completion_tokens=7, seed=10, top_k=-1, logprobs=True,
                   stop="x", stop_token_ids=[3], ignore_eos=True, min_tokens=2)
    assert request.requested_max_tokens() == 7
    params = build_sampling_params(request, max_tokens=7, seed_offset=2, vocab_size=100)
    assert (params.max_tokens, params.seed, params.top_k, params.logprobs) == (7, 12, 0, 0)
    assert params.temperature == 1.0 and params.top_p == 1.0
    assert params.stop_token_ids == (3,) and params.ignore_eos and params.min_tokens == 2
    assert stop_strings(request) == ("x",)


def test_logprobs_mapping():
    assert chat().logprobs_k() is None
    assert chat(logprobs=True, top_logprobs=4).logprobs_k() == 4
    assert CompletionRequest(prompt="x", logprobs=2).logprobs_k() == 2


def test_min_tokens_above_max_tokens_is_400():
    with pytest.raises(APIError) as info:
        build_sampling_params(chat(min_tokens=9), max_tokens=4)
    assert info.value.param == "min_tokens"


def test_out_of_range_stop_token_id_is_400():
    with pytest.raises(APIError) as info:
        build_sampling_params(chat(stop_token_ids=[500]), max_tokens=4, vocab_size=100)
    assert info.value.param == "stop_token_ids"


def test_engine_errors_map_to_statuses():
    full = from_engine_error(QueueFullError("busy", retry_after_s=3))
    assert full.status == 429 and full.headers["Retry-After"] == "3"
    assert from_engine_error(EngineDeadError("gone")).status == 503
    assert from_engine_error(RequestTooLargeError("too big")).status == 400


def test_engine_messages_lose_their_tracebacks():
    assert one_line("EIO on page 7\nTraceback (most recent call last):\n  x") == "EIO on page 7"
    assert one_line(None) == "unknown error"


def test_stream_deltas_carry_only_set_keys():
    chunk = ChatCompletionChunk(id="c", created=0, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage())])
    dumped = chunk.model_dump()
    assert dumped["choices"][0]["delta"] == {} and dumped["choices"][0]["finish_reason"] is None
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant",
                                                                       "content": ""}


def test_openapi_declares_the_statuses_we_send_and_no_422():
    from server.api import build_app
    from server.engine_slot import EngineSlot
    doc = build_app(EngineSlot("m"), lambda: None, served_model_name="m").openapi()
    for route in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][route]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "503"} <= responses.keys()
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "Response") and "text/event-stream" in responses["200"]["content"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert all(kind.startswith("text/plain") for kind in metrics)
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["$ref"].endswith("/ModelList")


def test_allowed_token_ids_outside_the_vocabulary_are_a_400_and_kept_sorted_otherwise():
    with pytest.raises(APIError) as info:
        build_sampling_params(chat(allowed_token_ids=[5, 100]), max_tokens=4, vocab_size=100)
    assert info.value.param == "allowed_token_ids"
    params = build_sampling_params(chat(allowed_token_ids=[9, 5, 9]), max_tokens=4,
                                   vocab_size=100)
    assert params.allowed_token_ids == (5, 9)


def test_truncate_prompt_keeps_the_tail():
    from server.sampling import truncate_prompt
    ids = list(range(10))
    assert truncate_prompt(ids, None, 8) == ids
    assert truncate_prompt(ids, 3, 8) == [7, 8, 9]
    assert truncate_prompt(ids, 20, 8) == ids
    assert truncate_prompt(ids, -1, 8) == ids[3:]           # room for one token
    assert truncate_prompt(ids, -1, 8, max_tokens=4) == ids[6:]
