"""Speed, memory and solver-statistics measurements. Each script writes ``benchmarks/results/<name>.json``."""
