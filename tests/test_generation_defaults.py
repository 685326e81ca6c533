"""The model's sampling defaults (`--generation-config`, `--override-generation-config`;
engine/generation_defaults.py): read from an HF folder's generation_config.json and a GGUF
file's general.sampling.* keys, overridden by flag, checked at start-up, and taken by the
requests (chat, completions, messages) that leave those fields unset."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.args import EngineArgs
from engine.generation_defaults import sampling_defaults
from tests.server_helpers import MODEL, fresh_salt, openai_client, running_server

ASK = [{"role": "user", "content": "Name three colours."}]


def folder_with(tmp_path, conf: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(conf))
    return tmp_path


def gguf_with(path, keys: dict):
    """A GGUF file holding only metadata: these general.sampling.* keys."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_hf_folders_file_gives_vllms_fields(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                    "do_sample": True, "max_new_tokens": 512, "bos_token_id": 1,
                                    "min_p": None})
    assert sampling_defaults("auto", folder, None, "") == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 512}
    assert sampling_defaults("vllm", folder, None, "") == {}
    assert sampling_defaults("auto", tmp_path / "none", None, "") == {}


def test_a_gguf_files_keys_win_over_its_converted_folder(tmp_path):
    folder = folder_with(tmp_path, {"temperature": 0.6, "repetition_penalty": 1.1})
    path = gguf_with(tmp_path / "m.gguf", {
        "general.sampling.temp": 0.7, "general.sampling.top_k": 40,
        "general.sampling.penalty_repeat": 1.05, "general.sampling.penalty_last_n": 128,
        "general.sampling.mirostat": 2, "general.sampling.mirostat_tau": 4.0})
    got = sampling_defaults("auto", folder, path, "")
    # the file's repeat_penalty (llama.cpp's) replaces the folder's repetition_penalty: a
    # request with both is a 400, so both as defaults would refuse every request
    assert got == {"temperature": 0.7, "top_k": 40, "repeat_penalty": 1.05,
                   "repeat_last_n": 128, "mirostat": 2, "mirostat_tau": 4.0}
    assert isinstance(got["top_k"], int) and isinstance(got["mirostat"], int)
    assert sampling_defaults("auto", folder, path, '{"repetition_penalty": 1.2}') == {
        **{k: v for k, v in got.items() if k not in ("repeat_penalty", "repeat_last_n")},
        "repetition_penalty": 1.2}


def test_the_override_and_a_named_folder_win_and_are_checked(tmp_path):
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir(), other.mkdir()
    folder_with(model, {"temperature": 0.6, "top_k": 20})
    folder_with(other, {"temperature": 0.2})
    assert sampling_defaults(str(other), model, None, '{"top_p": 0.5}') == {
        "temperature": 0.2, "top_p": 0.5}
    assert sampling_defaults("auto", model, None, '{"temperature": 0}') == {
        "temperature": 0.0, "top_k": 20}
    folder_with(other, {"temperature": 7})
    with pytest.raises(ValueError, match="temperature 7 from .*other.* is not in"):
        sampling_defaults(str(other), model, None, "")


def test_a_bad_value_in_the_models_own_file_is_left_out(tmp_path, caplog):
    folder = folder_with(tmp_path, {"temperature": 7, "top_k": 2.5, "top_p": 0.9})
    assert sampling_defaults("auto", folder, None, "") == {"top_p": 0.9}
    assert "temperature 7" in caplog.text and "top_k 2.5" in caplog.text


@pytest.mark.parametrize("flags, match", [
    (dict(override_generation_config='{"temperature": 5}'), "temperature 5 .* not in"),
    (dict(override_generation_config='{"temp": 0.5}'), "takes an object of"),
    (dict(override_generation_config='[0.5'), "is not JSON"),
    (dict(override_generation_config='{"top_k": 1.5}'), "top_k 1.5 .* not an integer"),
    (dict(override_generation_config='{"repeat_penalty": 1.1, "repetition_penalty": 1.1}'),
     "not both"),
    (dict(generation_config="/no/such/folder"), "not auto, vllm or a folder")])
def test_bad_flags_are_refused_at_start_up(flags, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**flags)


def test_a_bad_override_stops_the_server():
    r = subprocess.run([sys.executable, "-m", "server", "serve", "--port", "1",
                        "--override-generation-config", '{"top_p": 0}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "top_p 0 from --override-generation-config" in r.stderr


@pytest.fixture(scope="module")
def client():
    with running_server("--max-model-len", "1024", "--override-generation-config",
                        '{"temperature": 0.0, "max_tokens": 5}') as s:
        yield openai_client(s.url)


def test_requests_that_leave_sampling_unset_take_the_defaults(client):
    def chat(**kw):
        return client.chat.completions.create(model=MODEL, messages=ASK,
                                              extra_body=fresh_salt(), **kw)
    default = chat()
    assert default.usage.completion_tokens == 5 and default.choices[0].finish_reason == "length"
    greedy = chat(temperature=0.0, max_tokens=5)
    assert default.choices[0].message.content == greedy.choices[0].message.content
    assert chat(max_tokens=8).usage.completion_tokens == 8         # the request's own wins
    # a sampled request (its own temperature) draws, seeded: not the greedy answer each time
    sampled = {chat(temperature=2.0, top_p=1.0, seed=s, max_tokens=12).choices[0].message.content
               for s in range(4)}
    assert len(sampled) > 1


def test_messages_and_completions_take_them_too(client):
    import anthropic
    base = client.base_url.host, client.base_url.port
    claude = anthropic.Anthropic(base_url=f"http://{base[0]}:{base[1]}", api_key="unused")
    msg = claude.messages.create(model=MODEL, max_tokens=5, messages=ASK,
                                 extra_body=fresh_salt())
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.0,
                                            max_tokens=5, extra_body=fresh_salt())
    assert msg.content[0].text == greedy.choices[0].message.content
    # the legacy completions' max_tokens defaults to 16 (the API's), so it stays 16
    done = client.completions.create(model=MODEL, prompt="The sky is", extra_body=fresh_salt())
    again = client.completions.create(model=MODEL, prompt="The sky is", temperature=0.0,
                                      extra_body=fresh_salt())
    assert done.usage.completion_tokens == 16 and done.choices[0].text == again.choices[0].text
    # a response echoes the values sampling used: the default where the request set none
    r = client.responses.create(model=MODEL, input="Hi", extra_body=fresh_salt())
    assert (r.temperature, r.top_p) == (0.0, 1.0)
    r = client.responses.create(model=MODEL, input="Hi", temperature=0.5, top_p=0.9,
                                extra_body=fresh_salt())
    assert (r.temperature, r.top_p) == (0.5, 0.9)


def test_a_default_max_tokens_only_caps_what_the_context_leaves():
    """vLLM's rule: a default longer than the context left is not the client's request, so it
    is no 400; a request's own max_tokens still is."""
    import openai
    with running_server("--max-model-len", "128", "--override-generation-config",
                        '{"max_tokens": 5000}') as s:
        client = openai_client(s.url)
        r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0.0,
                                           extra_body={"ignore_eos": True, **fresh_salt()})
        assert r.usage.prompt_tokens + r.usage.completion_tokens == 128
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5000)


def test_the_defaults_ranges_are_the_request_fields_own():
    """engine/generation_defaults.FIELDS repeats server/protocol.py's ranges (the engine does
    not import the server): each bound a default may take, a request may take, and the
    value past it neither may."""
    from pydantic import ValidationError

    from engine.generation_defaults import FIELDS
    from server.protocol import ChatCompletionRequest
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def request_takes(field: str, value) -> bool:
        try:
            ChatCompletionRequest(**base, **{field: value})
        except ValidationError:
            return False
        return True

    for field, (integer, lo, hi, lo_excluded) in FIELDS.items():
        step = 1 if integer else 1e-6
        assert request_takes(field, lo) is not lo_excluded, field
        assert not request_takes(field, lo - step), field
        if hi is not None:
            assert request_takes(field, hi) and not request_takes(field, hi + step), field
