//go:build !race

package deltabench

const raceEnabled = false
