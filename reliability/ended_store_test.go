package reliability

import (
	"fmt"
	"testing"
	"time"

	"github.com/ringside-kv/ringside/schema"
)

// TestStoreDiscardedWhenSessionEndsMidCopy: a Store's copy is held
// (userfaultfd on its last engine page) while its session ends with a
// Detach; then the copy completes. The engine may reuse the pages once the
// Detach is answered, so the sidecar must not commit what the copy read: a
// later lookup from another session of the instance misses. Without the
// Detach (the control), the same store commits and hits.
func TestStoreDiscardedWhenSessionEndsMidCopy(t *testing.T) {
	row := record(t, "Lifecycle", "an engine's Store copy is held (userfaultfd on its last engine page); the engine detaches (and, in the control, does not); then the copy completes",
		"a store whose session ended before its copy did is never committed: a later Lookup misses every block; the control's store is committed and hits", "")
	const n = 4
	for _, detach := range []bool{true, false} {
		t.Run(fmt.Sprintf("detach=%v", detach), func(t *testing.T) {
			sc := startSidecar(t, newDir(t), "--pool.bytes", fmt.Sprint(4*n*slot))
			o := opts(sc.sock, "ended-store")
			o.Timeout = 5 * time.Second
			ac := dial(t, o)
			a := &tenant{name: "ended-store", c: ac, d: digests("ended-store", n), n: n, tag: 0xA, next: 2}
			// The last page is the missing one: the sidecar's liveness probe
			// reads the region's first.
			src := stalledOrSkip(t, n, func(i int, p []byte) { fillPage(p, a.digest(i), a.tag) }, n-1)
			if src.page != slot {
				t.Skipf("the OS page is %d bytes; the test needs %d-byte pages", src.page, slot)
			}
			if err := ac.RegisterRegion(regionOver(1, src.mem).reg); err != nil {
				t.Fatal(err)
			}
			if _, err := ac.PutHashes(1, a.d, false); err != nil {
				t.Fatal(err)
			}
			seq := submitStore(t, ac, a.view(), 1, iota32(n))
			if err := src.waitFault(10 * time.Second); err != nil {
				t.Fatalf("the store copy never reached its engine memory: %v", err)
			}
			// A reader of the same instance, attached while the writer lives
			// (the namespace and instance stay).
			bc := dial(t, o)
			if _, err := bc.PutHashes(2, a.d, false); err != nil {
				t.Fatal(err)
			}
			var derr error
			if detach {
				derr = ac.Close() // Detach, and its reply
			}
			if err := src.resolve(); err != nil {
				t.Fatal(err)
			}
			stored := -1
			if !detach {
				r, err := awaitStore(ac, seq)
				if err != nil {
					t.Fatalf("the store: %v", err)
				}
				stored = int(r.Stored)
			}
			// Until the copy has ended and its slots are committed or freed.
			t0 := time.Now()
			var p poolStats
			for time.Since(t0) < 10*time.Second {
				if p = sc.state().Pool; p.Writing == 0 {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			hits, err := bc.Lookup(schema.View{Batch: 2, Count: n})
			if err != nil {
				t.Fatal(err)
			}
			row.add("detach %v (err %v): store reply stored %d; %d writing after the copy; a later lookup finds %d of %d blocks", detach, derr, stored, p.Writing, hits, n)
			switch {
			case p.Writing != 0:
				t.Fatalf("the store copy is still writing %d slots", p.Writing)
			case detach && hits != 0:
				t.Errorf("a store whose session detached during its copy was committed: a later lookup finds %d of %d blocks", hits, n)
			case !detach && (stored != n || hits != n):
				t.Errorf("the control's store: stored %d, a later lookup finds %d, want %d", stored, hits, n)
			}
			checkAlive(t, sc)
		})
	}
}
