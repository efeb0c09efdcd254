package schema

// The Python client's wire (connector/python/ringside/_wire_schema.py and
// _wire_ring.py: the constants under their public names, the name tables,
// and each record's fixed header from its //wire:struct directive) is
// generated from this package and package ring; run `go generate ./schema/`
// after changing any of them (internal/wiregen's test fails until the files
// are regenerated).
//
//go:generate go run ../internal/wiregen/gen -root ..
