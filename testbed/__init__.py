"""Network-namespace topologies, scenarios, fault injection and benchmarks."""
