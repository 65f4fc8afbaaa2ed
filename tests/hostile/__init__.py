"""Hostile peers, full disks, signals and unsafe SQL."""
