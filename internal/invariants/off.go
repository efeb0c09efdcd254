//go:build !invariants && !race

package invariants

// Enabled is false: a release build, without the invariants or the race
// build tag; code under `if invariants.Enabled` compiles away.
const Enabled = false
