# Sourced by scripts/record_*.sh: `record FILE COMMAND...` runs COMMAND and writes its JSON line to
# FILE only if it succeeds and prints one JSON value (a failed run leaves the old record in place).
# Needs $PY (the Python that checks the JSON).
record() {
    local out=$1
    shift
    echo "== $* > $out" >&2
    "$@" > "$out.tmp" || return 1
    "$PY" -c 'import json, sys; json.loads(open(sys.argv[1]).read())' "$out.tmp" \
        || { echo "not one JSON line: $out.tmp" >&2; return 1; }
    mv "$out.tmp" "$out"
}
