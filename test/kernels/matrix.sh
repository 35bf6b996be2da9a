#!/usr/bin/env bash
# make test-kernels: the kernel-facing tests on each of Debian's kernels
# (kernels.sh boots them under qemu), and the table of what passed where.
#
#   matrix.sh [SUITE...]     default: bullseye bookworm trixie (5.10, 6.1, 6.12)
#
# Builds the test binaries here (the guests run this machine's userspace),
# boots each kernel once and runs suite.sh there: the loader and verifier
# tests, the golden packets through BPF_PROG_RUN (with every fuzz seed), the
# engines on veths, `make demo` (>= 99 % in the kernel), and the node-shape
# twins. Writes $KERNELS_RESULTS/table.md; exits 1 if any row failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
suites=("$@"); [ ${#suites[@]} -gt 0 ] || suites=(bullseye bookworm trixie)
BIN=${BIN:-bin}
res=${KERNELS_RESULTS:-$BIN/kernels}
kb=$(realpath -m "$BIN/kernels-bin")
mkdir -p "$kb" "$res"
GO=${GO:-go}

echo "matrix: building the test binaries into $kb"
$GO test -c -o "$kb/loader.test" ./internal/loader
$GO test -c -o "$kb/bpf.test" ./bpf
$GO test -c -o "$kb/e2e.test" ./test/e2e
$GO build -o "$kb/demo" ./test/demo
$GO build -o "$kb/stunnerd-xdp" ./cmd/stunnerd-xdp
$GO build -o "$kb/udpecho" ./test/cmd/udpecho
cp "$BIN/turncat" "$kb/turncat"

export KERNELS_BIN=$kb STUNNERD_XDP=$kb/stunnerd-xdp UDPECHO=$kb/udpecho TURNCAT=$kb/turncat
# Waits in the tests scale with the guest's speed (TCG: ~10x slower).
export TEST_TIMEOUT_SCALE=${TEST_TIMEOUT_SCALE:-10}
# KERNELS_TWINS names the suites whose node shapes run with their
# --xdp-mode=off twins ("all", the default, or a list); the others run the
# default mode only (CI's time: .ci/run runs the twins on one kernel).
twins=${KERNELS_TWINS:-all}
fail=0
for s in "${suites[@]}"; do
	o=$(realpath -m "$res/$s"); rm -rf "$o"; mkdir -p "$o"
	t0=$SECONDS
	modes="default"
	case " $twins " in *" all "*|*" $s "*) modes="default|off";; esac
	# KERNELS_ROWS_<suite> narrows the rows for one kernel (CI's time), else KERNELS_ROWS.
	rv=KERNELS_ROWS_$s
	KERNELS_ROWS=${!rv:-${KERNELS_ROWS:-loader goldens demo shapes}} \
	KERNELS_SHAPE_MODES=$modes KERNELS_OUT=$o bash test/kernels/kernels.sh run "$s" bash test/kernels/suite.sh 2>&1 \
		| grep -vE '^\s*$|SeaBIOS|iPXE|Booting from ROM|Press Ctrl-B' || true
	[ -f "$o/rc" ] && [ "$(cat "$o/rc")" = 0 ] || fail=1
	echo "matrix: $s done in $((SECONDS - t0)) s"
done

# The table: a column per kernel, a row per test.
{
	printf '| test |'; for s in "${suites[@]}"; do printf ' %s (%s) |' "$s" "$(cat "$res/$s/uname" 2>/dev/null || echo '?')"; done; echo
	printf '|---|'; for s in "${suites[@]}"; do printf -- '---|'; done; echo
	for t in loader goldens demo shapes; do
		printf '| %s |' "$t"
		for s in "${suites[@]}"; do
			awk -F'\t' -v t="$t" '$1==t{printf " %s in %s s%s |", $2, $3, ($4!=""?": "$4:"")} END{if(!NR)printf " not run |"}' "$res/$s/results.tsv" 2>/dev/null || printf ' not run |'
		done; echo
	done
	for s in "${suites[@]}"; do
		[ -s "$res/$s/shapes.table" ] || continue
		printf '\nNode shapes on %s (echoed, lost, kernel share client->peer, peer->client):\n\n```\n' "$(cat "$res/$s/uname")"
		cat "$res/$s/shapes.table"; printf '```\n'
	done
} > "$res/table.md"
cat "$res/table.md"
exit $fail
