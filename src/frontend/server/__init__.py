"""The server's life and deployment: the quart-trio app and its lifespan (:mod:`.factory`),
the engine's states and the drain on shutdown (:mod:`.lifecycle`), settings from flags and
``TRIODE_*`` variables (:mod:`.settings`), API keys (:mod:`.auth`), Prometheus metrics
(:mod:`.metrics`) and ``triode serve`` under hypercorn (:mod:`.serve`). The routes
(:mod:`triode.frontend.routes`, with :mod:`~triode.frontend.routes.generation` running one HTTP
request as engine requests) join it to the protocol (:mod:`triode.frontend.openai`)."""
