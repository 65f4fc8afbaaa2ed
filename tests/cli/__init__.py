"""Tests of the commands as a user runs them."""
