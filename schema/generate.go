package schema

// The Python client's constants (connector/python/ringside/_wire.py) are
// generated from this package's and package ring's constants; run
// `go generate ./schema/` after changing any of them (internal/wiregen's
// test fails until the file is regenerated).
//
//go:generate go run ../internal/wiregen/gen -root ..
