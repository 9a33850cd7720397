"""The testbed library: corrupted datasets, evaluation protocols, the backprop baselines, reports
and what every benchmark writes (``eva0_edge.bench.testbed``); the shipped ``eval`` / ``bench``
tools and the summaries of the Makefile targets are its users in ``eva0_edge.bench``."""
