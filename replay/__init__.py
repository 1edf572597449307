"""The replay of a trace against a cluster over SSE (being written: ``tandem replay``)."""
