//go:build !unix

package replication

import "net"

// readable reports false: without a poll of the socket only the
// connection's read buffer tells what is waiting (see Stream.Pending).
func readable(net.Conn) bool { return false }
