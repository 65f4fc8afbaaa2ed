"""Helpers the tests share (docs/TESTING.md, "Layout of tests/"): paths and ports, the
in-memory DCP pair, servers (ours on port 0, hostile peers, real Synapse and Redis), live
captures without sleeps, rows and captures built by hand or generated, the REPLAY.md oracle,
recorded vectors and tshark. Tests import helpers from here, never from another test module."""
