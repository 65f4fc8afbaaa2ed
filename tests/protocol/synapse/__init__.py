"""Tests of the Synapse protocol against real servers."""
