"""A conversation as the model's token ids, turn by turn.

The history is kept as the ids the model saw and generated (Conversation.token_ids), never
as text tokenized again: tokenizing a reply's text can give other ids than the ones
generated (" Paris" as one token or two), and then neither the model's view of its own
history nor the SSD cache's prefix would match. So a new turn appends only the ids of the
text the chat template puts after the history: the end of the last turn's line and the new
user message, then the generation prompt. Training and scoring render questions with the
same template (worker/dataset/build.py qa_prompt_ids), so a tuned model is asked as it
was taught."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def end_of_turn_id(tokenizer) -> int:
    """The token that ends a reply (SmolLM2: <|im_end|>, which is also its EOS)."""
    return int(tokenizer.eos_token_id)


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_ids(tokenizer, history_ids: list[int], messages: list[dict[str, str]]) -> list[int]:
    """The ids of the whole conversation up to the new reply: `history_ids` unchanged (they
    end with the last reply's end-of-turn token), then the new user turn (messages[-1]) and
    the generation prompt. `messages` are the conversation's turns as text, the new one
    last. Without a history (or when the template renders the history differently once a
    turn is added, which no common template does) the whole conversation is rendered."""
    full = _render(tokenizer, messages, True)
    if not history_ids or len(messages) < 2:
        return _ids(tokenizer, full)
    before = _render(tokenizer, messages[:-1], False)
    eot = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    cut = before.rfind(eot)
    if history_ids[-1] != end_of_turn_id(tokenizer) or cut < 0 or not full.startswith(before):
        log.warning("chat template does not extend the history; rendering it again")
        return _ids(tokenizer, full)
    # What the template puts after the end-of-turn token (SmolLM2: "\n"), then the new turn.
    return [*history_ids, *_ids(tokenizer, before[cut + len(eot):] + full[len(before):])]


def history_after(prompt_ids: list[int], generated: list[int], tokenizer) -> list[int]:
    """The conversation's ids after a reply: the prompt, the generated ids, and the
    end-of-turn token when the reply stopped without one (the token limit, or Stop), so
    that the next turn starts on a line of its own as the template has it."""
    eot = end_of_turn_id(tokenizer)
    ids = [*prompt_ids, *generated]
    if not generated or generated[-1] != eot:
        ids.append(eot)
    return ids
