package backoff

import (
	"math"
	"testing"
	"time"
)

func TestStep(t *testing.T) {
	const ms = time.Millisecond
	tests := []struct {
		base, maxD time.Duration
		attempt    int
		want       time.Duration
	}{
		{50 * ms, 5 * time.Second, 0, 50 * ms},
		{50 * ms, 5 * time.Second, 1, 50 * ms},
		{50 * ms, 5 * time.Second, 2, 100 * ms},
		{50 * ms, 5 * time.Second, 4, 400 * ms},
		{50 * ms, 5 * time.Second, 8, 5 * time.Second}, // 6.4 s capped
		{50 * ms, 5 * time.Second, 1000, 5 * time.Second},
		{time.Duration(1) << 62, math.MaxInt64, 3, math.MaxInt64}, // overflow
	}
	for _, tt := range tests {
		if got := Step(tt.base, tt.maxD, tt.attempt); got != tt.want {
			t.Errorf("Step(%s, %s, %d) = %s, want %s", tt.base, tt.maxD, tt.attempt, got, tt.want)
		}
	}
}

func TestJitter(t *testing.T) {
	for _, d := range []time.Duration{0, 1, 4, 100 * time.Millisecond, 30 * time.Second} {
		for range 1000 {
			if got := Jitter(d); got < d*3/4 || got > d*3/4+d/2 {
				t.Fatalf("Jitter(%s) = %s, outside [¾d, 1¼d]", d, got)
			}
		}
	}
}
