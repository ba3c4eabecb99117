"""What runs in a worker process: its entry points (:mod:`.process`, named for the engine by
:mod:`.calls`), the model runner and where it places the model (:mod:`.runner`,
:mod:`.placement`), the models (:mod:`.models`), sampling, grammars, decode graphs, checkpoint
reading and the tensor-parallel group. Imports torch and the kernels, never trio (the step
server is a plain socket loop), so a worker starts light."""
