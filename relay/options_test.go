package relay_test

import (
	"errors"
	"testing"

	"github.com/outbox-relay/outbox-relay/relay"
)

// Options validate their input: New fails with ErrInvalidOption before it
// touches the connection.
func TestNewRejectsInvalidOptions(t *testing.T) {
	for name, opt := range map[string]relay.Option{
		"nil logger":    relay.WithLogger(nil),
		"nil observer":  relay.WithObserver(nil),
		"nil readiness": relay.WithReadiness(nil),
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := relay.New(relay.Config{}, nil, opt); !errors.Is(err, relay.ErrInvalidOption) {
				t.Fatalf("New = %v, want ErrInvalidOption", err)
			}
		})
	}
}
