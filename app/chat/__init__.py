"""Chat with a model version: conversations and their messages (models.py), what the pages
do with them (service.py) and how a reply's Markdown is shown (markdown.py). The replies
are written by the chat worker (worker/chat/); this side never imports torch."""
