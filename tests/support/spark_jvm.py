"""The JVM options of every Spark JVM the suite starts (tests/conftest.py puts them in
SPARK_SUBMIT_OPTS and SPARK_DAEMON_JAVA_OPTS; the standalone cluster test gives them to its
executors): the C1 compiler only and the serial collector. The suite's JVMs run for seconds
to minutes on small data, where C2 compilations and parallel GC threads are most of the
JVM's CPU: a warm DCP replay of 200 events on the shared session took 23-27 CPU-s with the
defaults and 12-15 with these, the session's start 25 and 12 (2 cores, docs/TESTING.md).
They change how fast the JVM runs code, not what the code computes."""

JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
