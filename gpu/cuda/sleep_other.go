//go:build !linux

package cuda

import "time"

func setTimerSlack() {}

func pollSleep(d time.Duration) { time.Sleep(d) }
