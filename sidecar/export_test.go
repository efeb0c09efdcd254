package sidecar

import "time"

// SetDeviceFailDrain sets how long a sidecar whose GPU failed keeps serving
// before it shuts down (deviceFailDrain), for a test of another package
// that runs a sidecar in a process of its own. It is not restored: the
// failure's goroutine may read it at any time.
func SetDeviceFailDrain(d time.Duration) { deviceFailDrain = d }
