"""The loss on a practice question's words too, not only on its answer (issue 13's
"answer-only loss", measured against its opposite).

A job's practice questions and question-answer pairs are trained with the loss on the answer
only (worker.dataset.corpus.answer_example): the model is taught to write answers, never the
questions. With `question_loss` the recall experiment also puts the loss on the question
(the user's turn and the template tokens around it; not the system prompt, the same in every
example): the model then also learns to write the questions, each of which names the fact's
subject, its document and the words around it (instruction modelling: Shi et al. 2024,
"Instruction Tuning With Loss Over Instructions", found it helps most where examples are few
and answers short).
"""

from __future__ import annotations

from worker.dataset.build import qa_prompt_ids
from worker.dataset.corpus import IGNORE_INDEX


def system_prefix(tokenizer) -> list[int]:
    """The tokens every chat prompt starts with, up to its question: the system prompt and
    the user turn's header."""
    a = qa_prompt_ids(tokenizer, "Which is it?")
    b = qa_prompt_ids(tokenizer, "Where does the 7 go?")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def with_question_loss(tokenizer, examples: list[dict]) -> list[dict]:
    """`examples` with the loss on each question-answer example's question too (from the end
    of the system prefix); text examples, and any example that does not start with the
    prefix, as they were."""
    prefix = system_prefix(tokenizer)
    n = len(prefix)
    out = []
    for e in examples:
        ids, labels = e["input_ids"], e["labels"]
        first = next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels))
        if labels == ids or first <= n or ids[:n] != prefix:
            out.append(e)
            continue
        out.append(e | {"labels": [IGNORE_INDEX] * n + ids[n:first] + labels[first:]})
    return out
