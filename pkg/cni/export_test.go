package cni

import "time"

// SetLimits shortens the server's bounds for tests.
func SetLimits(s *Server, readTimeout time.Duration, maxConns int) {
	s.readTimeout, s.maxConns = readTimeout, maxConns
}
