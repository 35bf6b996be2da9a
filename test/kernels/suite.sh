#!/usr/bin/env bash
# Runs inside a guest (matrix.sh -> kernels.sh run): the kernel-facing tests,
# each a row of results.tsv in $KERNELS_OUT: name, PASS/FAIL, seconds, and
# what the row measured. Every test binary was built on the host into
# $KERNELS_BIN; the guest's file system is the host's, read-only.
set -uo pipefail
: "${KERNELS_BIN:?}" "${KERNELS_OUT:?}"
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$KERNELS_OUT
: > "$out/results.tsv"
uname -r > "$out/uname"

# row NAME LIMIT DIR CMD...: runs CMD in DIR for at most LIMIT seconds
# (KERNELS_ROW_TIMEOUT, when set, for every row), its output in NAME.log;
# only the rows KERNELS_ROWS names (default: all of them). A Go test binary
# gets its own timeout 30 s before the row's, so that a test that hangs
# fails with its name and every goroutine's stack in the log rather than
# taking the row's whole limit in silence. The limits are a few times what
# each row takes under TCG (loader ~100 s, goldens ~280 s, demo ~90 s,
# shapes up to ~1,200 s with the twins on 5.10).
row() {
	local name=$1 limit=${KERNELS_ROW_TIMEOUT:-$2} dir=$3; shift 3
	case " ${KERNELS_ROWS:-loader goldens demo shapes} " in *" $name "*) ;; *) return 0;; esac
	case $1 in *.test) set -- "$@" -test.timeout "$((limit - 30))s";; esac
	local t0=$SECONDS st=PASS
	echo "suite: $name: $*"
	(cd "$root/$dir" && timeout -k 10 "$limit" "$@") > "$out/$name.log" 2>&1 || st=FAIL
	local what
	what=$(summary "$name")
	printf '%s\t%s\t%s\t%s\n' "$name" "$st" $((SECONDS - t0)) "$what" >> "$out/results.tsv"
	echo "suite: $name: $st in $((SECONDS - t0)) s ${what:+($what)}"
	[ "$st" = PASS ] || tail -n 40 "$out/$name.log"
}

# summary NAME: one line of what the row's log says (go test's counts, the
# demo's kernel share).
summary() {
	local log=$out/$1.log p f s
	p=$(grep -c -- '--- PASS' "$log"); f=$(grep -c -- '--- FAIL' "$log"); s=$(grep -c -- '--- SKIP' "$log")
	if [ "$1" = demo ]; then
		grep -o '([0-9.]* % in the kernel)' "$log" | head -1 | tr -d '()'
	elif [ $((p + f + s)) -gt 0 ]; then
		echo "$p passed, $f failed, $s skipped"
	fi
}

gotest=(-test.count=1 -test.v)

row loader 600 internal/loader "$KERNELS_BIN/loader.test" "${gotest[@]}"
# The rate-limit rows assume under 30 ms between two packets of a test (the
# budgets are tens of ms); under TCG it is more. They run on the host (make
# test); here the rate branches run through the fuzz seeds' rate inputs.
row goldens 1200 bpf "$KERNELS_BIN/bpf.test" "${gotest[@]}" -test.skip '^(TestRateLimit|TestTCRateLimit|TestChargeProgram)$'

row demo 600 . "$KERNELS_BIN/demo" --daemon "$KERNELS_BIN/stunnerd-xdp" --turncat "$KERNELS_BIN/turncat" \
	--rate "${KERNELS_DEMO_RATE:-1000}" --seconds "${KERNELS_DEMO_SECONDS:-60}" --min-kernel-share 99
# KERNELS_SHAPES picks rows (a regexp of their names), KERNELS_SHAPE_MODES the
# runs of each: "default|off" (the twins) or "default".
row shapes 1700 test/e2e "$KERNELS_BIN/e2e.test" "${gotest[@]}" \
	-test.run "^TestNodeShapeTwins$/^(${KERNELS_SHAPES:-.*})$/^(${KERNELS_SHAPE_MODES:-default|off})$"
# The node-shape table (shapes_test.go logs it) for docs/testing.md.
[ -f "$out/shapes.log" ] && sed -n '/node shapes, /,/^--- /p' "$out/shapes.log" | grep -E '^\s+[a-z0-9-]+ +(default|off) ' > "$out/shapes.table" || true
grep -q FAIL "$out/results.tsv" && exit 1
exit 0
