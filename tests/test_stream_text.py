"""The streaming hold-back rules: whatever the split into deltas, the streamed content is the final content."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ajet.chat_template import parse_tool_calls
from ajet.proxy.stream import IncrementalContent, cut_at_stop

PIECES = ["Hello", " ", "\n", "<tool", "_call>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}',
          "DO", "NE", "DONE", "é", "\ufffd", "x", "  ", "<", "tool", "42."]


def final_content(text: str, parse_tools: bool, stop: tuple[str, ...]) -> str:
    """What the non-streaming answer holds (as the proxy computes it)."""
    text = cut_at_stop(text, stop) if stop else text
    return (parse_tool_calls(text)[0] or "") if parse_tools else text


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.booleans(), st.sampled_from([(), ("DONE",), ("\n\n", "x")]))
def test_deltas_concatenate_to_the_final_content(pieces, parse_tools, stop):
    inc = IncrementalContent(parse_tools, stop)
    text, sent = "", ""
    for p in pieces:
        text += p
        sent += inc.update(text)
    final = final_content(text, parse_tools, stop)
    assert final.startswith(sent)                      # nothing sent early ever has to be taken back
    assert sent + inc.finish(final) == final


def test_content_before_a_tool_call_streams_and_the_tag_is_held():
    inc = IncrementalContent(parse_tools=True)
    assert inc.update("Let me") == "Let me"
    assert inc.update("Let me compute <tool") == " compute"    # "<tool" may open a tool call: held
    assert inc.update("Let me compute <tool_call>\n{") == ""   # inside a tool call: nothing streams
    assert inc.finish("Let me compute") == ""


def test_stop_string_prefix_is_held_and_the_stop_string_cut():
    inc = IncrementalContent(parse_tools=False, stop=("DONE",))
    assert inc.update("six DO") == "six "
    assert inc.update("six DONE") == ""
    assert inc.finish("six ") == ""


def test_partial_utf8_character_is_held():
    inc = IncrementalContent(parse_tools=False)
    assert inc.update("caf\ufffd") == "caf"
    assert inc.update("café") == "é"
