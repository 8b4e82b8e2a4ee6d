"""The Celery tasks the web app sends by name and the worker runs, and their queues."""

from __future__ import annotations

INGEST_QUEUE = "ingest"
TRAIN_QUEUE = "train"
CHAT_QUEUE = "chat"  # one reply at a time, the models kept loaded (worker/chat/)


def node_queue(host: str) -> str:
    """The queue only the train workers of machine `host` consume (on top of TRAIN_QUEUE), so
    that a part of a job can be sent to that machine."""
    return f"node.{host}"


def node_host(node: str) -> str:
    """The machine part of a Celery node name ("train@box2" -> "box2"): what node_queue
    takes (workers are started as `-n train@%h`, or with DOCTUNE_NODE_NAME in docker)."""
    return node.split("@", 1)[-1]


INGEST_TASK = "doctune.ingest_document"  # (document id)
TRAIN_TASK = "doctune.train_job"  # (job id)
CHAT_TASK = "doctune.chat_reply"  # (chat message id)
CHAT_FORGET_TASK = "doctune.chat_forget"  # (job id or None, the conversation's token ids)
# (project id, the settings the dataset is planned with): app.contract.dataset_plan
PLAN_TASK = "doctune.plan_dataset"
# (job id, rank spec path, rendezvous endpoint, run id, node count): this machine's training
# ranks of a job that runs on several machines; sent to that machine's node_queue.
TRAIN_RANKS_TASK = "doctune.train_ranks"
# (the first stage's TCPStore host:port, the chat worker's node name): the second stage of a
# chat on two machines (worker/chat/tail.py); sent to that machine's node_queue.
CHAT_STAGE_TASK = "doctune.chat_stage"

ROUTES = {INGEST_TASK: {"queue": INGEST_QUEUE}, TRAIN_TASK: {"queue": TRAIN_QUEUE},
          CHAT_TASK: {"queue": CHAT_QUEUE}, CHAT_FORGET_TASK: {"queue": CHAT_QUEUE},
          PLAN_TASK: {"queue": INGEST_QUEUE}}
