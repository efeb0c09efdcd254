package replay

import "github.com/ringside-kv/ringside/bench/internal/uds"

// The socket front end of the replay (the hidden `ringside-bench
// replay-relay`, one process per engine) is bench/internal/uds's relay,
// which also maps the engine's memory file and registers it as its own, so
// that the sidecar's copies land in the engine's memory.

// RelayConfig is the relay's command line.
type RelayConfig = uds.RelayConfig

// RegionFile is engine memory in a shared-memory file.
type RegionFile = uds.RegionFile

// ParseRegion parses "ID:PAGE_BYTES:PAGES:PATH".
func ParseRegion(s string) (RegionFile, error) { return uds.ParseRegion(s) }

// Relay runs the socket front end until its client detaches.
func Relay(rc RelayConfig) error { return uds.Relay(rc) }
