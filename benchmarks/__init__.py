"""lossbeat's overhead benchmarks: ``python benchmarks/run.py [--quick]`` writes RESULTS.md."""
