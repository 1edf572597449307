"""decode_nodes."""
