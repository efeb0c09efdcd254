#!/usr/bin/env bash
# GPU check for the CUDA copy engine (issue 5), for one machine with an
# NVIDIA GPU; about 1-3 minutes, always under 5.
#
#   bench/gpu/run.sh          build (if Go is here), then check and measure
#   bench/gpu/run.sh build    only build bin/ringside, bin/ringside-bench and
#                             bin/gputest.test (to carry bin/ to a GPU machine
#                             without Go/modules)
#
# Steps: (1) the conformance suite with RINGSIDE_REQUIRE_GPU=1, so a missing
# driver or GPU fails instead of skipping: random layouts, 4 KiB-2 MiB
# pages, every byte checked, CUDA IPC refusals, against a second process
# that allocates device memory and exports IPC handles; (2) `ringside-bench
# copy --backend cuda`: h2d/d2h, 16 KiB-2 MiB pages, 1-4096 pages, batched
# vs per-range vs one plain cuMemcpyAsync of the same bytes (ceiling). It
# prints one table; with $OUT set, results land in $OUT: copy.jsonl (JSON
# Lines rows), copy.txt (the table), conformance.txt, gpu.txt.
# COPY_ARGS adds flags to the benchmark (e.g. "--max-bytes 1GiB").
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-}"
[ -n "$out" ] && mkdir -p "$out"
save() { if [ -n "$out" ]; then tee "$out/$1"; else cat; fi; }

build() {
	export CGO_ENABLED=1
	go build -o bin/ringside ./cmd/ringside
	go build -o bin/ringside-bench ./cmd/ringside-bench
	go test -c -o bin/gputest.test ./gpu/gputest
}

if [ "${1:-}" = build ]; then
	build
	exit 0
fi
if command -v go >/dev/null 2>&1 && [ -z "${RINGSIDE_PREBUILT:-}" ]; then
	build
elif [ ! -x bin/ringside-bench ] || [ ! -x bin/gputest.test ]; then
	echo "run.sh: no Go toolchain and no prebuilt bin/ringside-bench + bin/gputest.test (run 'bench/gpu/run.sh build' where Go is)" >&2
	exit 2
fi

{
	date -u +"%Y-%m-%dT%H:%M:%SZ"
	uname -srm
	nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 || echo "nvidia-smi unavailable"
	echo "RLIMIT_MEMLOCK: $(ulimit -l)"
} | save gpu.txt

echo "== conformance (RINGSIDE_REQUIRE_GPU=1)"
conf=${out:+$out/conformance.txt}
conf=${conf:-$(mktemp)}
bin=$PWD/bin
set +e
# The test binary runs in its package directory (testdata/ is relative).
(cd gpu/gputest && RINGSIDE_REQUIRE_GPU=1 timeout 150 "$bin/gputest.test" -test.count=1 -test.v \
	-test.run '^(TestConformance|TestCUDARegister)$') >"$conf" 2>&1
status=$?
set -e
grep -E '^\s*--- (PASS|FAIL|SKIP): [^/]+(/[^/]+)?(/(merged|bounds|lifecycle|random-layouts))? |CUDA driver|batching|^(PASS|FAIL)' "$conf" || true
if [ "$status" -eq 0 ]; then echo "conformance: PASS"; else echo "conformance: FAIL (exit $status; full log $conf)"; fi

echo "== ringside-bench copy --backend cuda ${COPY_ARGS:-}"
json=${out:+$out/copy.jsonl}
json=${json:-$(mktemp)}
# shellcheck disable=SC2086 # COPY_ARGS is a list of flags
timeout 200 bin/ringside-bench copy --backend cuda --out "$json" ${COPY_ARGS:-} | save copy.txt
echo "rows: $(wc -l <"$json") in $json"
exit "$status"
