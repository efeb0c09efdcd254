package sidecar

import (
	"time"
)

// Accept errors other than a closed listener (EMFILE and ENFILE when the
// descriptors run out, ENOBUFS, ENOMEM, ECONNABORTED) are the system's
// state, not the sidecar's end: Serve backs off and accepts again, as
// net/http does. Connections wait in the socket's backlog meanwhile.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// acceptFailed counts and logs a failed accept and waits before the next
// one: 5 ms after the first failure in a row, doubling up to 1 s. It
// returns early when the server stops. *delay is the last wait (zero after
// a successful accept).
func (s *Server) acceptFailed(err error, delay *time.Duration) {
	*delay = min(max(2**delay, acceptBackoffMin), acceptBackoffMax)
	s.met.acceptErrors.Inc()
	s.log.Warn().Err(err).Dur("retry_in", *delay).Msg("accept failed; retrying (connections wait in the backlog)")
	t := time.NewTimer(*delay)
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.stop:
	}
}
