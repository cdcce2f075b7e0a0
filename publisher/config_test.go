package publisher

import (
	"errors"
	"testing"
	"time"
)

// New and NewBatch refuse a bad Config or Option before they touch the
// connection, with the error naming the value.
func TestConfigAndOptionsValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		opts []Option
		want error
	}{
		{"defaults", Config{}, nil, nil},
		{"ack timeout below the limit config validation uses", Config{AckTimeout: MinAckTimeout - time.Millisecond}, nil, ErrInvalidConfig},
		{"ack timeout at the limit", Config{AckTimeout: MinAckTimeout}, nil, nil},
		{"window too large", Config{MaxInFlight: MaxMaxInFlight + 1}, nil, ErrInvalidConfig},
		{"window bytes too small", Config{MaxInFlightBytes: MinMaxInFlightBytes - 1}, nil, ErrInvalidConfig},
		{"retry range upside down", Config{RetryMin: time.Second, RetryMax: time.Millisecond}, nil, ErrInvalidConfig},
		{"nil logger", Config{}, []Option{WithLogger(nil)}, ErrInvalidOption},
		{"nil observer", Config{}, []Option{WithObserver(nil)}, ErrInvalidOption},
		{"nil stream lookup", Config{}, []Option{WithStreamLookup(nil)}, ErrInvalidOption},
		{"nil expected stream", Config{}, []Option{WithExpectedStream(nil)}, ErrInvalidOption},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tt.cfg
			err := cfg.setDefaults()
			if err == nil {
				_, err = applyOptions(tt.opts)
			}
			if !errors.Is(err, tt.want) || (tt.want == nil) != (err == nil) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if tt.want == nil {
				return
			}
			// The constructors refuse it before using the (nil) connection.
			if _, err := New(nil, tt.cfg, tt.opts...); !errors.Is(err, tt.want) {
				t.Fatalf("New: %v, want %v", err, tt.want)
			}
			if _, err := NewBatch(nil, nil, tt.cfg, BatchConfig{}, tt.opts...); !errors.Is(err, tt.want) {
				t.Fatalf("NewBatch: %v, want %v", err, tt.want)
			}
		})
	}
}
