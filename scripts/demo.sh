#!/usr/bin/env bash
# `make demo`: the main job end to end against the built-in producer, told as a short story:
# start a DCP producer on a free loopback port, look at its stream, capture it to Parquet,
# replay the capture in-process and on a local Spark session (same checksums), and say what
# to try next. The capture is kept in ./demo-captures so the next commands can use it.
set -euo pipefail
cd "$(dirname "$0")/.."
DCPTOOL="${DCPTOOL:-.venv/bin/dcptool}"
PY="${PY:-.venv/bin/python}"
CAPS="${DEMO_CAPTURES:-demo-captures}"
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
step() { printf '\n\033[1m%s\033[0m\n' "$*"; }
run() { printf '  $ %s\n' "$*"; }

step "1. Start a Couchbase-like DCP producer (64 vbuckets, 5,000 documents, 200 changes/s)"
run "dcptool serve dcp --port 0 --vbuckets 64 --items 5000 --rate 200 --seed 1 &"
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
echo "  listening on $ADDR (loopback only)"

step "2. Watch the stream of vbucket 0, decoded: the handshake (HELLO .. DCP_CONTROL), then the stream"
run "dcptool stream $URL --vbuckets 0 --max-messages 16 --format table"
COLUMNS=${COLUMNS:-120} "$DCPTOOL" stream "$URL" --vbuckets 0 --max-messages 16 --format table 2>/dev/null \
  | sed 's/^/  /'

step "3. Capture every frame of the bucket, both directions, into Parquet"
rm -rf "$CAPS"
run "dcptool capture $URL -o $CAPS --quiet --json"
"$DCPTOOL" capture "$URL" -o "$CAPS" --quiet --json >"$WORK/capture.json"
"$DCPTOOL" inspect "$CAPS" --json >"$WORK/inspect.json"
"$PY" - "$WORK/capture.json" "$WORK/inspect.json" <<'PY'
import json, os, sys
cap = json.load(open(sys.argv[1]))
ins = json.load(open(sys.argv[2]))
files = ins["files"]
size = sum(os.path.getsize(f["path"]) for f in files if os.path.exists(f["path"]))
ops = ins.get("ops", {})
changes = sum(ops.get(k, 0) for k in ("mutation", "deletion", "expiration"))
print(f"  {ins['rows']:,} frames in {len(files)} file(s), {size / 1e6:.1f} MB of Parquet: {os.path.dirname(files[0]['path']) or '.'}/")
print(f"  {changes:,} document changes from {len(ins.get('vbuckets', []))} vbuckets, "
      f"{ops.get('snapshot_marker', 0):,} snapshots, {ops.get('stream_end', 0)} streams ended at their high seqno")
PY

step "4. Replay the capture: the state a careful consumer builds"
run "dcptool replay $CAPS --table documents --format jsonl"
"$DCPTOOL" replay "$CAPS" --table documents --format jsonl >"$WORK/docs.jsonl"
"$PY" - "$WORK/docs.jsonl" <<'PY'
import collections, json, sys
docs = [json.loads(l) for l in open(sys.argv[1])]
states = collections.Counter(d["state"] for d in docs)
print(f"  {len(docs):,} documents: " + ", ".join(f"{n:,} {s}" for s, n in sorted(states.items())))
d = docs[0]
print(f"  e.g. {d['key']!r} in vbucket {d['vbucket']}: seqno {d['by_seqno']}, {d['state']}")
PY

step "5. The same replay in-process and on a local Spark session: identical checksums"
run "dcptool replay $CAPS --checksum  /  dcptool replay $CAPS --spark --checksum"
"$DCPTOOL" replay "$CAPS" --checksum >"$WORK/local.sum"
"$DCPTOOL" replay "$CAPS" --spark --checksum >"$WORK/spark.sum"
if cmp -s "$WORK/local.sum" "$WORK/spark.sum"; then
  sed 's/^/  /' "$WORK/spark.sum"
  echo "  in-process and Spark agree on every table"
else
  echo "  in-process and Spark DIFFER:" >&2
  diff "$WORK/local.sum" "$WORK/spark.sum" >&2
  exit 1
fi

step "6. The live tail: new changes for 2 seconds (--from now --to forever)"
"$DCPTOOL" stream "$URL" --from now --to forever --duration 2s --format jsonl 2>/dev/null \
  | "$PY" -c 'import sys,json; r=[json.loads(l) for l in sys.stdin]; print("  ", sum(x["op"] in ("mutation","deletion","expiration") for x in r), "live changes arrived")'

step "Done. The producer is stopped; the capture stays in $CAPS/. Try next:"
cat <<EOF
  dcptool inspect $CAPS/
  dcptool replay $CAPS/ --table vbuckets
  dcptool replay $CAPS/ --spark --sql "SELECT state, count(*) FROM documents GROUP BY state"
  dcptool serve dcp --port 0 &   then   dcptool stream couchbase://127.0.0.1:PORT/default | jq .op
EOF
