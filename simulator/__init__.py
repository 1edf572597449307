"""SIMULATOR (labelled as one everywhere): a fleet of simulated nodes for planning; see block_pool."""
