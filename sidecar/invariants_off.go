//go:build !(invariants || race)

package sidecar

const invariantsEnabled = false
