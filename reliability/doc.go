// Package reliability is ringside's reliability and security suite: it
// attacks a real sidecar process (built from ./cmd/ringside once per run)
// the way production will (SIGKILLed engines and sidecars, corrupt and
// stale ring files, peers that stop reading or writing, hostile records,
// other tenants and other users, resource hogs) and checks that nothing is
// lost, leaked, hung or crossed.
//
// Everything is in the tests; this file and report.go hold only the report
// writer. The suite runs in `go test ./...` in bounded time; heavier
// variants run with -long (or RINGSIDE_RELIABILITY_LONG=1), and the soak
// with `make soak` (RINGSIDE_SOAK=10m). Every test records one row of
// docs/reliability.md; regenerate it with
//
//	RINGSIDE_RELIABILITY_REPORT=docs/reliability.md go test -count=1 ./reliability/
//
// (a relative path is taken from the module root).
package reliability
