"""Benchmark commands (``statecore bench ...``). They print numbers; tests never time them."""
