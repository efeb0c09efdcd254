//go:build !(invariants || race)

package machine

const invariantsEnabled = false
