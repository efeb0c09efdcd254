package cli

import (
	"bytes"
	"strings"
	"testing"
)

// TestBenchMoved: `ringside bench ...`, with any arguments, points at
// ringside-bench instead of failing on an unknown command or flag.
func TestBenchMoved(t *testing.T) {
	for _, args := range [][]string{{"bench"}, {"bench", "ring", "--json", "--rounds", "5"}} {
		app := App()
		var out bytes.Buffer
		app.Writer, app.ErrWriter = &out, &out
		err := app.Run(append([]string{"ringside"}, args...))
		if err == nil || !strings.Contains(err.Error(), "ringside-bench ring|poll|delta|replay|copy") {
			t.Errorf("%v: %v (output %q)", args, err, out.String())
		}
	}
	for _, c := range App().Commands {
		if c.Name == "bench" && !c.Hidden {
			t.Error("the bench pointer is listed in the help")
		}
	}
}
