"""Plain data passed between ingest, dataset building, training and evaluation.
No torch here: these are the contract between the worker's modules."""

from __future__ import annotations

from dataclasses import dataclass, field

# Label value the loss skips: prompt tokens of a question-answer example, and padding (the
# trainer pads labels with it; worker.training.engines sums the loss over the rest).
IGNORE_INDEX = -100


def text_example(ids: list[int]) -> dict[str, list[int]]:
    """A causal-LM training example: the loss on every token."""
    return {"input_ids": ids, "labels": list(ids)}


def answer_example(ids: list[int], n_prompt: int) -> dict[str, list[int]]:
    """A question-answer training example: no loss on the first `n_prompt` tokens (the
    question), the loss on the answer only."""
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * n_prompt + ids[n_prompt:]}


@dataclass
class SourceDoc:
    """One extracted document version, as training sees it."""

    name: str  # as the user named it (display only)
    sha256: str  # content hash of the original file
    text: str  # extracted plain text; "" for a pure Q&A file
    qa_pairs: list[tuple[str, str]] = field(default_factory=list)  # (question, answer)
    version: int = 1  # the document's version in its project (an edited file is a new one)


@dataclass
class Probe:
    """A knowledge-recall probe: the model sees `prompt`, counts if its answer holds `answer`."""

    prompt: str
    answer: str
    source: str  # document name
    sentence: str = ""  # the source sentence, shown on the score card
    # The same fact asked as a question in chat, in a phrasing kept out of training
    # (worker.dataset.questions); "" when none could be made.
    question: str = ""
    template: str = ""  # which question template made `question`
    # How `question` is put (app.contract.scores.QUESTION_KINDS): "other words", "reverse"
    # or "table". Reverse and table questions have no sentence completion (prompt "").
    kind: str = ""


@dataclass
class DatasetSplit:
    """Everything one training job needs, built once, deterministically from the seed."""

    # {"input_ids": list[int], "labels": list[int]} (IGNORE_INDEX: no loss), made by
    # text_example / answer_example
    train_examples: list[dict]
    heldout_chunks: list[str]  # document text kept out of training, for perplexity
    heldout_qa: list[tuple[str, str]]  # user Q&A pairs kept out of training
    probes: list[Probe]
    stats: dict = field(default_factory=dict)  # n_train_examples, n_train_tokens, ...
