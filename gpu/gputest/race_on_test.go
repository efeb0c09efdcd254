//go:build race

package gputest

const raceEnabled = true
