"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), sans-IO:
request bodies read into the same ``GenerationRequest`` the OpenAI endpoints make
(:mod:`.requests`), engine outputs shaped into a message or its event stream
(:mod:`.messages`), and errors in Anthropic's shape (:mod:`.errors`). The request readers,
the chat output machine (reasoning, tool calls) and the tool plan are the OpenAI protocol's
(:mod:`triode.frontend.openai`), so both APIs render, constrain and parse a chat alike. Like
that package it never imports the server or the routes."""
