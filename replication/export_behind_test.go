package replication

// Ends exposes the positions Behind compares, for the tests' logs.
func (s *Stream) Ends() (received, serverEnd, startEnd LSN) {
	return s.received, s.serverEnd, s.startEnd
}
