package publisher

import (
	"testing"
	"time"
)

func TestAckWait(t *testing.T) {
	ms := time.Millisecond
	repeat := func(d time.Duration, n int) []time.Duration {
		out := make([]time.Duration, n)
		for i := range out {
			out[i] = d
		}
		return out
	}
	for _, tc := range []struct {
		name       string
		ackTimeout time.Duration
		samples    []time.Duration
		want       time.Duration // exact, or the least when atLeast
		atLeast    bool
	}{
		{"no answer yet", 5 * time.Second, nil, 5 * time.Second, false},
		{"answers well within AckTimeout", 5 * time.Second, repeat(2*ms, 100), 5 * time.Second, false},
		{"a first late answer: three round trips", 100 * ms, []time.Duration{3 * time.Second}, 9 * time.Second, false},
		{"answers steadily later than AckTimeout", 100 * ms, repeat(800*ms, 200), 800 * ms, true},
		{"a backlog longer than maxAckWait", time.Second, repeat(5*time.Minute, 10), maxAckWait, false},
		{"AckTimeout above maxAckWait", 2 * time.Minute, repeat(10*time.Minute, 10), 2 * time.Minute, false},
		{"back in time after a slow spell", 100 * ms, append(repeat(3*time.Second, 20), repeat(ms, 200)...), 100 * ms, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newAckWait(tc.ackTimeout)
			for _, s := range tc.samples {
				w.sample(s)
			}
			got := w.wait()
			if tc.atLeast && (got < tc.want || got > 2*tc.want) || !tc.atLeast && got != tc.want {
				t.Fatalf("wait %s after %d samples, want %s (at least: %t)", got, len(tc.samples), tc.want, tc.atLeast)
			}
		})
	}
}
