"""External services started as processes (for the simulator, the benchmarks and the tests).

The sans-IO core never starts a process; what does lives here, outside its top level.
"""
