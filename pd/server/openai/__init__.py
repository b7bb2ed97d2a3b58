"""The OpenAI surface of the server: the API's request and response models (``protocol``,
``responses``), tool calls (``tools``, ``tool_stream``), structured outputs (``structured``)
and logprobs in OpenAI's shapes (``logprobs``). What a client sends and gets back; nothing here
knows about connections, admission or the engine."""
