package cli

import (
	"bytes"
	"strings"
	"testing"
)

// TestServeCUDACopyFlags: --copy.cuda-chunk-bytes and --copy.cuda-inflight
// reach the sidecar's settings (64MiB and 8 when not given), and values out
// of bounds are refused naming their flags.
func TestServeCUDACopyFlags(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want []string
	}{
		{nil, []string{"CUDAChunkBytes:67108864 ", "CopyCUDAInflight:8 "}},
		{[]string{"--copy.cuda-chunk-bytes", "128MiB", "--copy.cuda-inflight", "16"}, []string{"CUDAChunkBytes:134217728 ", "CopyCUDAInflight:16 "}},
	} {
		app := App()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		if err := app.Run(append([]string{"ringside", "serve", "--check-config", "--dir", "/dev/shm/x"}, tt.args...)); err != nil {
			t.Fatalf("%v: %v", tt.args, err)
		}
		for _, w := range tt.want {
			if !strings.Contains(out.String(), w) {
				t.Errorf("%v: settings do not hold %q:\n%s", tt.args, w, out.String())
			}
		}
	}
	app := App()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	err := app.Run([]string{"ringside", "serve", "--check-config", "--dir", "/dev/shm/x", "--copy.cuda-chunk-bytes", "2GiB", "--copy.cuda-inflight", "65"})
	if err == nil {
		t.Fatal("out-of-bounds CUDA copy settings accepted")
	}
	for _, flag := range []string{"--copy.cuda-chunk-bytes", "--copy.cuda-inflight"} {
		if !strings.Contains(err.Error(), flag) {
			t.Errorf("error does not name %s: %v", flag, err)
		}
	}
}
