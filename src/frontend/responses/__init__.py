"""OpenAI's Responses API (``/v1/responses``), sans-IO: a body's items read into the chat
messages templates take and the same ``GenerationRequest`` chat completions make
(:mod:`.requests`), engine outputs shaped into a response and its typed event stream
(:mod:`.output`), and the bounded in-memory store behind ``store``, ``previous_response_id``,
``GET`` and cancel (:mod:`.store`). The chat output machine, tool plan and request readers
are the OpenAI protocol's (:mod:`triode.frontend.openai`). It never imports the server or
the routes."""
