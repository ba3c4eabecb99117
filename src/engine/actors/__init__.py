"""The async engine's trio actors in the engine process: intake (:mod:`.intake`), the core's
driver (:mod:`.scheduler`), the output side (:mod:`.output`, :mod:`.streams`), and the workers'
supervision (:mod:`.supervisor`) over a worker group (:mod:`.worker_group`; the real one is
:mod:`.workers`, its processes started by :mod:`.worker_spawn`) reached through step channels
(:mod:`.step_channel`). Imports trio and the core, never torch or the worker code (it names
the workers' entry points through :mod:`triode.engine.worker.calls`); checked by mypy,
strictly."""
