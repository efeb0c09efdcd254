package units

import "testing"

func TestParseBytes(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		bad  bool
	}{
		{"4096", 4096, false},
		{"64KiB", 64 << 10, false},
		{"1.5GiB", 3 << 29, false},
		{"16GB", 16e9, false},
		{"2g", 2 << 30, false},
		{" 8 MiB ", 8 << 20, false},
		{"", 0, true},
		{"-1", 0, true},
		{"12parsecs", 0, true},
		{"1e30", 0, true},
	}
	for _, tt := range tests {
		got, err := ParseBytes(tt.in)
		if (err != nil) != tt.bad || got != tt.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d (error %v)", tt.in, got, err, tt.want, tt.bad)
		}
	}
}

func TestFormatBytes(t *testing.T) {
	for _, tt := range []struct {
		in   uint64
		want string
	}{{0, "0"}, {100, "100"}, {4096, "4KiB"}, {256 << 10, "256KiB"}, {1 << 20, "1MiB"}, {64 << 20, "64MiB"},
		{3 << 29, "1536MiB"}, {1 << 30, "1GiB"}, {2 << 40, "2TiB"}} {
		got := FormatBytes(tt.in)
		if got != tt.want {
			t.Errorf("FormatBytes(%d) = %q, want %q", tt.in, got, tt.want)
		}
		if back, err := ParseBytes(got); err != nil || back != tt.in {
			t.Errorf("ParseBytes(FormatBytes(%d)) = %d, %v", tt.in, back, err)
		}
	}
}
