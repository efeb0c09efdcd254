//go:build invariants || race

package sidecar

// invariantsEnabled turns on the sidecar's debug checks: the machine checks
// its invariants after every call, and freed pool slots are poisoned.
const invariantsEnabled = true
