"""Tool calls in the other formats (server/tool_formats.py) through the openai SDK against a
real server: a model folder whose chat template writes Llama 3.1's JSON calls (auto picks
llama3_json), and the bundled model with --tool-call-parser mistral or phi4_mini_json.
tool_choice required makes the model write calls in the format (its grammar); they come back
as tool_calls, streamed and not, and a round trip renders the history."""
from __future__ import annotations

import json

import pytest

from tests.server_helpers import openai_client, running_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Llama 3.1's way (ChatML tokens, which the bundled model knows): tools in the system turn,
# a call answered as {"name", "parameters"}, a tool's answer in an ipython turn
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nEnvironment: ipython\nAnswer a function call as "
    '{"name": function name, "parameters": its arguments}, maybe after <|python_tag|>.\n'
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}\n"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}{{ {'name': c.function.name, 'parameters': "
    "c.function.arguments} | tojson }}{%- if not loop.last %}; {% endif %}{%- endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module", params=["llama3_json", "mistral", "phi4_mini_json"])
def served(request, smollm2_dir, tmp_path_factory):
    if request.param == "llama3_json":
        folder = tmp_path_factory.mktemp("llama3-template")
        for f in smollm2_dir.iterdir():
            if f.name != "chat_template.jinja":
                (folder / f.name).symlink_to(f)
        (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
        args = ("--model", str(folder), "--served-model-name", "m")
    else:
        args = ("--tool-call-parser", request.param, "--served-model-name", "m")
    with running_server("--max-model-len", "1024", *args) as server:
        yield openai_client(server.url), request.param


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_come_back_as_tool_calls_and_round_trip(served, stream):
    client, fmt = served
    kw = dict(model="m", tools=[WEATHER], tool_choice="required", max_tokens=60,
              temperature=0.0, parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(messages=ASK, stream=True, **kw))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)
        name, call_id = deltas[0].function.name, deltas[0].id
        arguments = "".join(d.function.arguments or "" for d in deltas)
    else:
        r = client.chat.completions.create(messages=ASK, logprobs=True, **kw)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        written = "".join(t.token for t in r.choices[0].logprobs.content)   # the raw answer
        assert "".join(written.split()).startswith({
            "llama3_json": '{"name":"get_weather","parameters":',
            "mistral": '[TOOL_CALLS][{"name":"get_weather",',
            "phi4_mini_json": 'functools[{"name":"get_weather",'}[fmt]), written
        (call,) = r.choices[0].message.tool_calls
        name, call_id, arguments = call.function.name, call.id, call.function.arguments
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)
    history = ASK + [{"role": "assistant", "tool_calls": [{
        "id": call_id, "type": "function",
        "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model="m", messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=20, temperature=0.0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
