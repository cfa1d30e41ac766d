"""Runnable examples: ``python -m numcoll.examples.data_parallel``."""
