"""Plain data passed between ingest, dataset building, training and evaluation.
No torch here: these are the contract between the worker's modules."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class DatasetSplit:
    """Everything one training job needs, built once, deterministically from the seed."""

    train_examples: list[dict]  # {"input_ids": list[int], "labels": list[int]} (-100 = no loss)
    heldout_chunks: list[str]  # document text kept out of training, for perplexity
    heldout_qa: list[tuple[str, str]]  # user Q&A pairs kept out of training
    probes: list[Probe]
    stats: dict = field(default_factory=dict)  # n_train_examples, n_train_tokens, ...
