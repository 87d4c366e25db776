"""Stop strings cut the streamed text; chat prompts come from the checkpoint's template or the
plain one."""

import json

import pytest

from moespec.serve.text import PLAIN_STOP, ChatTemplate, StopText, read_chat_template


class Letters:
    """A tokenizer double: token i is the i-th character of `alphabet`."""

    alphabet = "abcdefghijklmnopqrstuvwxyz ,\n:"

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)

    def ids(self, text):
        return [self.alphabet.index(c) for c in text]


def stream(text: str, stops: list[str], step: int = 1) -> tuple[list[str], bool, str]:
    """Feed `text` `step` characters at a time: (pieces sent, stopped, text after finish)."""
    letters = Letters()
    cut, pieces, stopped = StopText(letters, stops), [], False
    ids = letters.ids(text)
    for start in range(0, len(ids), step):
        piece, stopped = cut.add(ids[start : start + step])
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(cut.finish())
    return pieces, stopped, "".join(pieces)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_text_ends_before_the_first_stop_string_however_tokens_split_it(step):
    pieces, stopped, text = stream("hello world, says the end", ["says", "world"], step)
    assert stopped and text == "hello "


def test_without_a_stop_every_character_comes_out():
    pieces, stopped, text = stream("abc abd ab", ["abx"])
    assert not stopped and text == "abc abd ab"


def test_a_possible_stop_prefix_is_held_back_until_decided():
    letters = Letters()
    cut = StopText(letters, ["end"])
    assert cut.add(letters.ids("the e")) == ("the ", False)  # "e" may begin "end"
    assert cut.add(letters.ids("n")) == ("", False)  # "en" too
    assert cut.add(letters.ids("d")) == ("", True)
    assert cut.text == "the "


def test_held_back_text_is_released_when_it_is_not_a_stop():
    letters = Letters()
    cut = StopText(letters, ["end"])
    cut.add(letters.ids("the en"))
    assert cut.add(letters.ids("t")) == ("ent", False)


def test_plain_chat_template_and_its_implicit_stop():
    template = ChatTemplate(None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert template.render(messages) == "System: be brief\nUser: hi\nAssistant:"
    assert template.implicit_stops == [PLAIN_STOP] == ["\nUser:"]


def test_checkpoint_template_from_tokenizer_config(tmp_path):
    source = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    template = ChatTemplate(read_chat_template(tmp_path), {"eos_token": "</s>"})
    rendered = template.render([{"role": "user", "content": "hi"}])
    assert rendered == "<user>hi</s><assistant>"
    assert template.implicit_stops == []


def test_chat_template_jinja_file_wins_and_named_templates_pick_default(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"
    assert read_chat_template(tmp_path / "absent") is None


def test_a_template_that_raises_is_a_value_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_templates_run_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        template.render([{"role": "user", "content": "x"}])
