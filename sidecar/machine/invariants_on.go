//go:build invariants || race

package machine

// invariantsEnabled turns on the Machine's self-checks after every call
// (builds with -tags invariants, and every -race build).
const invariantsEnabled = true
