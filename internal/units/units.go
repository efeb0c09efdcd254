// Package units parses the sizes that ringside's and ringside-bench's flags
// take (4096, 64KiB, 1.5GiB, 16GB, 16G).
package units

import (
	"fmt"
	"strconv"
	"strings"
)

// ParseBytes parses sizes like 4096, 64KiB, 1.5GiB, 16GB (powers of 1000)
// or 16G (powers of 1024).
func ParseBytes(s string) (uint64, error) {
	s = strings.TrimSpace(s)
	i := len(s)
	for i > 0 && (s[i-1] < '0' || s[i-1] > '9') && s[i-1] != '.' {
		i--
	}
	num, unit := s[:i], strings.ToLower(strings.TrimSpace(s[i:]))
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || f < 0 {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	mult := map[string]float64{
		"": 1, "b": 1,
		"k": 1 << 10, "kib": 1 << 10, "kb": 1e3,
		"m": 1 << 20, "mib": 1 << 20, "mb": 1e6,
		"g": 1 << 30, "gib": 1 << 30, "gb": 1e9,
		"t": 1 << 40, "tib": 1 << 40, "tb": 1e12,
	}[unit]
	if mult == 0 {
		return 0, fmt.Errorf("%q: unknown unit %q", s, unit)
	}
	v := f * mult
	if v > 1<<62 {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return uint64(v), nil
}

// FormatBytes writes v as ParseBytes reads it, in the largest binary unit
// that divides it (256KiB, 64MiB, 1GiB), or as plain bytes.
func FormatBytes(v uint64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if v != 0 && v%(1<<u.shift) == 0 {
			return strconv.FormatUint(v>>u.shift, 10) + u.name
		}
	}
	return strconv.FormatUint(v, 10)
}
