"""Pure algorithm functions: losses, advantages, packing, staleness."""
