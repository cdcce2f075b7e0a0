package router

import "fmt"

// Payload limits.
const (
	// DefaultMaxPayload is the NATS server's default max_payload (1 MiB).
	DefaultMaxPayload = 1 << 20
	// MinMaxPayload is the smallest max payload New accepts: the room a
	// dead-letter record needs once every row value is truncated away.
	MinMaxPayload = 4096
)

// Option configures a Router.
type Option func(*options) error

type options struct {
	maxPayload int
}

// WithMaxPayload sets the largest message, data plus encoded headers, that
// Route produces and that DeadLetter's records fit in; pass the NATS
// server's max_payload (nats.Conn.MaxPayload). Default DefaultMaxPayload;
// it must be at least MinMaxPayload.
func WithMaxPayload(n int) Option {
	return func(o *options) error {
		if n < MinMaxPayload {
			return fmt.Errorf("%w: max payload %d is below the minimum %d", ErrInvalidOption, n, MinMaxPayload)
		}
		o.maxPayload = n
		return nil
	}
}
