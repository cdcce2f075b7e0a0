// Package backoff computes the waits between retries: a capped exponential
// step, and a jitter around it. The publisher's retries, the relay's
// reconnects, the startup wait for PostgreSQL and the consumer's
// redelivery delays all grow this way.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Step returns the wait after the attempt-th failure (1-based):
// min(maxD, base·2^(attempt-1)), without jitter. An attempt below 1 counts
// as the first.
func Step(base, maxD time.Duration, attempt int) time.Duration {
	d := base
	for i := 1; i < attempt && d < maxD; i++ {
		d *= 2
	}
	if d > maxD || d <= 0 { // d <= 0: overflow
		d = maxD
	}
	return d
}

// Jitter spreads d uniformly over [¾d, 1¼d], so that many clients retrying
// after one outage do not come back in lock-step.
func Jitter(d time.Duration) time.Duration {
	return d*3/4 + time.Duration(rand.Int64N(int64(d/2)+1))
}
