package relay

import (
	"time"

	"github.com/outbox-relay/outbox-relay/publisher"
)

// Observer receives the relay's events, for metrics. Methods are called
// from the relay's goroutines and must not block.
type Observer interface {
	publisher.Observer
	// Unroutable counts a row the router could not map, by reason class.
	Unroutable(class string)
	// Settled reports a message acknowledged (or dead-lettered) by the
	// broker, with the commit time of its transaction.
	Settled(res publisher.Result, commitTime time.Time)
	// Reconnected counts a restart of the replication session after it
	// failed or was interrupted.
	Reconnected()
	// StandingBy counts a standby's attempt to take the slot while another
	// instance holds it. It is apart from Reconnected: in a healthy HA pair
	// the standby retries all day long, and that is no instability.
	StandingBy()
}

// NopObserver ignores every event.
type NopObserver struct{}

// Published implements publisher.Observer.
func (NopObserver) Published(string, bool, time.Duration) {}

// Retried implements publisher.Observer.
func (NopObserver) Retried(string) {}

// DeadLettered implements publisher.Observer.
func (NopObserver) DeadLettered(string) {}

// Unroutable implements Observer.
func (NopObserver) Unroutable(string) {}

// Settled implements Observer.
func (NopObserver) Settled(publisher.Result, time.Time) {}

// Reconnected implements Observer.
func (NopObserver) Reconnected() {}

// StandingBy implements Observer.
func (NopObserver) StandingBy() {}
