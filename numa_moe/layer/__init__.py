"""The layers that compute: the kernels' Python entry points, the ExpertStore that loads
a checkpoint into interleaved memory, the worker pools, MoELayer and its torch op (found
through the registry), and decode attention over node-split KV caches. Imports
checkpoints, placement and below."""
