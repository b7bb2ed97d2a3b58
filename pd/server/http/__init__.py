"""The HTTP shell of the server: what stands between a connection and an endpoint, and how an
answer goes back. The listener under uvicorn (``listener``), the ASGI middleware (``middleware``:
write timeouts, catch-all, auth, body limits), API keys and their roles (``auth``), per-key
limits (``key_limits``), admission control (``admission``), errors in OpenAI's shape
(``errors``), and SSE streaming to slow readers (``streaming``, ``stream_buffer``)."""
