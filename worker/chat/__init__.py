"""Chatting with a model version: the conversation as token ids, the reply token by token,
the models kept loaded, the chat task's body, and (`kv`) the bridge between transformers'
KV cache and the SSD store of offload/kvcache."""
