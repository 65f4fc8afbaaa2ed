"""Tests of dcptool.protocol."""
