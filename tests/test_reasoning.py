"""A reasoning model's answer split into reasoning and content (server/reasoning.py), whole
and streamed, and what chat deltas and Responses items make of it; without a model."""
from __future__ import annotations

import pytest

from server.choice_stream import ChoiceDelta
from scheduler.sampling_params import ReasoningMarks
from server.reasoning import ReasoningSplitter, grammar_marks, resolve_parser, split_reasoning
from server.responses_events import ResponseEvents
from server.responses_wire import ResponseObject, ResponseUsage
from server.serving_chat import _pieces
from server.tool_parser import StreamedCalls

ANSWER = "<think>\nThe user wants a planet.\n</think>\n\nMars."


def streamed(style: str, text: str, size: int) -> tuple[str, str]:
    splitter = ReasoningSplitter(style)
    pieces = []
    for i in range(0, len(text), size):
        pieces += splitter.push(text[i:i + size])
    pieces += splitter.flush()
    return ("".join(t for k, t in pieces if k == "reasoning"),
            "".join(t for k, t in pieces if k == "content"))


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_think_text_is_reasoning_the_rest_content_however_it_streams(size):
    assert streamed("qwen3", ANSWER, size) == ("\nThe user wants a planet.\n", "Mars.")
    assert streamed("deepseek_r1", ANSWER, size) == ("\nThe user wants a planet.\n", "Mars.")
    # R1's template opened <think> in the prompt: the answer starts inside it
    assert streamed("deepseek_r1", "Hmm, Mars.</think> Mars.", size) == ("Hmm, Mars.", "Mars.")
    assert streamed("deepseek_r1", "still thinking <thi", size) == ("still thinking <thi", "")


@pytest.mark.parametrize("size", [1, 3, 100])
def test_qwen3_without_thinking_is_all_content(size):
    for text in ("Mars.", "  <b>Mars</b>", "<thin", "a < b </think> c"):
        assert streamed("qwen3", text, size) == ("", text)


def test_whole_answers_and_the_styles_a_server_picks():
    assert split_reasoning(None, ANSWER) == (None, ANSWER)
    assert split_reasoning("qwen3", "Mars.") == (None, "Mars.")
    assert split_reasoning("qwen3", ANSWER) == ("\nThe user wants a planet.\n", "Mars.")
    assert split_reasoning("qwen3", "<think></think>Mars.") == (None, "Mars.")
    assert resolve_parser("auto", "{% if x %}<think>{% endif %}") == "qwen3"
    assert resolve_parser("auto", "<|im_start|>") is None and resolve_parser("auto", None) is None
    assert resolve_parser("none", "<think>") is None
    assert resolve_parser("deepseek_r1", None) == "deepseek_r1"


def test_chat_deltas_carry_reasoning_then_content():
    calls, thinking = StreamedCalls(None), ReasoningSplitter("qwen3")
    pieces = []
    for i in range(0, len(ANSWER), 4):
        pieces += _pieces(calls, thinking, ANSWER[i:i + 4], False, True)
    pieces += _pieces(calls, thinking, "", True, True)
    reasoning = "".join(p.reasoning_content or "" for p in pieces)
    content = "".join(p.content or "" for p in pieces)
    assert (reasoning, content) == ("\nThe user wants a planet.\n", "Mars.")
    assert all(p.model_dump().keys() in ({"content"}, {"reasoning_content"}) for p in pieces)
    hidden = _pieces(StreamedCalls(None), ReasoningSplitter("qwen3"), ANSWER, True, False)
    assert "".join(p.content or "" for p in hidden) == "Mars."
    assert not any(p.reasoning_content for p in hidden)


def test_responses_put_the_reasoning_item_before_the_message():
    usage = ResponseUsage(input_tokens=1, input_tokens_details={}, output_tokens=1,
                          total_tokens=2)
    built = ResponseEvents(ResponseObject(id="resp_1", created_at=0, model="m"), None,
                           reasoning="qwen3")
    events = built.start()
    for i in range(0, len(ANSWER), 3):
        events += built.push(ChoiceDelta(0, ANSWER[i:i + 3]))
    events += built.push(ChoiceDelta(0, "", (), "stop")) + built.finish("stop", usage)
    reasoning, message = built.response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text == "\nThe user wants a planet.\n"
    assert built.response.output_text() == "Mars."
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.content_part.added")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] \
        == [0, 1]
    # an answer with no text at all is still an empty message
    empty = ResponseEvents(ResponseObject(id="resp_2", created_at=0, model="m"), None,
                           reasoning="qwen3")
    empty.start()
    empty.push(ChoiceDelta(0, "", (), "stop"))
    empty.finish("stop", usage)
    assert [i.type for i in empty.response.output] == ["message"]


def test_messages_put_a_thinking_block_before_the_text():
    from server.messages_events import MessageEvents, stop_reason
    built = MessageEvents({"id": "msg_1", "content": [], "usage": {}}, None, "qwen3")
    events = built.start()
    for i in range(0, len(ANSWER), 5):
        events += built.push(ChoiceDelta(0, ANSWER[i:i + 5]))
    events += built.push(ChoiceDelta(0, "", (), "stop"))
    events += built.finish("stop", None, {"output_tokens": 3})
    assert built.message["content"] == [
        {"type": "thinking", "thinking": "\nThe user wants a planet.\n", "signature": ""},
        {"type": "text", "text": "Mars."}]
    kinds = [name for name, _ in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [p["index"] for name, p in events if name == "content_block_start"] == [0, 1]
    deltas = {p["delta"]["type"] for name, p in events if name == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta"}
    assert built.message["stop_reason"] == "end_turn"
    assert stop_reason("length", None, True) == "max_tokens"
    assert stop_reason("stop", "###", False) == "stop_sequence"
    assert stop_reason("stop", None, True) == "tool_use"


def _think_tokenizer(template: str):
    """A word-level tokenizer whose <think> and </think> are single tokens (as Qwen3's)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from server.tokenizer import Tokenizer
    words = ["<unk>", "<think>", "</think>", "yes", "no"]
    backend = HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return Tokenizer(backend, chat_template=template)


@pytest.mark.parametrize("parser, template, marks", [
    ("auto", "{{ '<think>' }}", ReasoningMarks(2, 1)),     # qwen3: the answer may open it
    ("deepseek_r1", "", ReasoningMarks(2)),                # the prompt opened it
    ("none", "{{ '<think>' }}", None),
    ("auto", "no tags", None),                             # auto without <think>: no parser
])
def test_a_chat_grammar_leaves_the_thinking_span_free_where_the_parser_splits_it(
        parser, template, marks):
    from server.context import ServerContext
    ctx = ServerContext(None, _think_tokenizer(template), served_model_name="m",
                        reasoning_parser=parser)
    assert ctx.reasoning_marks == marks
    # the span's bounds must be single tokens: else the grammar holds the whole answer
    assert grammar_marks("qwen3", None, 2) is None and grammar_marks("qwen3", 1, None) is None
    assert grammar_marks("deepseek_r1", None, 2) == ReasoningMarks(2)


def test_the_thinking_span_opens_on_the_first_token_only_and_ends_at_its_close():
    qwen3, r1 = ReasoningMarks(close_id=2, open_id=1), ReasoningMarks(close_id=2)
    assert not qwen3.thinking([]) and qwen3.thinking([1, 7]) and not qwen3.thinking([7, 1])
    assert not qwen3.thinking([1, 7, 2]) and r1.thinking([]) and r1.thinking([7])
    assert not r1.thinking([7, 2, 3])


def test_chat_choices_carry_the_span_and_completions_do_not():
    from types import SimpleNamespace

    from scheduler.sampling_params import GrammarSpec
    from server.context import ServerContext
    from server.protocol import ChatCompletionRequest
    from server.serving import OpenAIServing

    engine = SimpleNamespace(max_waiting=8, max_model_len=64, is_ready=True)
    serving = OpenAIServing(ServerContext(engine, _think_tokenizer("<think>"),
                                          served_model_name="m"))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "yes"}], n=2)
    choice = GrammarSpec("regex", "(yes|no)")

    def marks(**kw):
        return {s.spec.params.reasoning for s in
                serving.generation(request, [[3]], "id", "messages", **kw).streams}
    assert marks(grammar=choice, chat=True) == {ReasoningMarks(2, 1)}
    assert marks(grammar=choice) == {None}           # a completion: no parser splits it
    assert marks(chat=True) == {None}                # no grammar: nothing to hold back
