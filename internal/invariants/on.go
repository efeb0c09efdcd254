//go:build invariants || race

package invariants

// Enabled is true: this build has the invariants or the race build tag.
const Enabled = true
