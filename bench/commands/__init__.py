"""The ``tandem bench`` commands, one module per group of benchmarks (``compare``, ``kv``, ``service``);
``bench.cli`` builds the Typer app and registers them."""
