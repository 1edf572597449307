"""The tandem connector's data path on caches in any device's memory (GPU or host): the engine's
paged cache seen as parts with a pinned host mirror (``staging``), the copies between them behind a
small backend interface with a CPU and a CUDA implementation (``backend``), CUDA IPC handles for a
peer on the same host (``ipc``), and the host tier's offload and load through pinned memory
(``host_tier``). The block server and the puller are today's, working on the host mirror."""
