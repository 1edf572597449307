"""The ``tandem`` command line, and nothing else: each package owns its sub-commands (``node_agent.cli``,
``router.cli``, ``router.admission.cli``, ``telemetry.cli``, ``infra.cli``, ``bench.cli``) and
``tandem.cli`` mounts them. Start it as ``tandem ...`` (the console script) or ``python -m tandem ...``."""
