"""`mars chat` input: \"\"\" blocks and pasted lines are one message (mars_local.chat.session.read_message, pure).

The CLI and a real terminal: tests/test_chat_template_option.py.
"""

from __future__ import annotations

import pytest

from mars_local.chat.session import Message, read_message


class Keyboard:
    """``input`` over scripted lines: records the prompts; a line given as
    (text, True) arrived together with the next one (a paste), so ``waiting``
    says True after it; EOFError after the last line, KeyboardInterrupt
    for the line ``^C``."""

    def __init__(self, *lines):
        self.lines = [ln if isinstance(ln, tuple) else (ln, False) for ln in lines]
        self.prompts: list[str] = []
        self.pasted = False

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        text, self.pasted = self.lines.pop(0)
        if text == "^C":
            raise KeyboardInterrupt
        return text

    def waiting(self) -> bool:
        return self.pasted

    def messages(self) -> list[Message]:
        out = []
        while True:
            try:
                out.append(read_message(self, self.waiting))
            except EOFError:
                return out


def texts(*lines) -> list[str]:
    return [m.text for m in Keyboard(*lines).messages()]


def test_each_typed_line_is_a_message():
    kb = Keyboard("hello", "", "/stats", "bye")
    assert kb.messages() == [Message("hello"), Message(""), Message("/stats", True), Message("bye")]
    assert kb.prompts == [">>> "] * 5


def test_a_triple_quote_block_is_one_message():
    kb = Keyboard('"""', "first", "", "  indented", "/stats is text here", '"""', "after")
    assert kb.messages() == [Message("first\n\n  indented\n/stats is text here"), Message("after")]
    assert kb.prompts == [">>> "] + ["... "] * 5 + [">>> ", ">>> "]


@pytest.mark.parametrize("lines,want", [
    (['"""one line"""'], "one line"),
    (['"""first', 'last"""'], "first\nlast"),
    (['"""first', "middle", '"""'], "first\nmiddle"),
    (['"""', 'last"""'], "last"),
    (['""""""'], ""),
    (['"""""""'], '"'),  # opens with """, then a quote and a closing """
    (['""""', 'x"""'], '"\nx'),
    (['"""', '"""'], ""),
])
def test_block_forms(lines, want):
    assert texts(*lines) == [want]


def test_quotes_elsewhere_are_text():
    assert texts('say """hi"""', 'a"""') == ['say """hi"""', 'a"""']


def test_a_block_is_never_a_command():
    assert Keyboard('"""/bye"""').messages() == [Message("/bye", False)]
    assert Keyboard('"""', "/bye", '"""').messages() == [Message("/bye", False)]


def test_the_end_of_input_ends_an_open_block():
    assert texts('"""', "a", "b") == ["a\nb"]
    assert texts('"""') == [""]
    with pytest.raises(EOFError):
        read_message(Keyboard())


def test_ctrl_c_drops_the_block_being_typed():
    kb = Keyboard('"""', "draft", "^C", "fresh")
    with pytest.raises(KeyboardInterrupt):
        read_message(kb, kb.waiting)
    assert read_message(kb, kb.waiting) == Message("fresh")


def test_pasted_lines_are_one_message():
    kb = Keyboard(("line one", True), ("line two", True), "line three", "typed later")
    assert kb.messages() == [Message("line one\nline two\nline three"), Message("typed later")]
    assert kb.prompts == [">>> ", "... ", "... ", ">>> ", ">>> "]
    # a pasted command is text: only a typed line is a command
    assert Keyboard(("/reset", True), "hello").messages() == [Message("/reset\nhello", False)]
    # a paste holding a block
    assert texts(("intro", True), ('"""', True), ("a", True), ('b"""', True), "tail") == ["intro\na\nb\ntail"]


def test_a_read_with_several_lines_is_one_message():
    """A bracketed paste: readline returns the pasted lines at once."""
    assert Keyboard("one\ntwo\n").messages() == [Message("one\ntwo")]
    assert Keyboard("/reset\nhello").messages() == [Message("/reset\nhello", False)]
    assert texts('"""\na\n', 'b"""') == ["a\nb"]
    assert texts('x\n"""\ny', 'z"""') == ["x\ny\nz"]
