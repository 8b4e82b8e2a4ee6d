"""The downloads of a finished job: the model card (`card`), the adapter and merged model
zips (`writers`), GGUF files for llama.cpp / Ollama (`gguf`), all read from a TensorSource
(`tensor_source`) so that a model larger than memory exports one block at a time."""
