"""dcptool.serve: running `serve`'s servers without the CLI (runner.py): the signals that
end one cleanly, the event loop, and the playback of a recorded capture as a live DCP
producer or Synapse server. The servers themselves are protocol/'s; cli/servers/ parses
the options and calls this.
"""
