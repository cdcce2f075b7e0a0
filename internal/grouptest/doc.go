// Package grouptest holds the process-level tests of consumer groups:
// events written through the real relay, consumed by several OS processes
// of one group (this package's test binary, re-executed as a member) that
// are killed, restarted, joined and cut off from their database, and the
// database checked afterwards for exactly-once, in-order application.
package grouptest
