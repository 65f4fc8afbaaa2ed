"""The Spark engine: the only package that imports pyspark (engine.py, lazily), its Arrow side, the SQL plans, the class-data archive and the warm Spark Connect server."""
