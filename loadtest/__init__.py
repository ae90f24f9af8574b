"""Load testing: stub and simulated replicas, load generators, benchmarks."""
