package sidecar

import (
	"strings"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/sidecar/l2"
	"github.com/ringside-kv/ringside/sidecar/machine"
)

func TestConfigValidateReportsEverything(t *testing.T) {
	c := Config{Dir: "relative", PoolBytes: 10, RingCapacity: 1000, CopyBackend: "gpu", CopyWorkers: -1, DeltaLogSize: 3,
		Machine: machine.Config{SlotBytes: 100, Budget: -1, SnapshotScan: -1}}
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

// TestConfigRetainShare: the retain share is in (0, 1] and at most the pin
// share (a uid's retained blocks stay bounded by what its leases may pin);
// a conflict names both flags, also when only the pin share was lowered
// below the retain share's default.
func TestConfigRetainShare(t *testing.T) {
	for _, tc := range []struct {
		pin, retain float64
		want        []string // the flags the error names; none: accepted
	}{
		{0, 0, nil},
		{0.5, 0.5, nil},
		{1, 1, nil},
		{0.5, 0.6, []string{"--limits.retain-share: 0.6", "--limits.pin-share"}},
		{0.2, 0, []string{"--limits.retain-share: 0.25", "--limits.pin-share"}},
		{0, 1.5, []string{"--limits.retain-share: 1.5 must be in (0, 1]"}},
		{0, -0.1, []string{"--limits.retain-share: -0.1 must be in (0, 1]"}},
	} {
		c := Config{Dir: "/dev/shm/x", Machine: machine.Config{PinShare: tc.pin, RetainShare: tc.retain}}
		c.EnsureDefaults()
		err := c.Validate()
		if len(tc.want) == 0 {
			if err != nil {
				t.Errorf("pin share %v, retain share %v: %v", tc.pin, tc.retain, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("pin share %v, retain share %v: accepted", tc.pin, tc.retain)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("pin share %v, retain share %v: the error does not say %q: %v", tc.pin, tc.retain, w, err)
			}
		}
	}
}

// TestConfigCUDACopyBudget: the CUDA chunk size and in-flight limit default
// to 64 MiB and 8; a value out of bounds, or more bytes in flight per GPU
// than a slow PCIe link moves within --copy.stall, is refused naming its
// flag, the values and the bound.
func TestConfigCUDACopyBudget(t *testing.T) {
	def := Config{Dir: "/dev/shm/x"}
	def.EnsureDefaults()
	if def.Machine.CUDAChunkBytes != 64<<20 || def.CopyCUDAInflight != 8 {
		t.Fatalf("defaults %d bytes, %d in flight", def.Machine.CUDAChunkBytes, def.CopyCUDAInflight)
	}
	for _, tt := range []struct {
		name     string
		chunk    uint64
		inflight int
		stall    time.Duration
		want     string // "" accepted
	}{
		{"smallest chunk", 4096, 1, 0, ""},
		{"largest chunk", 1 << 30, 1, 0, ""},
		{"most in flight", 64 << 20, 64, 0, ""},
		{"more in flight than a link copies within the stall bound", 1 << 30, 8, 0, "--copy.cuda-inflight: 8 chunks of --copy.cuda-chunk-bytes 1073741824 are 8589934592 bytes in flight per GPU, more than a PCIe link moves within --copy.stall (1s) at 8 GB/s: the last ones would count as stuck"},
		{"as many within a longer stall bound", 1 << 30, 8, 2 * time.Second, ""},
		{"chunk under 4 KiB", 4095, 1, 0, "--copy.cuda-chunk-bytes: 4095 outside [4 KiB, 1 GiB]"},
		{"chunk over 1 GiB", 1<<30 + 1, 1, 0, "--copy.cuda-chunk-bytes: 1073741825 outside [4 KiB, 1 GiB]"},
		{"negative in flight", 64 << 20, -1, 0, "--copy.cuda-inflight: -1 outside [1, 64]"},
		{"too many in flight", 64 << 20, 65, 0, "--copy.cuda-inflight: 65 outside [1, 64]"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := Config{Dir: "/dev/shm/x", Machine: machine.Config{CUDAChunkBytes: tt.chunk}, CopyCUDAInflight: tt.inflight, CopyStall: tt.stall}
			c.EnsureDefaults()
			err := c.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tt.want != "" && (err == nil || err.Error() != tt.want):
				t.Fatalf("got %v, want %q", err, tt.want)
			}
		})
	}
}

// TestConfigTier: the Machine's deadlines for the shared tier default to
// the client's plus a margin, the rest to the Machine's defaults, and a bad
// setting of either side is refused naming its flag.
func TestConfigTier(t *testing.T) {
	c := Config{Dir: "/dev/shm/x", L2: &L2Config{Redis: l2.Config{Addrs: []string{"redis:6379"}, LookupTimeout: time.Second}}}
	c.EnsureDefaults()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	tier := c.L2.Tier
	if tier.Timeout != time.Second+l2LookupMargin || tier.FetchTimeout != l2.DefaultIOTimeout+l2FetchMargin ||
		tier.MaxLookupBlocks != machine.DefaultL2MaxBlocks || tier.MaxFetchBlocks != machine.DefaultL2MaxBlocks || tier.WriteSlots != 0 {
		t.Fatalf("tier defaults %+v", tier)
	}
	c.L2.Tier.WriteSlots, c.L2.Tier.MaxFetchBlocks, c.L2.Redis.Mode = -1, -2, "ring"
	err := c.Validate()
	for _, want := range []string{"--l2.write-slots: -1 must not be negative", "--l2.max-fetch-blocks: -2 must not be negative", "--l2.redis.mode"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q: %v", want, err)
		}
	}
}
