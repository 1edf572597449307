"""prefill_nodes."""
