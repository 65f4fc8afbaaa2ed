"""Helpers the tests share: generated captures, the CLI runner, recorded vectors, hostile servers, real Synapse and Redis, tshark."""
