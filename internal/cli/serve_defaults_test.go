package cli

import (
	"io"
	"reflect"
	"slices"
	"testing"

	ucli "github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/ring"
	"github.com/ringside-kv/ringside/sidecar"
	"github.com/ringside-kv/ringside/sidecar/cache"
	"github.com/ringside-kv/ringside/sidecar/l2"
)

// serveSettingsOf runs `ringside serve args...` up to the settings its
// flags give, before the defaults are filled in.
func serveSettingsOf(t *testing.T, args ...string) sidecar.Config {
	t.Helper()
	app := App()
	app.Writer, app.ErrWriter = io.Discard, io.Discard
	var cfg sidecar.Config
	var errs []string
	for _, c := range app.Commands {
		if c.Name == "serve" {
			c.Action = func(c *ucli.Context) error { cfg, errs = serveSettings(c); return nil }
		}
	}
	if err := app.Run(append([]string{"ringside", "serve"}, args...)); err != nil || len(errs) > 0 {
		t.Fatalf("serve %v: %v %v", args, err, errs)
	}
	return cfg
}

// TestServeFlagDefaults: each flag of `ringside serve` defaults to its
// setting's default, the constant of the package that owns the setting, so
// that neither can change alone; and a flag shows that default (in --help
// and docs/configuration.md) instead of a zero that the configuration
// replaces. The settings EnsureDefaults may fill in are only those no flag
// sets, or that are derived from another.
func TestServeFlagDefaults(t *testing.T) {
	const tierAddr = "redis:6379"
	for _, tc := range []struct {
		name   string
		args   []string
		filled []string // the fields EnsureDefaults fills in
	}{
		{"without the tier", nil, nil},
		{"with the tier", []string{"--l2.redis.addrs", tierAddr}, []string{
			"L2.Redis.Inflight", "L2.Redis.FetchBatchBytes", // no flag
			"L2.Tier.Timeout", "L2.Tier.FetchTimeout", // the client's timeouts and a margin
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := serveSettingsOf(t, tc.args...)
			got := raw
			if raw.L2 != nil {
				l := *raw.L2
				got.L2 = &l
			}
			got.EnsureDefaults()

			// The settings whose zero value is a setting of its own,
			// which serve's flags do not default to: no pool reservation,
			// no metrics port, no spinning, exact LRU.
			want := sidecar.Config{PoolReserve: true, MetricsAddr: sidecar.DefaultMetricsAddr,
				Spin: ring.DefaultWait.Spin, Yield: ring.DefaultWait.Yield, CachePolicy: cache.DefaultPolicy}
			if raw.L2 != nil {
				want.L2 = &sidecar.L2Config{Redis: l2.Config{Addrs: []string{tierAddr}}}
			}
			want.EnsureDefaults()
			for _, d := range fieldDiffs(got, want) {
				t.Errorf("%s: the flag's default is %v, the setting's %v", d.path, d.a, d.b)
			}

			filled := []string{
				"Socket",                       // DIR/ringside.sock
				"DeltaLogSize", "ReapInterval", // no flag
				"Machine.SnapshotScan", "Machine.MaxBatches", "Machine.MaxBatchHashes", "Machine.MaxHashBytes",
				"Machine.MaxLeases", "Machine.MaxRegions", "Machine.WorldDivisor",
			}
			filled = append(filled, tc.filled...)
			for _, d := range fieldDiffs(raw, got) {
				if !slices.Contains(filled, d.path) {
					t.Errorf("%s: the flag's default is %v, which EnsureDefaults replaces with %v: give the flag the setting's default", d.path, d.a, d.b)
				}
			}
		})
	}
}

// A fieldDiff is a field, by path, whose value differs between two Configs.
type fieldDiff struct {
	path string
	a, b any
}

// fieldDiffs lists the fields in which a and b differ.
func fieldDiffs(a, b sidecar.Config) []fieldDiff {
	var out []fieldDiff
	diffValue("", reflect.ValueOf(a), reflect.ValueOf(b), &out)
	return out
}

func diffValue(path string, a, b reflect.Value, out *[]fieldDiff) {
	switch {
	case a.Kind() == reflect.Struct:
		for i := range a.NumField() {
			name := a.Type().Field(i).Name
			if path != "" {
				name = path + "." + name
			}
			diffValue(name, a.Field(i), b.Field(i), out)
		}
	case a.Kind() == reflect.Pointer && !a.IsNil() && !b.IsNil() && a.Elem().Kind() == reflect.Struct:
		diffValue(path, a.Elem(), b.Elem(), out)
	case a.Kind() == reflect.Func:
		if a.IsNil() != b.IsNil() {
			*out = append(*out, fieldDiff{path, a.IsNil(), b.IsNil()})
		}
	case !reflect.DeepEqual(a.Interface(), b.Interface()):
		*out = append(*out, fieldDiff{path, a.Interface(), b.Interface()})
	}
}
