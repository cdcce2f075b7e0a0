//go:build unix

package replication

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// readable reports whether c's socket has bytes to read now: a poll with
// no timeout, on the socket under TLS when c is a TLS connection. Any
// failure reads as false (see Stream.Pending).
func readable(c net.Conn) bool {
	if tc, ok := c.(interface{ NetConn() net.Conn }); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	n := 0
	// Control, not Read: this must never wait, and never take bytes
	// from the connection's reader.
	cerr := rc.Control(func(fd uintptr) {
		n, err = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0)
	})
	return cerr == nil && err == nil && n > 0
}
