"""What tests share that is not a test: stand-ins for processes (``fake_engine``, a stand-in engine for the
supervision tests; ``standin_cluster``, the router over the benchmark's stand-in engine), a real block
server in a child process (``block_server_proc``), builders of vLLM and ZeroMQ objects (``vllm_helpers``,
``zmq_helpers``) and process helpers (``helpers``). The tests themselves mirror the source tree; ``e2e/``
(real engines) and ``security/`` cross it."""
