package sidecar

import (
	"strings"
	"testing"
)

func TestConfigValidateReportsEverything(t *testing.T) {
	c := Config{Dir: "relative", PoolBytes: 10, SlotBytes: 100, Budget: -1, RingCapacity: 1000, CopyBackend: "gpu", CopyWorkers: -1, DeltaLogSize: 3, SnapshotScan: -1}
	c.EnsureDefaults()
	err := c.Validate()
	if err == nil {
		t.Fatal("bad config accepted")
	}
	for _, flag := range []string{"--dir", "--pool.slot-bytes", "--pool.bytes", "--budget", "--ring.capacity", "--copy.backend", "--copy.workers", "--delta-log-size", "--snapshot-scan"} {
		if !strings.Contains(err.Error(), flag) {
			t.Errorf("error does not name %s:\n%v", flag, err)
		}
	}
	good := Config{Dir: "/dev/shm/x"}
	good.EnsureDefaults()
	if err := good.Validate(); err != nil {
		t.Fatalf("defaults rejected: %v", err)
	}
}
