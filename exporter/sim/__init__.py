"""A simulated continuous-batching inference engine, for the demo, tests and benchmarks."""
