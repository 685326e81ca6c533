"""The tool call formats besides Hermes (mistral, llama3_json; server/tool_formats.py) without
a model: read back whole and streamed in any chunks, content kept as written when it is not
calls, the format chosen from the chat template, the default instructions and history in the
format, and the required-calls grammar accepting what the format writes."""
from __future__ import annotations

import json

import pytest

from scheduler.sampling_params import GrammarSpec
from server.protocol import ChatCompletionRequest
from server.tool_formats import calls_grammar, resolve_format
from server.tool_parser import ParsedCall, make_parser, split_answer
from server.tools import chat_messages, format_calls

NAMES = frozenset({"get_weather", "get_time"})
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def streamed(fmt: str, text: str, size: int, parallel: bool = True):
    parser = make_parser(fmt, NAMES, parallel)
    events = []
    for i in range(0, len(text), size):
        events += parser.push(text[i:i + size])
    events += parser.flush()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [(e.name, json.loads(e.arguments)) for e in events
                     if isinstance(e, ParsedCall)]


@pytest.mark.parametrize("fmt", ["mistral", "llama3_json", "hermes", "phi4_mini_json"])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_calls_read_back_however_they_stream(fmt, size):
    text = format_calls(fmt, CALLS)
    assert streamed(fmt, text, size) == ("", CALLS)
    assert streamed(fmt, text, size, parallel=False) == ("", CALLS[:1])
    content, calls = split_answer(text, NAMES, fmt=fmt)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_mistral_content_before_the_calls_streams_and_stays_content(size):
    text = "Checking. " + format_calls("mistral", CALLS[:1])
    assert streamed("mistral", text, size) == ("Checking. ", CALLS[:1])
    assert split_answer(text, NAMES, fmt="mistral")[0] == "Checking."
    parser = make_parser("mistral", NAMES)
    assert parser.push("Checking. [TOOL") == ["Checking. "]      # a partial marker is held


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_phi4_mini_calls_after_content_and_its_written_form(size):
    assert format_calls("phi4_mini_json", CALLS) == (
        'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]')
    text = "Let me check. " + format_calls("phi4_mini_json", CALLS[:1])
    assert streamed("phi4_mini_json", text, size) == ("Let me check. ", CALLS[:1])
    parser = make_parser("phi4_mini_json", NAMES)
    assert parser.push("Sure. functoo") == ["Sure. "]            # a partial marker is held
    assert parser.push("ls.partial helps.") == ["functools.partial helps."]   # prose streams


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_python_tag_and_a_text_answer(size):
    text = "<|python_tag|>" + format_calls("llama3_json", CALLS[:1])
    assert streamed("llama3_json", text, size) == ("", CALLS[:1])
    answer = "It is sunny in Paris."
    assert streamed("llama3_json", answer, size) == (answer, [])
    parser = make_parser("llama3_json", NAMES)
    assert parser.push("  It") == ["  It"]              # text streams at once, not held


@pytest.mark.parametrize("fmt, text", [
    ("mistral", '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]'),    # unknown function
    ("mistral", "[TOOL_CALLS] [not json"),
    ("llama3_json", '{"name": "get_time", "parameters": [1]}'),          # arguments not an object
    ("llama3_json", '{"answer": 42}'),
    ("phi4_mini_json", 'functools[{"name": "launch", "arguments": {}}]'),
    ("phi4_mini_json", "functools are handy"),
])
def test_what_is_not_calls_to_known_functions_stays_content_as_written(fmt, text):
    assert streamed(fmt, text, 3) == (text, [])


@pytest.mark.parametrize("template, fmt", [
    (None, "hermes"),
    ("{{ messages }}", "hermes"),                                   # does not render tools
    ("{% for t in tools %}{{ t }}{% endfor %}<tool_call>", "hermes"),
    ("{{ tools }}[TOOL_CALLS] [", "mistral"),
    ("{{ tools }}<|python_tag|>", "llama3_json"),
    ("{% if 'tools' in m %}{{ m['tools'] }}{% endif %}[TOOL_CALLS]", "hermes"),  # a key only
    ("{% set tools = 1 %}{{ tools }}<|python_tag|>", "hermes"),    # its own, not the request's
    # Phi-4-mini's: tools from a system message's own field, between <|tool|> tags
    ("{% if 'tools' in message %}<|tool|>{{ message['tools'] }}<|/tool|>{% endif %}",
     "phi4_mini_json"),
])
def test_auto_reads_the_format_from_the_chat_template(template, fmt):
    assert resolve_format("auto", template) == fmt
    assert resolve_format("mistral", template) == "mistral"        # a chosen one is kept


def test_the_default_instructions_and_history_are_written_in_the_format():
    request = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather"}}])
    messages, _ = chat_messages(request, None, "mistral")
    assert '[TOOL_CALLS] [{"name": "<function name>", "arguments": <the arguments' \
        in messages[0]["content"]
    assert messages[2]["content"] == format_calls("mistral", [("get_weather", {"city": "Paris"})])
    messages, _ = chat_messages(request, None, "llama3_json")
    assert messages[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    # a template naming 'tools' only as a message's key does not render the request's
    phi4 = "{% for m in messages %}{% if 'tools' in m %}<|tool|>{{ m['tools'] }}{% endif %}" \
           "{{ m['content'] }}{% endfor %}"
    messages, tools = chat_messages(request, phi4, "phi4_mini_json")
    assert tools is None and 'functools[{"name": "<function name>"' in messages[0]["content"]
    assert messages[2]["content"].startswith('functools[{"name": "get_weather"')


@pytest.mark.parametrize("fmt", ["mistral", "llama3_json", "hermes", "phi4_mini_json"])
def test_the_required_grammar_takes_what_the_format_writes(smollm2_dir, fmt):
    from engine.grammar import GrammarError
    from engine.grammar_table import GrammarTable
    from server.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_dir)
    table = GrammarTable(smollm2_dir / "tokenizer.json", tokenizer.vocab_size, (2,))
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False},
               "get_time": {"type": "object"}}

    def takes(text: str, parallel: bool) -> bool:
        rid = f"{fmt}-{parallel}-{len(text)}"
        matcher = table.matcher(rid, GrammarSpec("lark", calls_grammar(fmt, schemas, parallel)))
        try:
            for tok in tokenizer.encode(text, add_special_tokens=False):
                if matcher.is_stopped():        # complete before the text is
                    return False
                table.accept(rid, tok)
            return True
        except GrammarError:
            return False
        finally:
            table.release(rid)
    assert takes(format_calls(fmt, CALLS), parallel=True)
    assert not takes(format_calls(fmt, CALLS), parallel=False)       # one call only
    assert takes(format_calls(fmt, CALLS[:1]), parallel=False)
    assert not takes(format_calls(fmt, [("get_weather", {"town": "Paris"})]), parallel=True)
