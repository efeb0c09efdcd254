package procmem

import (
	"bytes"
	"errors"
	"os"
	"testing"
)

func TestReadWriteSelf(t *testing.T) {
	remote := make([]byte, 3*IOVMax+7)
	for i := range remote {
		remote[i] = byte(i * 7)
	}
	base := Addr(remote)
	tests := []struct {
		name      string
		ranges    []Range
		wantCalls int
	}{
		{"one", []Range{{0, base, uint64(len(remote))}}, 1},
		{"zero-length ranges skipped", []Range{{0, base, 0}, {0, base, 10}, {10, base + 10, 0}}, 1},
		{"all zero-length", []Range{{0, base, 0}}, 0},
		{"none", nil, 0},
		{"chunked", func() []Range {
			// 3*IOVMax+7 one-byte ranges, reversed so nothing is adjacent.
			var rs []Range
			for i := range len(remote) {
				rs = append(rs, Range{uint64(i), base + uint64(len(remote)-1-i), 1})
			}
			return rs
		}(), 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			local := make([]byte, len(remote))
			st, err := Read(os.Getpid(), local, tt.ranges)
			if err != nil {
				t.Fatal(err)
			}
			var want int64
			for _, r := range tt.ranges {
				want += int64(r.Len)
				if !bytes.Equal(local[r.Local:r.Local+r.Len], remote[r.Remote-base:r.Remote-base+r.Len]) {
					t.Fatalf("range %+v differs", r)
				}
			}
			if st.Bytes != want || st.Calls != tt.wantCalls {
				t.Errorf("Stats = %+v, want %d bytes in %d calls", st, want, tt.wantCalls)
			}
			// Write back a changed copy and check it landed.
			for i := range local {
				local[i] ^= 0xff
			}
			if _, err := Write(os.Getpid(), local, tt.ranges); err != nil {
				t.Fatal(err)
			}
			for _, r := range tt.ranges {
				if !bytes.Equal(local[r.Local:r.Local+r.Len], remote[r.Remote-base:r.Remote-base+r.Len]) {
					t.Fatalf("write of range %+v did not land", r)
				}
			}
		})
	}
}

func TestLocalBounds(t *testing.T) {
	local := make([]byte, 16)
	for _, rs := range [][]Range{
		{{0, 0x1000, 17}},
		{{16, 0x1000, 1}},
		{{1<<64 - 1, 0x1000, 2}},
		{{0, 1<<64 - 4, 8}},
	} {
		if _, err := Read(os.Getpid(), local, rs); err == nil {
			t.Errorf("Read(%v) succeeded", rs)
		}
	}
}

func TestErrorNamesPidAndAddr(t *testing.T) {
	_, err := Read(os.Getpid(), make([]byte, 8), []Range{{0, 8, 8}}) // address 8: unmapped
	var pe *Error
	if !errors.As(err, &pe) || pe.Addr != 8 || pe.PID != os.Getpid() {
		t.Fatalf("err = %v", err)
	}
}
