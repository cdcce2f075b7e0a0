package relay

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/replication"
)

// TestReconnectWait: while the primary is gone, whichever session meets it
// first (the stream, the publication check on its held connection) makes
// the relay retry within a second, however many attempts failed; other
// failures back off towards ReconnectMax. Without the cap on a server gone,
// the failover tests saw a 1.13 s wait after the publication check read an
// unexpected EOF from the killed primary.
func TestReconnectWait(t *testing.T) {
	cfg := Config{ReconnectMin: DefaultReconnectMin, ReconnectMax: DefaultReconnectMax}
	reset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	for _, c := range []struct {
		name   string
		err    error
		capped bool
	}{
		{"no primary answers", fmt.Errorf("connect: %w", replication.ErrNoPrimary), true},
		{"publication check meets the killed primary", fmt.Errorf("read the WAL position: %w", io.ErrUnexpectedEOF), true},
		{"stream meets the killed primary", fmt.Errorf("receive replication message: receive message failed: %w", io.ErrUnexpectedEOF), true},
		{"connection reset", fmt.Errorf("read the WAL position: %w", reset), true},
		{"server shutting down", fmt.Errorf("read the WAL position: %w", &pgconn.PgError{Code: pgerrcode.AdminShutdown}), true},
		{"server crashed", fmt.Errorf("receive: %w", &pgconn.PgError{Code: pgerrcode.CrashShutdown}), true},
		{"password rejected", &pgconn.PgError{Code: pgerrcode.InvalidPassword}, false},
		{"anything else", errors.New("decode: unknown message type"), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			for attempt := 1; attempt <= 20; attempt++ {
				w := reconnectWait(cfg, c.err, attempt)
				if c.capped && w > connectRetryMax {
					t.Fatalf("attempt %d waits %s, want ≤ %s", attempt, w, connectRetryMax)
				}
				if !c.capped && attempt == 20 && w < cfg.ReconnectMax*3/4 {
					t.Fatalf("attempt %d waits %s, want the backoff grown to about %s", attempt, w, cfg.ReconnectMax)
				}
			}
		})
	}
}
