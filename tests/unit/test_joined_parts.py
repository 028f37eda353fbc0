"""A message's content parts become the one text its chat template reads, joined as llama.cpp joins them
(common/chat.cpp): a newline between two texts, none next to an image's marker, two in the message the
answer continues (an assistant prefill, rendered by llama.cpp's render_content)."""

from daemon import protocol as p
from daemon.worker.prompt_text import joined_parts

MARK = "<__media__>"


def text(value: str) -> p.ChatPart:
    return p.ChatPart("text", text=value)


IMAGE = p.ChatPart("image", image=b"png")


def test_texts_are_joined_by_a_newline_and_a_continued_message_by_two():
    assert joined_parts([text("Wh"), text("ill")], MARK) == "Wh\nill"
    assert joined_parts([text("Wh"), text("ill")], MARK, continued=True) == "Wh\n\nill"
    assert joined_parts([text("only")], MARK) == "only"


def test_no_newline_next_to_an_images_marker():
    assert joined_parts([text("look:"), IMAGE, text("what is it?")], MARK) == f"look:{MARK}what is it?"
    assert joined_parts([IMAGE, IMAGE, text("a"), text("b")], MARK) == f"{MARK}{MARK}a\nb"


def test_an_empty_first_text_adds_no_newline():
    assert joined_parts([text(""), text("x")], MARK) == "x"
    assert joined_parts([], MARK) == ""
