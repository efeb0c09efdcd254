#!/usr/bin/env bash
# GPU check for the CUDA copy engine, for one machine with an NVIDIA GPU;
# a few minutes, always under 9 (the steps' time limits: conformance 130 s,
# benchmark 160 s, serve check 2 x 25 s, probes 50 s, 60 s and 80 s: 530 s).
#
#   bench/gpu/run.sh          build (if Go is here), then check and measure
#   bench/gpu/run.sh build    only build bin/ringside, bin/ringside-bench and
#                             bin/gputest.test (stripped, ~55 MiB in all: to
#                             carry bin/ to a GPU machine without Go/modules)
#   bench/gpu/run.sh dry      the same steps on a machine without a GPU,
#                             against the stand-in driver: builds
#                             gpu/gputest/testdata/fakecuda.c into a temp dir
#                             as libcuda.so.1 and puts it first on
#                             LD_LIBRARY_PATH (needs gcc); small copy sizes.
#                             RINGSIDE_GPU_DRY=1 does the same. This tests
#                             the script, not the driver.
#
# Steps: (1) the conformance suite (and the VMM tests: memory shared by file
# descriptor, imported by the copy engine) with RINGSIDE_REQUIRE_GPU=1, so a missing
# driver or GPU fails instead of skipping: random layouts, 4 KiB-2 MiB
# pages, every byte checked, CUDA IPC refusals, against a second process
# that allocates device memory and exports IPC handles; (2) `ringside-bench
# copy --backend cuda`: h2d/d2h, 16 KiB-5 MiB pages, 1-4096 pages, batched
# vs per-range vs one plain cuMemcpyAsync of the same bytes (ceiling);
# (3) `ringside serve --copy.backend=cuda` with the GPU overlay's 5 MiB
# slots starts and says the CUDA backend is ready, and with no visible GPU
# exits at start with the reason; (4) probe_torch.py: what ringside's
# engine side relies on of PyTorch (a vLLM-sized torch.zeros buffer is one
# allocation CUDA IPC can export, torch's current stream is the legacy
# default stream, expandable segments cannot be exported, the device UUID);
# (5) probe_e2e.py: the vLLM connector's GPU path end to end (one torch
# buffer viewed as vLLM's LBNHC and BLNHC layouts, from_block_tensors with
# the block count, the worker's ctypes driver and store event on torch's
# stream, a real `ringside serve --copy.backend=cuda`: 64 blocks stored,
# overwritten, loaded, every byte compared; a store whose event is recorded
# behind a GPU sleep must wait for it); (6)
# probe_ipc.py: what the driver does with IPC between two processes
# (address ranges, corrupt handles, legacy export of VMM memory,
# interprocess events; VMM memory shared by POSIX file descriptor: export,
# import in the second process with bytes both ways, release while mapped,
# the export error for a handle type not requested, pointer attributes,
# the map rules; the exporter's death; the death of an exporter whose
# interprocess event's record is pending, waited on by this process:
# event-death). The probes print
# `PROBE <name>: <verdict> (<details>)`; what a sandbox refuses is a
# verdict, not a failure of the run. In the dry mode the VMM probes check
# the stand-in's model against itself (bench/gpu's test wants its one
# answer for each), so that they run as they will on a GPU.
#
# With $OUT set, results land in $OUT (8 files): gpu.txt, conformance.txt,
# copy.jsonl (JSON Lines rows), copy.txt (the table), serve.txt,
# probe_torch.txt, probe_e2e.txt, probe_ipc.txt. The exit status is that of
# the conformance suite, the benchmark and the serve check.
#
# The probes run with $PYTHON: on a GPU machine an interpreter with CUDA
# torch (probe_torch.py and probe_e2e.py say `skipped` without one). In the
# dry mode python3 without torch does: probe_e2e.py runs against the
# stand-in with ctypes views of its device memory (--stand-in), and
# probe_torch.py says `skipped`.
#
# Env: COPY_ARGS adds flags to the benchmark (e.g. "--max-bytes 1GiB");
# PYTHON is the interpreter of the probes (python3); RINGSIDE_GPU_BIN is
# where the binaries are built and looked for (bin/); RINGSIDE_PREBUILT=1
# uses them without building; RINGSIDE_GPU_GOFLAGS adds flags to the
# builds (e.g. "-race").
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-run}
case "$mode" in
run | build | dry) ;;
*)
	echo "usage: bench/gpu/run.sh [build|dry]" >&2
	exit 2
	;;
esac
if [ "$mode" = run ] && [ "${RINGSIDE_GPU_DRY:-}" = 1 ]; then mode=dry; fi
out="${OUT:-}"
[ -n "$out" ] && mkdir -p "$out"
bin=${RINGSIDE_GPU_BIN:-$PWD/bin}
py=${PYTHON:-python3}
save() { if [ -n "$out" ]; then tee "$out/$1"; else cat; fi; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

build() {
	export CGO_ENABLED=1
	local ver
	ver=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
	mkdir -p "$bin"
	# shellcheck disable=SC2086 # RINGSIDE_GPU_GOFLAGS is a list of flags
	go build ${RINGSIDE_GPU_GOFLAGS:-} -ldflags "-s -w -X github.com/ringside-kv/ringside/internal/cli.Version=$ver" \
		-o "$bin/ringside" ./cmd/ringside
	# shellcheck disable=SC2086
	go build ${RINGSIDE_GPU_GOFLAGS:-} -ldflags "-s -w -X github.com/ringside-kv/ringside/bench/benchcli.Version=$ver" \
		-o "$bin/ringside-bench" ./cmd/ringside-bench
	# shellcheck disable=SC2086
	go test ${RINGSIDE_GPU_GOFLAGS:-} -ldflags "-s -w" -c -o "$bin/gputest.test" ./gpu/gputest
}

if [ "$mode" = build ]; then
	build
	size=$(du -sm "$bin" | cut -f1)
	echo "$bin: ${size} MiB"
	if [ "$size" -ge 64 ]; then echo "run.sh: $bin is ${size} MiB, over the 64 MiB that can be carried to a GPU machine" >&2; fi
	exit 0
fi

if [ "$mode" = dry ]; then
	if ! command -v gcc >/dev/null 2>&1; then
		echo "run.sh dry: no gcc to build the stand-in driver gpu/gputest/testdata/fakecuda.c" >&2
		exit 2
	fi
	gcc -shared -fPIC -O1 -o "$tmp/libcuda.so.1" gpu/gputest/testdata/fakecuda.c
	export LD_LIBRARY_PATH="$tmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	# Small sizes: the stand-in copies with memcpy on the CPU.
	copy_args="--page-bytes 16KiB,2MiB,5MiB --pages 1,16 --max-bytes 64MiB --min-time 5ms"
	ipc_args="--event-bytes 1048576 --event-reps 4 --death-bytes 16777216 --death-copies 4 --stand-in-hold $tmp/hold"
	ipc_args="$ipc_args --event-death-reps 4 --event-death-poll 1"
	e2e_args="--stand-in $tmp/e2e-hold --reps 2"
	# Fewer random layouts: the dry mode tests this script; the suite
	# itself runs under the stand-in in gpu/gputest's TestCUDAFakeDriver.
	conf_args="-test.short"
else
	# The targets' rows (bench/copybench): 32 KiB per-layer ranges and 2 MiB
	# cross-layer blocks up to a 2,048-token prefix of an 8B model (256 MiB:
	# 8192 and 128 pages), 64 KiB and the 5 MiB slot beside them.
	copy_args="--page-bytes 32KiB,64KiB,2MiB,5MiB --pages 1,16,128,1024,8192"
	ipc_args=""
	e2e_args=""
	conf_args=""
fi

if command -v go >/dev/null 2>&1 && [ -z "${RINGSIDE_PREBUILT:-}" ]; then
	build
elif [ ! -x "$bin/ringside-bench" ] || [ ! -x "$bin/gputest.test" ]; then
	echo "run.sh: no Go toolchain and no prebuilt $bin/ringside-bench + $bin/gputest.test (run 'bench/gpu/run.sh build' where Go is)" >&2
	exit 2
fi

{
	date -u +"%Y-%m-%dT%H:%M:%SZ"
	uname -srm
	if [ "$mode" = dry ]; then
		echo "dry run: the stand-in driver built from gpu/gputest/testdata/fakecuda.c, not a GPU"
	fi
	if command -v nvidia-smi >/dev/null 2>&1; then
		nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 || true
	else
		echo "nvidia-smi unavailable"
	fi
	echo "RLIMIT_MEMLOCK: $(ulimit -l)"
	echo "python: $("$py" --version 2>&1 || echo unavailable)"
	echo "binaries: $("$bin/ringside" --version 2>&1 || echo "no $bin/ringside")"
} | save gpu.txt

status=0

echo "== conformance (RINGSIDE_REQUIRE_GPU=1)"
conf=${out:+$out/conformance.txt}
conf=${conf:-$tmp/conformance.txt}
set +e
# The test binary runs in its package directory (testdata/ is relative).
# shellcheck disable=SC2086 # conf_args is a list of flags
(cd gpu/gputest && RINGSIDE_REQUIRE_GPU=1 timeout 130 "$bin/gputest.test" -test.count=1 -test.v $conf_args \
	-test.run '^(TestConformance|TestCUDARegister|TestVMM[A-Za-z]*)$') >"$conf" 2>&1
st=$?
set -e
grep -E '^\s*--- (PASS|FAIL|SKIP): [^/]+(/[^/]+)?(/(merged|bounds|lifecycle|random-layouts))? |CUDA driver|batching|^(PASS|FAIL)' "$conf" || true
if [ "$st" -eq 0 ]; then echo "conformance: PASS"; else
	echo "conformance: FAIL (exit $st; full log $conf)"
	status=1
fi

echo "== ringside-bench copy --backend cuda $copy_args ${COPY_ARGS:-}"
json=${out:+$out/copy.jsonl}
json=${json:-$tmp/copy.jsonl}
set +e
# shellcheck disable=SC2086 # copy_args and COPY_ARGS are lists of flags
timeout 160 "$bin/ringside-bench" copy --backend cuda --out "$json" $copy_args ${COPY_ARGS:-} | save copy.txt
st=${PIPESTATUS[0]}
set -e
echo "rows: $(wc -l <"$json" 2>/dev/null || echo 0) in $json"
if [ "$st" -ne 0 ]; then
	echo "copy: FAIL (exit $st)"
	status=1
fi

# serve_check NAME WANT [ENV...]: start `ringside serve --copy.backend=cuda`
# with the GPU overlay's slot size; WANT=ready: it must log "sidecar ready"
# after "CUDA copy backend ready"; WANT=refused: it must exit non-zero at
# start saying why.
serve_check() {
	local name=$1 want=$2 dir log pid i rc=0
	shift 2
	dir=$(mktemp -d "$tmp/serve.XXXXXX")
	log=$dir.log
	env "$@" "$bin/ringside" serve --dir="$dir" --pool.bytes=256MiB --pool.slot-bytes=5MiB \
		--copy.backend=cuda --metrics.addr=127.0.0.1:0 --log.format=json >"$log" 2>&1 &
	pid=$!
	for i in $(seq 1 200); do
		if grep -q '"sidecar ready"' "$log" || ! kill -0 "$pid" 2>/dev/null; then break; fi
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid"
		for i in $(seq 1 50); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	wait "$pid" || rc=$?
	echo "-- $name: ringside serve --copy.backend=cuda --pool.slot-bytes=5MiB${*:+ ($*)}: exit $rc"
	cat "$log"
	if [ "$want" = ready ] && grep -q '"CUDA copy backend ready' "$log" && grep -q '"sidecar ready"' "$log"; then
		echo "serve $name: PASS (the CUDA copy backend started)"
	elif [ "$want" = refused ] && [ "$rc" -ne 0 ] && grep -q -- '--copy.backend cuda:' "$log"; then
		echo "serve $name: PASS (exit $rc at start, with the reason)"
	else
		echo "serve $name: FAIL (want $want)"
		return 1
	fi
}

echo "== ringside serve --copy.backend=cuda"
if [ -x "$bin/ringside" ]; then
	set +e
	{
		serve_check gpu ready
		a=$?
		# No visible device: CUDA_VISIBLE_DEVICES for the real driver,
		# FAKECUDA_NODEV for the stand-in.
		serve_check no-gpu refused CUDA_VISIBLE_DEVICES=-1 FAKECUDA_NODEV=1
		b=$?
		exit $((a | b))
	} 2>&1 | save serve.txt | grep -E '^(-- |serve )'
	st=${PIPESTATUS[0]}
	set -e
	[ "$st" -eq 0 ] || status=1
else
	echo "no $bin/ringside: serve check skipped" | save serve.txt
fi

echo "== probe_torch.py"
set +e
timeout 50 "$py" bench/gpu/probe_torch.py 2>&1 | save probe_torch.txt | grep -E '^PROBE '
st=${PIPESTATUS[0]}
set -e
echo "probe_torch: exit $st"

echo "== probe_e2e.py $e2e_args"
set +e
# shellcheck disable=SC2086 # e2e_args is a list of flags
timeout 60 "$py" bench/gpu/probe_e2e.py --bin "$bin/ringside" $e2e_args 2>&1 | save probe_e2e.txt | grep -E '^PROBE '
st=${PIPESTATUS[0]}
set -e
echo "probe_e2e: exit $st"

echo "== probe_ipc.py $ipc_args"
set +e
# shellcheck disable=SC2086 # ipc_args is a list of flags
timeout 80 "$py" bench/gpu/probe_ipc.py $ipc_args 2>&1 | save probe_ipc.txt | grep -E '^PROBE '
st=${PIPESTATUS[0]}
set -e
echo "probe_ipc: exit $st"
exit "$status"
