"""Tests of the capture store, the engines and the checks."""
