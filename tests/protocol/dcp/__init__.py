"""Tests of the DCP wire, consumer and producer."""
