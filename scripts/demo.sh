#!/usr/bin/env bash
# `make demo`: start the built-in DCP producer, stream a few thousand changes from it and
# show them, capture them to Parquet, inspect the capture, replay it in-process and on a
# local Spark session (same checksums), then stop the producer. Everything runs on 127.0.0.1 on a free port.
set -euo pipefail
cd "$(dirname "$0")/.."
DCPTOOL="${DCPTOOL:-.venv/bin/dcptool}"
PY="${PY:-.venv/bin/python}"
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== dcptool serve dcp: 64 vbuckets, 5000 documents, 200 live updates/s"
"$DCPTOOL" serve dcp --port 0 --vbuckets 64 --items 5000 --rate 200 --seed 1 \
  >"$WORK/server.out" 2>"$WORK/server.err" &
SERVER_PID=$!
for _ in $(seq 1 100); do
  [[ -s "$WORK/server.out" ]] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.err" >&2; exit 1; }
  sleep 0.1
done
ADDR="$("$PY" -c 'import json,sys; print(json.loads(sys.stdin.readline())["listening"])' <"$WORK/server.out")"
URL="couchbase://$ADDR/default"
echo "   listening on $ADDR"

echo
echo "== dcptool stream $URL --vbuckets 0-1 --format table --max-messages 40"
"$DCPTOOL" stream "$URL" --vbuckets 0-1 --format table --max-messages 40

echo
echo "== dcptool stream $URL --format jsonl  (every vbucket up to now, counted by op)"
"$DCPTOOL" stream "$URL" --format jsonl >"$WORK/stream.jsonl"
"$PY" - "$WORK/stream.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ops = collections.Counter((r["direction"], r["op"]) for r in rows)
for (d, op), n in sorted(ops.items(), key=lambda x: -x[1]):
    print(f"   {d:>3} {op:<18} {n:>7}")
items = [r for r in rows if r["op"] in ("mutation", "deletion", "expiration")]
print(f"   {len(items)} changes from {len({r['vbucket'] for r in items})} vbuckets")
PY

echo
echo "== dcptool capture $URL -o $WORK/caps  (every frame, both directions, into Parquet)"
"$DCPTOOL" capture "$URL" -o "$WORK/caps" --quiet

echo
echo "== dcptool inspect $WORK/caps"
"$DCPTOOL" inspect "$WORK/caps" | head -n 30

echo
echo "== dcptool replay $WORK/caps --table vbuckets  (the state a careful consumer builds)"
"$DCPTOOL" replay "$WORK/caps" --table vbuckets --format table | head -n 12

echo
echo "== the same replay in-process and on a local Spark session: identical checksums"
"$DCPTOOL" replay "$WORK/caps" --checksum >"$WORK/local.sum"
"$DCPTOOL" replay "$WORK/caps" --spark --checksum >"$WORK/spark.sum"
cat "$WORK/spark.sum"
if cmp -s "$WORK/local.sum" "$WORK/spark.sum"; then
  echo "   in-process and Spark agree"
else
  echo "   in-process and Spark DIFFER:" >&2
  diff "$WORK/local.sum" "$WORK/spark.sum" >&2
  exit 1
fi

echo
echo "== the live tail: --from now --to forever for 2 s"
"$DCPTOOL" stream "$URL" --from now --to forever --duration 2s --format jsonl \
  | "$PY" -c 'import sys,json; r=[json.loads(l) for l in sys.stdin]; print("  ", sum(x["op"] in ("mutation","deletion","expiration") for x in r), "live changes")'
echo
echo "== done; stopping the producer"
