"""A conversation's token ids, turn by turn (worker/chat/prompt.py), and the reply's text
as it grows (worker/chat/generate.py TextStream), with SmolLM2's real tokenizer."""

from __future__ import annotations

from worker.chat.prompt import end_of_turn_id, history_after, turn_ids
from worker.chat.text import TextStream


def _rendered(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_follow_up_extends_the_history_ids_exactly(smol_tokenizer):
    tok = smol_tokenizer
    turns = [{"role": "user", "content": "How many days of annual leave do I get?"}]
    first = turn_ids(tok, [], turns)
    assert first == _rendered(tok, turns)
    reply = "You get 25 days, plus public holidays."
    generated = [*tok(reply, add_special_tokens=False)["input_ids"], end_of_turn_id(tok)]
    history = history_after(first, generated, tok)
    assert history == [*first, *generated]  # ended by the model: nothing added
    turns += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And sick?"}]
    second = turn_ids(tok, history, turns)
    assert second[: len(history)] == history  # the history's ids, unchanged
    assert second == _rendered(tok, turns)  # and the template's own rendering of it all


def test_the_history_keeps_the_generated_ids_not_a_new_tokenization(smol_tokenizer):
    tok = smol_tokenizer
    turns = [{"role": "user", "content": "Say hello"}]
    first = turn_ids(tok, [], turns)
    # Ids a model may generate that tokenize differently as text: "hel" + "lo" for "hello".
    odd = [*tok("hel", add_special_tokens=False)["input_ids"],
           *tok("lo", add_special_tokens=False)["input_ids"]]
    assert tok.decode(odd) == "hello" and odd != tok("hello", add_special_tokens=False)["input_ids"]
    history = history_after(first, odd, tok)  # stopped without an end of turn: one is added
    assert history == [*first, *odd, end_of_turn_id(tok)]
    turns += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "Again"}]
    second = turn_ids(tok, history, turns)
    assert second[: len(history)] == history


def test_text_is_handed_on_only_when_a_character_is_whole(smol_tokenizer):
    tok = smol_tokenizer
    text = "Café in 蘇州 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stream = TextStream(tok)
    pieces = [stream.add(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # 蘇 and 州 came as byte tokens
