"""The protocol runners of `stream` and `capture` (cli/live.py RUNNERS): they build the settings, call the capture library or the live session, and print."""
