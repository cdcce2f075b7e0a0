package consumer

import (
	"math/rand/v2"
	"time"

	expbackoff "github.com/outbox-relay/outbox-relay/internal/backoff"
)

// backoff returns the redelivery delay after the attempt-th failure (1-based):
// an exponential step min(max, base*2^(attempt-1)), jittered uniformly into
// its upper half so that aggregates failing together (a database outage) do
// not come back in lock-step, while the delay still grows with every attempt.
// rnd returns a float in [0, 1).
func backoff(attempt int, base, max time.Duration, rnd func() float64) time.Duration {
	d := expbackoff.Step(base, max, attempt)
	half := d / 2
	return half + time.Duration(rnd()*float64(d-half))
}

func jitter() float64 { return rand.Float64() }
