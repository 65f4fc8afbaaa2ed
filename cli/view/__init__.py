"""What the commands print: tables, rows of DCP frames, progress and the run summary."""
