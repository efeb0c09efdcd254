package schema_test

import (
	"errors"
	"testing"

	"github.com/ringside-kv/ringside/schema"
)

// Every decoder, on any input, either fails with an error wrapping
// ErrMalformed or returns a value whose re-encoding decodes to the same
// value. None panics. Seed corpora live in testdata/fuzz/FuzzX; run one with
//
//	go test -run '^$' -fuzz '^FuzzLoad$' -fuzztime 30s ./schema/

// fuzzCodec checks the property for one decoder: dec decodes b into a fresh
// value; enc re-encodes a decoded value.
func fuzzCodec(t *testing.T, b []byte, dec func([]byte) (any, error), enc func(any) []byte) {
	t.Helper()
	v, err := dec(b)
	if err != nil {
		if !errors.Is(err, schema.ErrMalformed) {
			t.Fatalf("error %v does not wrap ErrMalformed", err)
		}
		return
	}
	b2 := enc(v)
	v2, err := dec(b2)
	if err != nil {
		t.Fatalf("re-encoding of %+v does not decode: %v\ninput   %x\nencoded %x", v, err, b, b2)
	}
	if !same(v, v2) {
		t.Fatalf("re-encoding changes the value:\nfirst  %+v\nsecond %+v", v, v2)
	}
	// A canonical encoding is a fixed point.
	if b3 := enc(v2); string(b3) != string(b2) {
		t.Fatalf("encoding is not stable:\n%x\n%x", b2, b3)
	}
	if len(b2) > len(b) {
		t.Fatalf("re-encoding grew from %d to %d bytes", len(b), len(b2))
	}
}

func seeds(f *testing.F, bs ...[]byte) {
	for _, b := range bs {
		f.Add(b)
	}
	f.Add([]byte{})
}

func FuzzAttachRequest(f *testing.F) {
	seeds(f, sAttachRequest.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decAttachRequest, func(v any) []byte { m := v.(schema.AttachRequest); return m.Append(nil) })
	})
}

func FuzzAttachReply(f *testing.F) {
	seeds(f, sAttachReply.Append(nil), (&schema.AttachReply{Status: schema.ErrCodeBadVersion, Message: "v2"}).Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decAttachReply, func(v any) []byte { m := v.(schema.AttachReply); return m.Append(nil) })
	})
}

func FuzzPutHashes(f *testing.F) {
	seeds(f, sPutHashes32.Append(nil, 32), sPutHashes8.Append(nil, 8), (&schema.PutHashes{Batch: 3, Digests: digests(2, 16, 0)}).Append(nil, 16))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, w := range []int{8, 16, 32} {
			fuzzCodec(t, b, decPutHashes(w), func(v any) []byte { m := v.(schema.PutHashes); return m.Append(nil, w) })
		}
	})
}

func FuzzIDRequest(f *testing.F) {
	seeds(f, sPoll.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decID, func(v any) []byte { return v.(schema.IDRequest).Append(nil) })
	})
}

func FuzzLookup(f *testing.F) {
	seeds(f, sLookup.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decLookup, func(v any) []byte { m := v.(schema.Lookup); return m.Append(nil) })
	})
}

func FuzzAcquire(f *testing.F) {
	seeds(f, sAcquire.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decAcquire, func(v any) []byte { m := v.(schema.Acquire); return m.Append(nil) })
	})
}

func FuzzRetain(f *testing.F) {
	seeds(f, sRetain.Append(nil), sRetainEnd.Append(nil), sRetainOwner.Append(nil), sRetainEndOwner.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decRetain, func(v any) []byte { m := v.(schema.Retain); return m.Append(nil) })
	})
}

func FuzzRegisterRegion(f *testing.F) {
	seeds(f, sRegister.Append(nil), (&schema.RegisterRegion{Region: 1, Kind: schema.RegionHostProcess}).Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decRegisterRegion, func(v any) []byte { m := v.(schema.RegisterRegion); return m.Append(nil) })
	})
}

func FuzzCUDAExtra(f *testing.F) {
	one := schema.CUDAExtra{Allocations: []schema.CUDAAllocation{{Base: 1 << 40, Size: 2 << 20}}}
	seeds(f, sCUDAExtra.Append(nil), one.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decCUDAExtra, func(v any) []byte { m := v.(schema.CUDAExtra); return m.Append(nil) })
	})
}

func FuzzLoad(f *testing.F) {
	seeds(f, sLoad.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decLoad, func(v any) []byte { m := v.(schema.Load); return m.Append(nil) })
	})
}

func FuzzStore(f *testing.F) {
	seeds(f, sStore.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decStore, func(v any) []byte { m := v.(schema.Store); return m.Append(nil) })
	})
}

func FuzzChanges(f *testing.F) {
	seeds(f, sChanges.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decChanges, func(v any) []byte { m := v.(schema.Changes); return m.Append(nil) })
	})
}

func FuzzReply(f *testing.F) {
	seeds(f, sReply.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decReply, func(v any) []byte { m := v.(schema.Reply); return m.Append(nil) })
	})
}

func FuzzLeaseReply(f *testing.F) {
	seeds(f, sLeaseReply.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decLeaseReply, func(v any) []byte { m := v.(schema.LeaseReply); return m.Append(nil) })
	})
}

func FuzzStoreReply(f *testing.F) {
	seeds(f, sStoreReply.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decStoreReply, func(v any) []byte { m := v.(schema.StoreReply); return m.Append(nil) })
	})
}

func FuzzChangesReply(f *testing.F) {
	seeds(f, sChangesReply.Append(nil), sChangesReply32.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decChangesReply, func(v any) []byte { m := v.(schema.ChangesReply); return m.Append(nil) })
	})
}

func FuzzSnapshot(f *testing.F) {
	seeds(f, sSnapshot.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decSnapshot, func(v any) []byte { m := v.(schema.Snapshot); return m.Append(nil) })
	})
}

func FuzzSnapshotReply(f *testing.F) {
	seeds(f, sSnapshotReply16.Append(nil), sSnapshotReply32.Append(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		fuzzCodec(t, b, decSnapshotReply, func(v any) []byte { m := v.(schema.SnapshotReply); return m.Append(nil) })
	})
}
