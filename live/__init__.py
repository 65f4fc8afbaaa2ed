"""dcptool.live: what a live run shows while it runs, without the CLI (no click, no rich).

The rows of `stream` as frames and lines cross the wire (dcp_rows.py: the DCP tap's rows;
synapse_rows.py: every Synapse line as a row), the standard output they go through when a
reader may stop reading (stdout_pipe.py), which rows `stream` prints (view_filter.py), the
plain-text tables every command prints on a terminal or into a pipe (table.py, its text
wrapping text_wrap.py), and the numbers of a capture's live progress (progress.py). It uses the capture library (capture/: one tap and one set of settings for
`stream` and `capture`), replay/'s row decoders and protocol/; cli/ draws and prints.
"""
