"""Tools for lightmem's own tests and benchmarks (a measuring harness, simulated transports);
users do not need them to train."""
