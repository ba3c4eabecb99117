"""The OpenAI wire protocol, sans-IO where it can be: request bodies decoded into typed
requests and engine sampling parameters (:mod:`.request_body`, :mod:`.requests`,
:mod:`.structured_request`, :mod:`.tool_request`), engine outputs shaped into responses and
stream chunks (:mod:`.responses`, :mod:`.chat_output`, :mod:`.logprobs`, :mod:`.sse`), tool
calls found in text (:mod:`.tool_parsers`), errors in OpenAI's shape (:mod:`.errors`), and the
engine requests one HTTP request makes (:mod:`.generation`). It imports the engine's public
types, never the server (:mod:`triode.frontend.server`) or quart."""
