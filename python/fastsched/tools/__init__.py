"""Tools around the server that are not part of a serving process: benchmarks,
the capacity planner, the simulator, the live ``top`` view and the tiny test
model generator."""
