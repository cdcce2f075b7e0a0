package publisher

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// Defaults and limits of Config, in one place: internal/config validates
// the YAML against the same values.
const (
	DefaultMaxInFlight = 4096
	// MaxMaxInFlight is the largest MaxInFlight: the window's bookkeeping
	// grows with it.
	MaxMaxInFlight          = 1 << 20
	DefaultMaxInFlightBytes = 64 << 20
	// MinMaxInFlightBytes is the smallest MaxInFlightBytes: less than a
	// message's headers.
	MinMaxInFlightBytes = 1 << 10
	DefaultAckTimeout   = 5 * time.Second
	// MinAckTimeout is the shortest AckTimeout: below it a loaded server's
	// ordinary round trip would count as lost and be retried.
	MinAckTimeout   = 100 * time.Millisecond
	DefaultRetryMin = 50 * time.Millisecond
	DefaultRetryMax = 5 * time.Second
)

// Config configures a Publisher.
type Config struct {
	// MaxInFlight bounds unacknowledged plus queued messages. Default
	// DefaultMaxInFlight, at most MaxMaxInFlight.
	MaxInFlight int
	// MaxInFlightBytes bounds their total size. Default
	// DefaultMaxInFlightBytes, at least MinMaxInFlightBytes. A single
	// message larger than this is still sent, alone.
	MaxInFlightBytes int
	// AckTimeout is how long to wait for an ack before retrying while the
	// broker answers in time; while its answers take longer, the wait
	// follows their round trips (ackWait). Default DefaultAckTimeout, at
	// least MinAckTimeout.
	AckTimeout time.Duration
	// RetryMin and RetryMax bound the exponential retry backoff. Defaults
	// DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration
}

func (c *Config) setDefaults() error {
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if c.AckTimeout == 0 {
		c.AckTimeout = DefaultAckTimeout
	}
	if c.RetryMin == 0 {
		c.RetryMin = DefaultRetryMin
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultRetryMax
	}
	switch {
	case c.MaxInFlight < 1 || c.MaxInFlight > MaxMaxInFlight:
		return fmt.Errorf("%w: max_in_flight %d is out of range 1..%d", ErrInvalidConfig, c.MaxInFlight, MaxMaxInFlight)
	case c.MaxInFlightBytes < MinMaxInFlightBytes:
		return fmt.Errorf("%w: max_in_flight_bytes %d is below %d", ErrInvalidConfig, c.MaxInFlightBytes, MinMaxInFlightBytes)
	case c.AckTimeout < MinAckTimeout:
		return fmt.Errorf("%w: ack_timeout %s is below %s", ErrInvalidConfig, c.AckTimeout, MinAckTimeout)
	case c.RetryMin <= 0 || c.RetryMax < c.RetryMin:
		return fmt.Errorf("%w: retry backoff %s..%s is not a range", ErrInvalidConfig, c.RetryMin, c.RetryMax)
	}
	return nil
}

// Observer receives publisher events, for metrics. Methods are called from
// the publishers' Run goroutines and must not block.
type Observer interface {
	Published(subject string, duplicate bool, latency time.Duration)
	Retried(class string)
	DeadLettered(class string)
}

type nopObserver struct{}

func (nopObserver) Published(string, bool, time.Duration) {}
func (nopObserver) Retried(string)                        {}
func (nopObserver) DeadLettered(string)                   {}

// Option configures a Publisher or a Batch; it fails with ErrInvalidOption
// for a value it cannot use.
type Option func(*options) error

type options struct {
	log    *zap.Logger
	obs    Observer
	lookup func(ctx context.Context, subject string) error
	expect func(subject string) string
}

// applyOptions returns the defaults with opts applied.
func applyOptions(opts []Option) (options, error) {
	o := options{log: zap.NewNop(), obs: nopObserver{}}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return o, err
		}
	}
	return o, nil
}

// WithLogger sets the logger (default: no logging).
func WithLogger(l *zap.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// WithObserver sets the metrics observer (default: none).
func WithObserver(obs Observer) Option {
	return func(o *options) error {
		if obs == nil {
			return fmt.Errorf("%w: nil observer", ErrInvalidOption)
		}
		o.obs = obs
		return nil
	}
}

// WithStreamLookup sets how the publisher asks whether any stream is bound
// to a subject after repeated "no responders" answers (default: the
// JetStream API of the connection). The function returns ErrNoStream when
// none is. A Batch ignores it: its failures go to the per-key publisher.
func WithStreamLookup(f func(ctx context.Context, subject string) error) Option {
	return func(o *options) error {
		if f == nil {
			return fmt.Errorf("%w: nil stream lookup", ErrInvalidOption)
		}
		o.lookup = f
		return nil
	}
}

// WithExpectedStream sets which stream must store a message, by its
// subject (default: any stream). An answer that looks like an ack but
// names another stream is not an ack: a core NATS subscriber on the
// subject answering in JetStream's shape, or a stream other than the one
// meant. It is logged with what it claimed and the message is retried, so
// it is never settled as stored. A Batch ignores it: it checks that its
// answers name its BatchConfig.Stream.
func WithExpectedStream(f func(subject string) string) Option {
	return func(o *options) error {
		if f == nil {
			return fmt.Errorf("%w: nil expected stream", ErrInvalidOption)
		}
		o.expect = f
		return nil
	}
}
