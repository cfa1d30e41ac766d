"""Seeing what collectives did: the flight recorder and its analyser."""
