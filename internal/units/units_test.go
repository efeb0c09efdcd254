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
