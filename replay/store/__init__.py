"""dcptool.replay.store: the capture store. Everything that writes, finds, reads and resumes
captures: the schema (the one definition of the columns), the Arrow batch builders for both
protocols, the segment writer with its in-progress format and crash recovery, the reader, and
the resume state. The replay engines (replay/local/engine.py, replay/spark/engine.py) import from here; the
store never imports an engine."""

# the Parquet codecs a finished segment may use (no pyarrow import here: `capture --help` lists
# them); "lz4" is Parquet's LZ4_RAW, for speed over size
COMPRESSIONS = ("zstd", "lz4", "snappy", "none")
