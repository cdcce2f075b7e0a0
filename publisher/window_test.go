package publisher

import (
	"testing"
	"time"
)

// TestCheckTimer checks the Run loops' deadline timer: nothing armed
// without a deadline, never sooner than tickEvery, an earlier deadline
// moves it, a later one does not postpone it.
func TestCheckTimer(t *testing.T) {
	c := newCheckTimer()
	defer c.stop()
	c.arm(time.Time{})
	if c.armed {
		t.Fatal("armed without a deadline")
	}
	start := time.Now()
	c.arm(start) // due now: fires after tickEvery
	if !c.armed || c.at.Before(start.Add(tickEvery)) {
		t.Fatalf("armed %v for %v, want at least %v", c.armed, c.at.Sub(start), tickEvery)
	}
	at := c.at
	c.arm(start.Add(time.Hour))
	if !c.at.Equal(at) {
		t.Fatalf("a later deadline moved the timer from %v to %v", at.Sub(start), c.at.Sub(start))
	}
	select {
	case <-c.C():
		c.fired()
	case <-time.After(10 * time.Second):
		t.Fatal("the timer did not fire")
	}
	if since := time.Since(start); since < tickEvery {
		t.Fatalf("fired after %v, want at least %v", since, tickEvery)
	}
	if c.armed {
		t.Fatal("still armed after firing")
	}

	c.arm(time.Now().Add(time.Hour))
	soon := time.Now().Add(2 * tickEvery)
	c.arm(soon)
	if !c.at.Equal(soon) {
		t.Fatalf("an earlier deadline did not move the timer: at %v, want %v", c.at, soon)
	}
}
